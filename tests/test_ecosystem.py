"""Run what plain python runs: pkg_resources, pkgutil, pytest, coverage, editable
installs, learning from every rank, data files, child processes.

Each test compares with plain python where it can, and checks with strace
that after activation no rank but rank 0 touches the originals of the
bundled roots.
"""

import json
import py_compile
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from mpistage.runtime import bundlefile
from mpistage.runtime.read import read_manifest
from recordtools import need_report, replay
from stagetools import (
    MPIEXEC,
    PYTHON,
    clean_environ,
    install_record,
    mpirun,
    mpistage,
    results,
    run,
    write_target,
)

pytestmark = pytest.mark.usefixtures("reap_mpich_shm")
MARK = "/nonexistent-mpistage-activation-mark"


def traced(ranks, args, env, cwd=None):
    """Run ``mpiexec -n RANKS python ARGS`` under strace; return (result, traces)."""
    if shutil.which("strace") is None:
        pytest.skip("no strace")
    prefix = Path(env["MPISTAGE_TEST_OUT"]).parent / "trace"
    command = ["strace", "-f", "-ff", "-e", "trace=%file", "-o", prefix]
    result = run([*command, MPIEXEC, "-n", ranks, PYTHON, *args], env=env, cwd=cwd)
    return result, sorted(prefix.parent.glob("trace.*"))


def touched_after_mark(traces, paths):
    """Return {pid: lines} of accesses to *paths* after each process's mark."""
    found = {}
    for trace in traces:
        lines = trace.read_text(errors="replace").splitlines()
        marked = [i for i, line in enumerate(lines) if MARK in line]
        if not marked:
            continue
        hits = [line for line in lines[marked[0] :] if any(p in line for p in paths)]
        if hits:
            found[int(trace.suffix[1:])] = hits
    return found


def only_rank0_touches(traces, paths, pids):
    """Assert that after activation only rank 0 (or nobody) reads *paths*."""
    touched = touched_after_mark(traces, [str(p) + "/" for p in paths])
    others = {pid: lines[:3] for pid, lines in touched.items() if pid != pids[0]}
    assert others == {}, others


MARKED = f"import os as _o\n_o.path.exists({MARK!r})\n"


@pytest.fixture
def tiny_env(stage_env, tiny):
    return dict(stage_env, PYTHONPATH=str(tiny["site"]))


def plain_result(env):
    """The result a plain (non-MPI-launched) run emitted."""
    path = Path(env["MPISTAGE_TEST_OUT"]) / "plain.json"
    data = json.loads(path.read_text())
    path.unlink()  # the ranks of the next run emit theirs there
    return data


def run_both(tmp_path, env, body, bundle, ranks=4):
    """Plain python, then the runner at *ranks* ranks on 2 nodes, under strace."""
    target = write_target(tmp_path / "app.py", MARKED + body)
    plain = run([PYTHON, target], env=env, cwd=tmp_path)
    assert plain.returncode == 0, plain
    expected = plain_result(env)
    env = dict(env, MPISTAGE_EMULATE_NODES="2")
    args = ["-m", "mpistage", "--bundle", bundle, target]
    result, traces = traced(ranks, args, env, cwd=tmp_path)
    assert result.returncode == 0, result
    emitted = results(env, ranks)
    return expected, emitted, traces


def test_pkg_resources_finds_bundled_distributions(tmp_path, tiny_env, tiny):
    body = (
        "import os, pkg_resources\n"
        "d = pkg_resources.get_distribution('tinypkg')\n"
        "emit([d.version, d.project_name, os.getpid()])\n"
    )
    expected, emitted, traces = run_both(tmp_path, tiny_env, body, tiny["bundle"])
    assert expected[:2] == ["1.0", "tinypkg"]
    assert [e[:2] for e in emitted] == [expected[:2]] * 4
    only_rank0_touches(traces, [tiny["site"]], [e[2] for e in emitted])


