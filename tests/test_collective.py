"""How ranks agree, directly: one failure anywhere is the same error everywhere.

The agreement runs under real ``mpiexec`` at 1, 2 and 5 ranks, with the
failure on each rank in turn and on several at once; the messages of
``describe`` are checked in-process.
"""

import json

import pytest

from mpistage import StageError
from mpistage.runtime.collective import describe
from stagetools import mpirun, results, write_target

AGREE = """
import sys
from mpi4py import MPI
from mpistage import StageError, load_runtime
comm = MPI.COMM_WORLD
load_runtime(comm)
from mpistage.runtime.broadcast import share
from mpistage.runtime.collective import attempt, first_failure

failing = json.loads(sys.argv[1])

def step(value):
    if comm.rank in failing:
        raise OSError(2, "No such file or directory", f"/missing/{comm.rank}")
    return value * 2

out = {"first": first_failure(comm, comm.rank in failing)}
try:
    out["result"] = attempt(comm, step, 21)
except StageError as exc:
    out["error"] = str(exc)
try:
    attempt(comm, lambda: [][comm.rank] if comm.rank == comm.size - 1 else None)
except StageError as exc:
    out["internal"] = str(exc)
out["shared"] = share(comm, {"from": comm.rank} if comm.rank == 0 else None)
emit(out)
"""


CASES = [(1, []), (1, [0]), (2, []), (2, [1]), (2, [0, 1]), (5, [3]), (5, [4, 2])]


@pytest.mark.parametrize("ranks, failing", CASES)
def test_every_rank_takes_the_same_branch(tmp_path, stage_env, ranks, failing):
    target = write_target(tmp_path / "agree.py", "import json\n" + AGREE)
    result = mpirun(ranks, [target, json.dumps(failing)], stage_env)
    assert result.returncode == 0, result
    found = results(stage_env, ranks)
    first = min(failing) if failing else None
    for out in found:
        assert out["first"] == first
        if failing:
            assert out["error"] == f"No such file or directory '/missing/{first}'"
            assert "result" not in out
        else:
            assert out["result"] == 42 and "error" not in out
        assert out["internal"] == (
            "internal error: IndexError: list index out of range"
        )
        assert out["shared"] == {"from": 0}


@pytest.mark.parametrize(
    "error, message",
    [
        (StageError("as it is"), "as it is"),
        (MemoryError(), "out of memory"),
        (MemoryError("cannot allocate 5 GiB"), "out of memory: cannot allocate 5 GiB"),
        (PermissionError(13, "Permission denied", "/x"), "Permission denied '/x'"),
        (OSError(28, "No space left on device"), "No space left on device"),
        (KeyError("k"), "internal error: KeyError: 'k'"),
    ],
)
def test_describe_is_one_line(error, message):
    assert describe(error) == message
