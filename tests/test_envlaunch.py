"""``mpistage-env BUNDLE -- COMMAND``: one launch, the environment per node.

The small venv (``envtools``) is packed once; every test launches
``bin/mpistage-env`` under the MPICH wheel's Hydra ``mpiexec`` on two
emulated nodes, with its staging places in the test's own directories,
and checks what a user would notice: each rank runs its node's staged
interpreter with its arguments and environment, a failure is one line
naming the node and never a hang, and nothing is left behind.
"""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from envtools import QUOTED, open_counts, small_venv, trace_paths, under
from stagetools import MPIEXEC, clean_environ, run

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reap_mpich_shm")]

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bin" / "mpistage-env"
APP = """\
import json, os, sys
from mpi4py import MPI
world = MPI.COMM_WORLD
info = {"rank": world.rank, "sum": world.allreduce(1), "exe": sys.executable,
        "argv": sys.argv[1:], "color": os.environ.get("COLOR")}
os.write(1, ("RESULT " + json.dumps(info) + chr(10)).encode())
code = int(os.environ.get("FAIL_RANK_CODE", "0"))
if code and world.rank == 1:
    sys.exit(code)
if os.environ.get("SLEEP"):
    import time; time.sleep(float(os.environ["SLEEP"]))
"""


@pytest.fixture
def place(tmp_path):
    """A private staging place for the test: MPISTAGE_STAGE_DIR, no fallback."""
    folder = tmp_path / "shm"
    folder.mkdir(mode=0o700)
    return folder


def environ(place, nodes=2, **extra):
    env = clean_environ()
    for name in ("SLURM_JOB_ID", "FLUX_JOB_ID", "PBS_JOBID", "LSB_JOBID"):
        env.pop(name, None)
    env.update(MPISTAGE_STAGE_DIR=str(place), MPISTAGE_STAGE_FALLBACK="no")
    env["MPISTAGE_EMULATE_NODES"] = str(nodes)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def launch(bundle, tmp_path, env, n=4, args=(), timeout=120):
    app = tmp_path / "app.py"
    app.write_text(APP)
    command = [MPIEXEC, "-n", str(n), SCRIPT, bundle, "--", "python", app, *args]
    return run(command, env, cwd=tmp_path, timeout=timeout)


