"""Live imports never wait without bound on another rank's thread.

The reader and the relays are threads: they run only when their rank's main
thread lets go of the GIL, and a program (or a C extension) may block in
MPI holding it, until the very ranks that wait for those threads reach the
same call. A request unanswered within ``MPISTAGE_LIVE_WAIT`` seconds is
imported from the originals instead: the job is slower, never stuck, and
the report says which ranks and what. Every case runs on 2 emulated nodes;
a hang is a timeout here.
"""

import json

import pytest

from stagetools import job_dirs, mpirun, results, write_target

pytestmark = pytest.mark.usefixtures("reap_mpich_shm")
WAIT = "2"  # seconds: MPISTAGE_LIVE_WAIT, short to keep the tests short

# ctypes.PyDLL keeps the GIL held during the call: rank 0's reader thread
# cannot run until every rank has reached the barrier.
HOLDS_THE_GIL = """
import ctypes
from mpi4py import MPI

def barrier_holding_the_gil(comm):
    with open("/proc/self/maps") as maps:
        lib = next(l.split()[-1] for l in maps if "/libmpi" in l and ".so" in l)
    mpi = ctypes.PyDLL(lib)
    kind = ctypes.c_int if MPI._sizeof(MPI.Comm) == 4 else ctypes.c_void_p
    mpi.MPI_Barrier.argtypes = [kind]
    return mpi.MPI_Barrier(MPI._handleof(comm))
"""

GIL_HELD = (
    HOLDS_THE_GIL
    + """
world = MPI.COMM_WORLD
if world.rank == 0:
    barrier_holding_the_gil(world)
    import boundpkg.sub
else:
    import json, decimal, boundpkg.sub
    world.Barrier()
emit(boundpkg.sub.VALUE)
"""
)

DUP_REDUCE = """
from mpi4py import MPI
world = MPI.COMM_WORLD
if world.rank == 0:
    sub = world.Dup()
    sub.allreduce(1)
else:
    import json, decimal, boundpkg.sub
    sub = world.Dup()
    sub.allreduce(1)
import boundpkg.sub
emit(boundpkg.sub.VALUE)
"""

# The program ends on rank 0 at once: it waits in the job's closing steps
# while the other ranks still import.
CLOSING = """
import time
from mpi4py import MPI
if MPI.COMM_WORLD.rank:
    time.sleep(0.5)
    import json, decimal, boundpkg.sub
else:
    import boundpkg.sub
emit(boundpkg.sub.VALUE)
"""


# Rank 0 imports a module whose file takes its reader a second to read; the
# others ask for it meanwhile; then rank 0 blocks in MPI holding the GIL, so
# no thread of rank 0 runs until every rank has reached the barrier.
ASKED_WHILE_READ = (
    HOLDS_THE_GIL
    + """
import time
world = MPI.COMM_WORLD
if world.rank == 0:
    import boundpkg.sub
    barrier_holding_the_gil(world)
else:
    time.sleep(0.3)
    import boundpkg.sub
    world.Barrier()
emit(boundpkg.sub.VALUE)
"""
)
SLOW_READER = """
import sys, time
import mpistage.runtime.live.reader as reader
real = reader.Reader.read
def slowly(self, folder, name):
    if name.startswith("sub."):
        time.sleep(1.0)  # a file on a slow shared file system
    return real(self, folder, name)
reader.Reader.read = slowly
from mpistage.__main__ import main
main(sys.argv[1:])
"""

# Small pieces, each written slowly on the leaders that receive them: the
# answer takes several times MPISTAGE_LIVE_WAIT to arrive, and keeps moving.
SLOW_PIECES = """
import sys, time
import mpistage.runtime.bulk as bulk
import mpistage.runtime.live.mirror as mirror
bulk.PIECE_SIZE = 64 << 10
real = mirror.CopyWriter.write_piece
def slowly(self, handle, view):
    time.sleep(0.02)
    return real(self, handle, view)
mirror.CopyWriter.write_piece = slowly
from mpistage.__main__ import main
main(sys.argv[1:])
"""
BIG_IMPORT = "import boundpkg.big\nemit(len(boundpkg.big.PAD))\n"
PAD = 6 << 20  # bytes of boundpkg/big.py: raw pieces, not a pickled file