def test_iter_modules_lists_bundled_roots(tmp_path, tiny_env, tiny):
    body = (
        "import os, pkgutil\n"
        "names = sorted(m.name for m in pkgutil.iter_modules())\n"
        "emit([names, os.getpid()])\n"
    )
    # A plain run wrote bytecode beside the original after packing: the
    # ranks list the root without a look into the original's __pycache__.
    py_compile.compile(str(tiny["site"] / "othermod.py"), doraise=True)
    expected, emitted, traces = run_both(tmp_path, tiny_env, body, tiny["bundle"])
    assert {"tinypkg", "othermod"} <= set(expected[0])
    for names, _pid in emitted:
        assert names == expected[0]
    only_rank0_touches(traces, [tiny["site"]], [e[1] for e in emitted])


TEST_FILE = """
import helper

def test_helper():
    assert helper.twice(21) == 42
"""


def test_pytest_runs_under_auto(tmp_path, stage_env):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_x.py").write_text(TEST_FILE)
    (suite / "helper.py").write_text("def twice(x):\n    return 2 * x\n")
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    options = ["--auto", "--cache-dir", tmp_path / "cache", "--report"]
    pytest_args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "test_x.py"]
    for expected in ("recorded", "replayed"):
        args = ["-m", "mpistage", *options, *pytest_args]
        result = mpirun(2, args, env, cwd=suite, timeout=120)
        assert result.returncode == 0, result
        assert result.stdout.count("1 passed") == 2, result
        assert "import file mismatch" not in result.stdout
        assert f"--auto: {expected}" in result.stderr, result


def test_coverage_sees_the_original_files(tmp_path, stage_env):
    pytest.importorskip("coverage")
    app = tmp_path / "app"
    app.mkdir()
    (app / "helper.py").write_text("def f():\n    return 1\n")
    (app / "main.py").write_text("import helper\nprint(helper.f())\n")
    data = tmp_path / "cov.data"
    env = dict(stage_env, COVERAGE_FILE=str(data))
    options = ["--auto", "--cache-dir", tmp_path / "cache"]
    for _ in range(2):  # learn, then replay from the staged copy
        data.unlink(missing_ok=True)
        args = ["-m", "mpistage", *options, "-m", "coverage", "run", "main.py"]
        result = mpirun(1, args, env, cwd=app, timeout=120)
        assert result.returncode == 0, result
    report = run([PYTHON, "-m", "coverage", "report", "-m"], env=env, cwd=app)
    assert report.returncode == 0, report
    assert (
        "helper.py" in report.stdout
        and "No source" not in report.stdout + report.stderr
    )


EDITABLE_PYPROJECT = """
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "devpkg"
version = "0.3"
"""


@pytest.fixture(scope="module")
def editable(tmp_path_factory):
    """A venv with devpkg installed by pip as a PEP 660 editable (a finder)."""
    base = tmp_path_factory.mktemp("editable")
    project = base / "project"
    (project / "devpkg").mkdir(parents=True)  # a flat layout: pip makes a finder
    (project / "pyproject.toml").write_text(EDITABLE_PYPROJECT)
    (project / "devpkg" / "__init__.py").write_text("WHO = 'dev'\n")
    (project / "devpkg" / "part.py").write_text("PART = 2\n")
    from envtools import base_interpreter

    venv = base / "venv"
    done = run([base_interpreter(), "-m", "venv", venv], timeout=120)
    assert done.returncode == 0, done
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q"]
    done = run([*pip, "setuptools>=70"], timeout=300)  # PEP 660 without wheel
    if done.returncode:
        pytest.skip(f"cannot install setuptools>=70 here: {done.stderr[-300:]}")
    flags = ["--no-build-isolation", "--no-deps", "--no-index"]
    done = run([*pip, *flags, "-e", project], timeout=300)
    if done.returncode:
        pytest.skip(f"pip cannot make an editable install here: {done.stderr[-300:]}")
    site = next((venv / "lib").glob("python*/site-packages"))
    here = [p for p in sys.path if p.endswith("site-packages")] + [
        str(Path(bundlefile.__file__).parents[2])
    ]
    (site / "zz-mpistage-test.pth").write_text("\n".join(here) + "\n")
    finders = list(site.glob("__editable__*finder.py"))
    assert finders, "pip made no finder-based editable install"
    return {"python": venv / "bin" / "python", "src": project}