def results(result):
    found = [
        json.loads(line.partition(" ")[2])
        for line in result.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    return {r["rank"]: r for r in found}


def settled(place, timeout=15):
    """What is left in *place* once the watchdogs had their time."""
    deadline = time.time() + timeout
    while time.time() < deadline and any(place.iterdir()):
        time.sleep(0.2)
    return sorted(p.name for p in place.iterdir())


def test_each_rank_runs_its_node_copy_and_nothing_is_left(env_bundle, tmp_path, place):
    env = environ(place, COLOR="blue")
    result = launch(env_bundle, tmp_path, env, args=["a b", "--x"])
    assert result.returncode == 0, result
    ranks = results(result)
    assert sorted(ranks) == [0, 1, 2, 3], result
    exes = {r: Path(info["exe"]) for r, info in ranks.items()}
    assert all(info["sum"] == 4 for info in ranks.values())
    assert all(info["argv"] == ["a b", "--x"] for info in ranks.values())
    assert all(info["color"] == "blue" for info in ranks.values())
    assert exes[0].parent == exes[1].parent != exes[2].parent == exes[3].parent
    assert all(place in exe.parents for exe in exes.values())
    assert exes[0].parent.parent.name.endswith(".n0")
    assert exes[2].parent.parent.name.endswith(".n1")
    assert settled(place) == []


def test_a_failing_rank_leaves_nothing(env_bundle, tmp_path, place):
    result = launch(env_bundle, tmp_path, environ(place, FAIL_RANK_CODE=3))
    assert result.returncode != 0, result
    assert settled(place) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_leaves_nothing(env_bundle, tmp_path, place, sig):
    app = tmp_path / "app.py"
    app.write_text(APP)
    command = [MPIEXEC, "-n", "4", SCRIPT, env_bundle, "--", "python", app]
    env = environ(place, SLEEP=60)
    proc = subprocess.Popen(
        [str(c) for c in command],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 90
    while time.time() < deadline:
        names = [p.name for p in place.iterdir()]
        done = [n for n in names if n.endswith((".n0", ".n1"))]
        markers = [place / n / ".mpistage-stage" for n in done]
        if len(done) == 2 and all(
            m.exists() and "state=complete" in m.read_text() for m in markers
        ):
            break
        time.sleep(0.2)
    time.sleep(1)
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert settled(place) == []


def test_a_killed_launch_is_reaped_by_the_next(env_bundle, tmp_path, place):
    app = tmp_path / "app.py"
    app.write_text(APP)
    command = [MPIEXEC, "-n", "2", SCRIPT, env_bundle, "--", "python", app]
    proc = subprocess.Popen(
        [str(c) for c in command],
        env=environ(place, nodes=1, SLEEP=60),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 90
    while time.time() < deadline and not list(place.glob("*/.mpistage-stage")):
        time.sleep(0.2)
    time.sleep(2)
    left = sorted(p.name for p in place.iterdir())
    watchdogs = watchdogs_of(place)
    # Everything dies at once, watchdogs included (a node's crash, a launcher
    # that kills the whole step).
    for pid in watchdogs:
        os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    time.sleep(1)
    assert sorted(p.name for p in place.iterdir()) == left and left
    result = launch(env_bundle, tmp_path, environ(place, nodes=1), n=2)
    assert result.returncode == 0, result
    assert settled(place) == []


def watchdogs_of(place):
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"mpistage-env-watchdog" in cmdline and any(
            str(place).encode() in part for part in cmdline
        ):
            found.append(int(entry.name))
    return found


def test_two_bundles_at_once_get_their_own_copies(env_bundle, tmp_path, place):
    other = tmp_path / "other.mpistage"
    os.link(env_bundle, other) if same_fs(env_bundle, tmp_path) else None
    if not other.exists():
        other.write_bytes(env_bundle.read_bytes())
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    env = environ(place, SLEEP=2)
    app = tmp_path / "app.py"
    app.write_text(APP)
    procs = [
        subprocess.Popen(
            [MPIEXEC, "-n", "4", str(SCRIPT), str(b), "--", "python", str(app)],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for b, cwd in ((env_bundle, first), (other, second))
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    dirs = [
        {Path(json.loads(line[7:])["exe"]).parent.parent for line in o.splitlines()}
        for o, _ in outs
    ]
    assert all(len(d) == 2 for d in dirs) and not dirs[0] & dirs[1], dirs
    assert settled(place) == []


def same_fs(a, b):
    return os.stat(a).st_dev == os.stat(b).st_dev


def test_no_node_python_is_one_line_per_rank(env_bundle, tmp_path, place):
    env = environ(place, MPISTAGE_NODE_PYTHON=tmp_path / "no-python")
    result = launch(env_bundle, tmp_path, env, timeout=60)
    assert result.returncode != 0, result
    lines = [ln for ln in result.stderr.splitlines() if "mpistage-env: error" in ln]
    assert lines, result
    assert all("emulated node" in ln and "no-python" in ln for ln in lines), lines
    assert results(result) == {}


@pytest.mark.parametrize("kind", ["directory", "symlink"])
def test_a_planted_name_makes_the_node_use_the_next_place(
    env_bundle, tmp_path, place, kind
):
    """Another user plants the claim of node 0 (a job's names are predictable):
    a directory of theirs, or their symlink to a directory of ours."""
    spare = tmp_path / "spare"
    spare.mkdir(mode=0o700)
    shared = tmp_path / "sticky"
    shared.mkdir()
    shared.chmod(0o1777)
    env = environ(place, FLUX_JOB_ID="f42")
    env["MPISTAGE_STAGE_DIR"] = f"{shared}:{spare}"
    key = subprocess.run(
        ["cksum"],
        input=f"{env_bundle}\n",
        capture_output=True,
        text=True,
    ).stdout.split()[0]
    planted = shared / f"mpistage-env-{os.getuid()}-f42-{key}.n0.in"
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    if kind == "symlink":
        planted.symlink_to(ours)
    else:
        planted.mkdir()
    os.lchown(planted, 65534, 65534)
    try:
        result = launch(env_bundle, tmp_path, env)
        assert result.returncode == 0, result
        exes = {r: Path(i["exe"]) for r, i in results(result).items()}
        assert spare in exes[0].parents and shared in exes[2].parents, exes
        assert planted.lstat().st_uid == 65534 and list(ours.iterdir()) == []
        # Alone, the planted place is refused with one line naming the node
        # (one node: a node that fails while others start leaves those
        # waiting in MPI_Init until the launcher ends them, docs/stage.md).
        env["MPISTAGE_STAGE_DIR"] = str(shared)
        env["MPISTAGE_EMULATE_NODES"] = "1"
        refused = launch(env_bundle, tmp_path, env, timeout=60)
        assert refused.returncode != 0, refused
        lines = [ln for ln in refused.stderr.splitlines() if "error" in ln]
        assert lines and all("emulated node 0" in ln for ln in lines), lines
        assert "not yours" in lines[0]
    finally:
        planted.unlink() if planted.is_symlink() else planted.rmdir()
        for folder in (shared, spare, ours):
            for path in folder.iterdir():
                subprocess.run(["rm", "-rf", str(path)], check=True)


def test_later_launches_of_a_job_reuse_the_copy(env_bundle, tmp_path, place):
    env = environ(place, FLUX_JOB_ID="f43")
    first = launch(env_bundle, tmp_path, env)
    assert first.returncode == 0, first
    names = sorted(p.name for p in place.iterdir())
    assert len(names) == 4, names  # two copies, two claims: the job's
    inodes = {n: (place / n).stat().st_ino for n in names}
    pids = {n: (place / n / "pid").read_text() for n in names if n.endswith(".in")}
    second = launch(env_bundle, tmp_path, env)
    assert second.returncode == 0, second
    assert {n: (place / n).stat().st_ino for n in names} == inodes
    assert {n: (place / n / "pid").read_text() for n in pids} == pids
    for path in place.iterdir():
        subprocess.run(["rm", "-rf", str(path)], check=True)


def test_usage_and_a_bundle_that_is_not_there(tmp_path, place):
    usage = run([SCRIPT, "env.mpistage", "python"], environ(place))
    assert usage.returncode == 2 and "usage: mpistage-env" in usage.stderr
    missing = launch(tmp_path / "none.mpistage", tmp_path, environ(place), n=2)
    assert missing.returncode != 0
    lines = [ln for ln in missing.stderr.splitlines() if "mpistage-env: error" in ln]
    assert lines and all("none.mpistage" in ln for ln in lines), missing


def test_boot_reads_the_header_as_the_format_says():
    from mpistage.runtime.bundlefile import HEADER, MAGIC

    text = SCRIPT.read_text()
    assert f'struct.unpack_from("{HEADER.format}", buf)' in text
    assert f'magic != b"{MAGIC.decode()}"' in text


def test_a_bundle_replaced_within_the_job_gets_its_own_copy(
    env_bundle, tmp_path, place
):
    """The job's second launch finds the path's copy, but the bundle was packed
    again in between: it runs the new bundle from a copy of its own."""
    bundle = tmp_path / "env.mpistage"
    bundle.write_bytes(env_bundle.read_bytes())
    env = environ(place, FLUX_JOB_ID="f44")
    first = launch(bundle, tmp_path, env)
    assert first.returncode == 0, first
    before = {Path(r["exe"]).parent.parent for r in results(first).values()}
    replaced = tmp_path / "env.mpistage.new"
    replaced.write_bytes(env_bundle.read_bytes())
    replaced.rename(bundle)  # as pack writes it: a new file in its place
    second = launch(bundle, tmp_path, env)
    assert second.returncode == 0, second
    after = {Path(r["exe"]).parent.parent for r in results(second).values()}
    assert len(after) == 2 and not after & before, (before, after)
    again = launch(bundle, tmp_path, env)  # the new copy serves the next launch
    assert {Path(r["exe"]).parent.parent for r in results(again).values()} == after
    for path in place.iterdir():
        subprocess.run(["rm", "-rf", str(path)], check=True)


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_strace_the_shared_files_are_the_script_and_the_bundle_once_per_node(
    env_bundle, tmp_path, place, tmp_path_factory
):
    """Under ``strace -f``, the whole launch (launcher, every rank, each
    node's extraction, the staged interpreters) opens nothing of the shared
    venv, and of the shared place only the script (once per rank for the
    exec, once for ``sh``) and the bundle, once per node."""
    venv = small_venv(tmp_path_factory).prefix  # what env_bundle was packed from
    shared = tmp_path / "shared"
    (shared / "bin").mkdir(parents=True)
    script = shared / "bin" / "mpistage-env"
    shutil.copy2(SCRIPT, script)
    bundle = shared / "env.mpistage"
    os.link(env_bundle, bundle) if same_fs(env_bundle, shared) else shutil.copy(
        env_bundle, bundle
    )
    app = tmp_path / "app.py"
    app.write_text(APP)
    log = tmp_path / "strace.log"
    tracer = ["strace", "-f", "-qq", "-e", "trace=%file", "-s", "4096", "-o", log]
    command = [*tracer, MPIEXEC, "-n", "4", script, bundle, "--", "python", app]
    result = run(command, environ(place), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result
    assert sorted(results(result)) == [0, 1, 2, 3], result
    text = log.read_text()
    touched = {p for p in trace_paths(text) if under(p, venv) or under(p, shared)}
    assert touched == {str(script), str(bundle)}, sorted(touched)
    counts = open_counts(text)
    assert counts[str(bundle)] == 2, counts[str(bundle)]  # two emulated nodes
    assert calls_on(text, bundle) == 2  # no rank stats it either
    assert counts[str(script)] == 4, counts[str(script)]  # sh's read, per rank
    assert not any(under(p, venv) for p in counts), sorted(counts)
    assert settled(place) == []


def calls_on(text, path):
    """Count the system calls in an ``strace -f`` output whose path is *path*
    (``execve`` lines are left out: their arguments name it too)."""
    count = 0
    for line in text.splitlines():
        rest = line.partition(" ")[2].strip()
        if rest.startswith(("execve", "<...")):
            continue
        match = QUOTED.search(rest)
        count += bool(match and match.group(1) == str(path))
    return count