@pytest.fixture
def env(stage_env, tmp_path):
    site = tmp_path / "site"
    (site / "boundpkg").mkdir(parents=True)
    (site / "boundpkg" / "__init__.py").write_text("")
    (site / "boundpkg" / "sub.py").write_text("import email.message\nVALUE = 42\n")
    (site / "boundpkg" / "big.py").write_text(f"PAD = {'x' * PAD!r}\n")
    report = tmp_path / "report.json"
    return dict(
        stage_env,
        PYTHONPATH=str(site),
        MPISTAGE_LIVE_WAIT=WAIT,
        MPISTAGE_EMULATE_NODES="2",
        MPISTAGE_REPORT=str(report),
    )


def launch(tmp_path, env, ranks, body):
    target = write_target(tmp_path / "app.py", body)
    result = mpirun(ranks, ["-m", "mpistage", target], env, cwd=tmp_path, timeout=90)
    assert result.returncode == 0, result
    report = json.loads((tmp_path / "report.json").read_text())
    return result, report


@pytest.mark.parametrize("ranks", [2, 4])
def test_rank_0_blocked_in_mpi_holding_the_gil_only_slows_the_others(
    tmp_path, env, stage_dir, ranks
):
    result, report = launch(tmp_path, env, ranks, GIL_HELD)
    assert result.returncode == 0, result
    assert results(env, ranks) == [42] * ranks
    live = report["live"]
    assert live["late"] >= 1, live
    assert 0 not in live["late_ranks"] and live["late_ranks"], live
    assert any("boundpkg" in k or "python3" in k for k in live["late_keys"]), live
    assert job_dirs(stage_dir) == []


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_first_lowercase_reduction_on_a_new_communicator(
    tmp_path, env, stage_dir, ranks
):
    result, report = launch(tmp_path, env, ranks, DUP_REDUCE)
    assert result.returncode == 0, result
    assert results(env, ranks) == [42] * ranks
    assert report["live"]["mode"] == "live"
    assert job_dirs(stage_dir) == []


@pytest.mark.parametrize("ranks", [2, 4])
def test_an_answer_needs_no_thread_of_a_rank_blocked_since(
    tmp_path, env, stage_dir, ranks
):
    """Every rank asked for ``boundpkg.sub`` while rank 0 read it, and rank 0
    blocks in MPI holding the GIL as soon as it has it: the push that brings
    it names what it answers, and has left before rank 0 blocks, so every
    node knows the answer without any thread of rank 0 (its own node's
    other ranks from the node's log). None is late."""
    target = write_target(tmp_path / "app.py", ASKED_WHILE_READ)
    args = ["-c", SLOW_READER, target]
    result = mpirun(ranks, args, env, cwd=tmp_path, timeout=90)
    assert result.returncode == 0, result
    report = json.loads((tmp_path / "report.json").read_text())
    assert results(env, ranks) == [42] * ranks
    assert report["live"]["late"] == 0, report["live"]
    assert job_dirs(stage_dir) == []


def test_an_answer_that_keeps_arriving_is_waited_for(tmp_path, env, stage_dir):
    """96 pieces of 64 KiB, 20 ms each on every leader that takes them: about
    2 s, with MPISTAGE_LIVE_WAIT=1 s. The bound is on progress: none is late."""
    env = dict(env, MPISTAGE_LIVE_WAIT="1")
    target = write_target(tmp_path / "app.py", BIG_IMPORT)
    args = ["-c", SLOW_PIECES, target]
    result = mpirun(4, args, env, cwd=tmp_path, timeout=90)
    assert result.returncode == 0, result
    report = json.loads((tmp_path / "report.json").read_text())
    assert results(env, 4) == [PAD] * 4
    assert report["live"]["late"] == 0, report["live"]
    assert report["seconds"]["run"] > 1.5, report["seconds"]  # it did take long
    assert job_dirs(stage_dir) == []


def test_the_closing_steps_reached_while_a_rank_still_imports(tmp_path, env, stage_dir):
    result, report = launch(tmp_path, env, 4, CLOSING)
    assert result.returncode == 0, result
    assert results(env, 4) == [42] * 4
    assert report["live"]["late"] == 0, report["live"]  # answered, not waited out
    assert job_dirs(stage_dir) == []


def test_a_bad_wait_is_one_line(tmp_path, env):
    env = dict(env, MPISTAGE_LIVE_WAIT="soon")
    target = write_target(tmp_path / "app.py", "emit(1)\n")
    result = mpirun(2, ["-m", "mpistage", target], env, cwd=tmp_path, timeout=60)
    assert result.returncode == 1, result
    lines = [ln for ln in result.stderr.splitlines() if "mpistage: error" in ln]
    assert lines == [
        "mpistage: error: MPISTAGE_LIVE_WAIT='soon' must be a number of seconds "
        "from 0 to 86400"
    ], result.stderr