def test_editable_install_is_served(tmp_path, stage_env, editable):
    env = dict(stage_env, LD_LIBRARY_PATH=str(Path(sys.prefix) / "lib"))
    bundle = tmp_path / "dev.mpistage"
    done = run(
        [editable["python"], "-m", "mpistage", "pack", "-o", bundle, "devpkg"], env=env
    )
    assert done.returncode == 0, done
    target = write_target(
        tmp_path / "app.py",
        MARKED + "import os, devpkg, devpkg.part\n"
        "emit([devpkg.__file__, where(devpkg), where(devpkg.part), os.getpid()])\n",
    )
    env["MPISTAGE_EMULATE_NODES"] = "2"
    command = [MPIEXEC, "-n", 2, editable["python"], "-m", "mpistage"]
    result = run([*command, "--bundle", bundle, target], env=env, cwd=tmp_path)
    assert result.returncode == 0, result
    for file, read, part, _pid in results(env, 2):
        assert file == str(editable["src"] / "devpkg" / "__init__.py")  # as plain
        assert "/mpistage-" in read and read.endswith("devpkg/__init__.py"), read
        assert "/mpistage-" in part, part


RANK1_ONLY = """
from mpi4py import MPI
import common
if MPI.COMM_WORLD.rank == 1:
    import rank1only
emit(MPI.COMM_WORLD.rank)
"""


def test_auto_learns_what_every_rank_imported(tmp_path, stage_env):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "common.py").write_text("C = 1\n")
    (lib / "rank1only.py").write_text("R = 1\n")
    script = write_target(tmp_path / "app.py", RANK1_ONLY)
    env = dict(stage_env, PYTHONPATH=str(lib))
    options = ["--auto", "--cache-dir", tmp_path / "cache"]
    for expected in ("recorded", "replayed"):
        result, facts = replay(2, options, script, env, tmp_path / "r.json")
        facts = need_report(result, facts)
        assert facts["auto"].startswith(expected), facts
    assert facts["modules"]["missed"] == 0, facts
    (saved,) = (tmp_path / "cache").glob("*.mpistage")
    rels = {m["rel"] for m in read_manifest(saved)["members"]}
    assert {"common.py", "rank1only.py"} <= rels


DATA_APP = """
import os, importlib.resources, datapkg
here = os.path.dirname(datapkg.__file__)
with open(os.path.join(here, "..", "shared", "table.txt")) as f:
    table = f.read()
listing = sorted(os.listdir(here))
files = sorted(p.name for p in importlib.resources.files("datapkg").iterdir())
emit([table, listing, files])
"""


@pytest.mark.parametrize("granularity", ["package", "file"])
def test_record_keeps_data_reached_through_dotdot_and_listings(
    tmp_path, stage_env, granularity
):
    lib = tmp_path / "lib"
    (lib / "datapkg").mkdir(parents=True)
    (lib / "shared").mkdir()
    (lib / "datapkg" / "__init__.py").write_text("")
    (lib / "datapkg" / "unused.txt").write_text("never read\n")
    (lib / "shared" / "table.txt").write_text("1 2 3\n")
    install_record(lib, "datapkg", "1.0")  # installed: served with staged paths
    (tmp_path / "app").mkdir()
    script = write_target(tmp_path / "app" / "app.py", DATA_APP)
    env = dict(stage_env, PYTHONPATH=str(lib))
    bundle = tmp_path / "data.mpistage"
    args = ["record", "-o", bundle, "--granularity", granularity, "--", PYTHON, script]
    done = mpistage(args, env=env, cwd=tmp_path)
    assert done.returncode == 0, done
    expected = plain_result(env)  # the recorded run was a plain one
    rels = {m["rel"] for m in read_manifest(bundle)["members"]}
    assert "shared/table.txt" in rels, rels  # reached as datapkg/../shared
    result, facts = replay(
        2, ["--bundle", bundle, "--report"], script, env, tmp_path / "r.json"
    )
    assert result.returncode == 0, result
    assert results(env, 2) == [expected, expected]
    facts = need_report(result, facts)
    assert facts["original_accesses"]["data"] == 0, facts


