"""The README and docs a new user reads: their commands run, their facts hold.

The README's first run and its Python example are run as written, in a
fresh directory with this venv's commands first on ``PATH``.
"""

import re
import subprocess
from pathlib import Path

from stagetools import PYTHON, clean_environ, run

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BIN = str(Path(PYTHON).parent)


def section(text, title):
    """Return the body of the ``## title...`` section of *text*."""
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def blocks(text, lang):
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def user_env(tmp_path):
    env = clean_environ()
    # As a user's shell has it: with PYTHONUNBUFFERED, print() writes a
    # line in pieces and four ranks' pieces interleave.
    env.pop("PYTHONUNBUFFERED", None)
    env["PATH"] = f"{BIN}:{env['PATH']}"
    stage = tmp_path / "stage"
    stage.mkdir()
    env.update(MPISTAGE_STAGE_DIR=str(stage), MPISTAGE_STAGE_FALLBACK="no")
    env["MPISTAGE_CACHE_DIR"] = str(tmp_path / "cache")
    return env


def test_readme_reads_in_a_new_users_order():
    titles = re.findall(r"^## (.*)$", README, re.M)
    wanted = ["Install", "A first run", "Choosing a mode", "Troubleshooting"]
    places = [next(i for i, t in enumerate(titles) if t.startswith(w)) for w in wanted]
    assert places == sorted(places), titles
    assert (
        "Layout" not in titles
        and "## Code layout" in (ROOT / "CONTRIBUTING.md").read_text()
    )


def test_readme_installs_what_can_be_installed_today():
    install = section(README, "Install")
    lines = [line for b in blocks(install, "sh") for line in b.splitlines()]
    assert any(line.startswith('pip install -e ".[mpich]"') for line in lines)
    assert any('"mpistage[mpich] @ git+' in line for line in lines)
    published = [line for line in lines if line.startswith('pip install "mpistage[')]
    assert all("@ git+" in line for line in published), published


def test_readme_first_run_runs_as_written(tmp_path):
    (script,) = blocks(section(README, "A first run"), "sh")
    result = run(["bash", "-euo", "pipefail", "-c", script], user_env(tmp_path),
                 cwd=tmp_path, timeout=300)  # fmt: skip
    assert result.returncode == 0, result
    ranks = sorted(re.findall(r"^([0-3]) \d+\.\d+\.\d+$", result.stdout, re.M))
    assert ranks == ["0", "1", "2", "3"], result
    assert "ranks 4, nodes 2" in result.stderr, result
    assert " 0 missed" in result.stderr, result


def test_readme_python_example_runs_as_written(tmp_path):
    (code,) = [b for b in blocks(README, "python") if "mpistage.staged" in b]
    assert code.startswith("from mpi4py import MPI\n")
    env = user_env(tmp_path)
    setup = (
        "mpistage pack -q -o app.mpistage numpy >/dev/null && "
        "python -c 'import numpy; numpy.save(\"weights.npy\", numpy.arange(6.0))'"
    )
    assert run(["bash", "-c", setup], env, cwd=tmp_path).returncode == 0
    (tmp_path / "example.py").write_text(code + "print(arr.shape, numpy.__name__)\n")
    mpiexec = str(Path(BIN) / "mpiexec")
    result = run([mpiexec, "-n", "2", PYTHON, "example.py"], env, cwd=tmp_path,
                 timeout=300)  # fmt: skip
    assert result.returncode == 0, result
    # The two ranks' lines may interleave in what mpiexec forwards.
    assert result.stdout.count("(6,)") == result.stdout.count("numpy") == 2, result


def test_readme_and_contributing_links_resolve():
    for doc in ("README.md", "CONTRIBUTING.md"):
        text = (ROOT / doc).read_text()
        for target in re.findall(r"\]\(([^)#]+)\)", text):
            if "://" not in target:
                assert (ROOT / target).exists(), f"{doc} links to missing {target}"


def test_troubleshooting_covers_what_new_users_hit():
    text = section(README, "Troubleshooting")
    for topic in ("missed", "stale", "/dev/shm", "hang", "MPI_THREAD_MULTIPLE",
                  "snapshot", "clean --cache"):  # fmt: skip
        assert topic in text, topic


def test_troubleshooting_commands_run(tmp_path):
    env = user_env(tmp_path)
    for line in re.findall(
        r"`(mpistage clean[^`]*)`", section(README, "Troubleshooting")
    ):
        args = line.split()
        if args[-1] in ("--older-than", "--max-size"):
            continue
        result = run([str(Path(BIN) / "mpistage"), *args[1:]], env, cwd=tmp_path)
        assert result.returncode == 0, result


def test_make_demo_installs_no_launcher_packages(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()  # no command found: everything would be installed
    script = str(ROOT / "scripts" / "ensure-system-packages")

    def wanted(need):
        proc = subprocess.run(["/bin/bash", script, "--list", need],
                              env={"PATH": str(empty)}, capture_output=True,
                              text=True, timeout=30)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return set(proc.stdout.split())

    assert wanted("demo") == {"fuse3", "strace", "gcc"}
    assert {"slurm-wlm", "munge", "openmpi-bin"} <= wanted("launchers")
    makefile = (ROOT / "Makefile").read_text()
    demo = re.search(r"^demo:(.*)$", makefile, re.M).group(1).split()
    assert "system" not in demo and "launchers" not in demo
    assert re.search(r"^system-demo:\n\t\./scripts/ensure-system-packages demo$",
                     makefile, re.M)  # fmt: skip


def test_readme_keeps_its_two_commands_and_ci_runs_make_test():
    two = section(README, "Two commands")
    assert "make demo" in two and "make test" in two
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_benchmarks_keep_current_tables_and_put_history_apart():
    current = (ROOT / "docs" / "benchmarks.md").read_text()
    history = (ROOT / "docs" / "benchmarks-history.md").read_text()
    assert "## Earlier figures" not in current and "## Earlier figures" in history
    assert "benchmarks-history.md" in current
    assert "## 1. The realistic layout" in current


RETIRED = re.compile(r"staging root|StagingDir|(?<![\w&])#\d{2,3}\b|\bissue \d{2,3}\b")


def test_one_word_per_idea_and_no_issue_numbers():
    """CONTRIBUTING.md's words: the node's place, never a "staging root" or a
    ``StagingDir``; and code and docs name no issue numbers (the history of
    the figures aside)."""
    found = []
    for path in sorted([*(ROOT / "src").rglob("*.py"), *(ROOT / "docs").rglob("*.md")]):
        if path.name == "benchmarks-history.md":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if RETIRED.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    for script in (ROOT / "bin" / "mpistage", ROOT / "bin" / "mpistage-env"):
        found += [f"{script.name}: {m}" for m in RETIRED.findall(script.read_text())]
    assert found == [], "\n".join(found)