def test_pycache_beside_the_script_does_not_make_it_stale(tmp_path, stage_env, tiny):
    app = tmp_path / "app"
    app.mkdir()
    (app / "helper.py").write_text("H = 1\n")
    script = write_target(app / "main.py", "import helper, tinypkg\nemit(helper.H)\n")
    env = dict(stage_env, PYTHONPATH=str(tiny["site"]))
    bundle = tmp_path / "b.mpistage"
    done = mpistage(["record", "-o", bundle, "--", PYTHON, script], env=env)
    assert done.returncode == 0, done
    plain = run(
        [PYTHON, "-c", "import sys; sys.path.insert(0, 'app'); import helper"],
        env=dict(env, PYTHONDONTWRITEBYTECODE=""),
        cwd=tmp_path,
    )
    assert plain.returncode == 0 and (app / "__pycache__").is_dir(), plain
    result = mpirun(2, ["-m", "mpistage", "--bundle", bundle, script], env)
    assert result.returncode == 0, result


def test_pack_of_a_module_in_a_zip_is_one_line(tmp_path, stage_env):
    archive = tmp_path / "lib.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("zipped.py", "Z = 1\n")
    env = dict(clean_environ(), PYTHONPATH=str(archive))
    result = mpistage(["pack", "-o", tmp_path / "z.mpistage", "zipped"], env=env)
    assert result.returncode == 1, result
    assert result.stderr.count("\n") == 1 and "zip" in result.stderr, result
    assert "Traceback" not in result.stderr


READER_APP = """
import os, tinypkg
from mpi4py import MPI
if MPI.COMM_WORLD.rank == 1:
    import othermod
with open(os.path.join(os.environ["SITE"], "notes.txt")) as f:
    f.read()
os.listdir(os.path.dirname(tinypkg.__file__))
emit(MPI.COMM_WORLD.rank)
"""


@pytest.mark.parametrize("mode", ["bundle", "live"])
def test_report_counts_and_names_reads_of_the_originals(tmp_path, tiny_env, tiny, mode):
    (tiny["site"] / "notes.txt").write_text("data beside the packages\n")
    try:
        script = write_target(tmp_path / "app.py", READER_APP)
        env = dict(tiny_env, SITE=str(tiny["site"]))
        options = ["--bundle", tiny["bundle"]] if mode == "bundle" else []
        result, facts = replay(
            2, [*options, "--report"], script, env, tmp_path / "r.json"
        )
        facts = need_report(result, facts)
    finally:
        (tiny["site"] / "notes.txt").unlink()
    accesses = facts["original_accesses"]
    assert accesses["data"] == 2, facts  # one per rank
    notes = str(tiny["site"] / "notes.txt")
    assert accesses["beside"]["data"] == [[notes, 2]], accesses
    assert f"read beside the modules, in {tiny['site']}: notes.txt (2)" in (
        result.stderr
    )
    if mode == "live":  # tinypkg shows its original: its directory is listed there
        pkg = str(tiny["site"] / "tinypkg")
        assert [pkg, 2] in accesses["beside"]["listings"], accesses
        return
    assert accesses["modules"] >= 1, facts  # othermod on rank 1
    assert facts["modules"]["missed_on_ranks"] == [1], facts
    hints = [line for line in result.stderr.splitlines() if "hint:" in line]
    assert hints and "ranks other than 0" in hints[0] and "--auto" in hints[0]


CHILDREN_APP = """
import multiprocessing as mp, subprocess, sys

def where_child(_):
    import tinypkg
    return where(tinypkg)

if __name__ == "__main__":
    child = subprocess.run(
        [sys.executable, "-c", "import tinypkg; print(tinypkg.__file__)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    with mp.get_context("spawn").Pool(1) as pool:
        spawned = pool.map(where_child, [0])[0]
    emit([child, spawned])
"""


def test_child_processes_use_the_nodes_copy(tmp_path, tiny_env, tiny, stage_dir):
    script = write_target(tmp_path / "kids.py", CHILDREN_APP)
    env = dict(tiny_env, MPISTAGE_EMULATE_NODES="2")
    args = ["-m", "mpistage", "--bundle", tiny["bundle"], script]
    result = mpirun(2, args, env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result
    for child, spawned in results(env, 2):
        for path in (child, spawned):
            assert path.startswith(str(stage_dir)) and path.endswith(
                "tinypkg/__init__.py"
            )
    plain = run(
        [PYTHON, "-c", "import os; print(os.environ.get('PYTHONPATH'))"], env=env
    )
    assert plain.stdout.strip() == str(tiny["site"])  # the user's own, unchanged
