"""No MPI message exceeds the limit, whatever the size of what travels.

An MPI without MPI-4 large counts (Open MPI 4.1) refuses a message of more
than 2**31 - 1 bytes. Every rank here runs with a PMPI layer
(``tests/data/msglimit.c``, loaded with ``LD_PRELOAD``) that aborts the job
on any send, receive, broadcast, gather or MPI-IO read over a small limit,
and mpistage's pieces (``bulk.PIECE_SIZE``, ``read.READ_SIZE``) are set to
that limit, so a bundle, a live push and a data file many times its size
must cross in pieces, byte for byte.
"""

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from stagetools import PYTHON, mpirun, pack, results, write_target

pytestmark = pytest.mark.usefixtures("reap_mpich_shm")
LIMIT = 1 << 20  # bytes in one message at most: pieces of exactly that
LAYOUTS = [(4, 2), (3, 3)]  # (ranks, emulated nodes): a tree of 3 leaders too
DRIVER = (
    "import sys, mpistage.runtime.bulk as b, mpistage.runtime.read as r; "
    f"b.PIECE_SIZE = r.READ_SIZE = {LIMIT}; "
    "from mpistage.__main__ import main; main(sys.argv[1:])"
)


@pytest.fixture(scope="module")
def msglimit(tmp_path_factory):
    """The PMPI layer, built with the venv's MPI compiler wrapper."""
    mpicc = Path(PYTHON).parent / "mpicc"
    if not mpicc.exists():
        pytest.skip("no mpicc next to this Python (the MPICH wheel has one)")
    source = Path(__file__).parent / "data" / "msglimit.c"
    lib = tmp_path_factory.mktemp("msglimit") / "msglimit.so"
    args = [mpicc, "-shared", "-fPIC", "-O1", "-o", lib, source]
    subprocess.run(args, check=True, timeout=120)
    return lib


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A site whose module and data file are several times :data:`LIMIT`."""
    base = tmp_path_factory.mktemp("big")
    site = base / "site"
    (site / "bigpkg").mkdir(parents=True)
    blob = os.urandom(3 * LIMIT + 12345)
    (site / "bigpkg" / "blob.bin").write_bytes(blob)
    (site / "bigpkg" / "__init__.py").write_text(f"BLOB = {blob!r}\n")
    return {"site": site, "blob": site / "bigpkg" / "blob.bin", "sha": sha(blob)}


def sha(data):
    return hashlib.sha256(data).hexdigest()


APP = """
import hashlib, sys
from mpistage import data
import bigpkg
from mpi4py import MPI
blob = sys.argv[1]
got = {"module": hashlib.sha256(bigpkg.BLOB).hexdigest()}
with open(bigpkg.__file__.replace("__init__.py", "blob.bin"), "rb") as f:
    got["file"] = hashlib.sha256(f.read()).hexdigest()
for readers in (1, 2):
    for io in ("posix", "mpiio"):
        buf = data.read(blob, comm=MPI.COMM_WORLD, readers=readers, io=io)
        got[f"data {readers} {io}"] = hashlib.sha256(buf.view).hexdigest()
        buf.close()
emit(got)
"""


@pytest.mark.parametrize("ranks,nodes", LAYOUTS)
@pytest.mark.parametrize("mode", ["bundle", "live"])
def test_no_message_over_the_limit(
    tmp_path, stage_env, msglimit, big, mode, ranks, nodes
):
    options = []
    if mode == "bundle":
        env = dict(stage_env, PYTHONPATH=str(big["site"]))
        options = ["--bundle", pack(tmp_path / "big.mpistage", "bigpkg", env=env)]
    log = tmp_path / "limit.log"
    env = dict(
        stage_env,
        PYTHONPATH=str(big["site"]),
        MPISTAGE_EMULATE_NODES=str(nodes),
        MPISTAGE_TEST_MAX_BYTES=str(LIMIT),
        MPISTAGE_TEST_LIMIT_LOG=str(log),
        LD_PRELOAD=str(msglimit),
    )
    target = write_target(tmp_path / "app.py", APP)
    args = ["-c", DRIVER, *options, target, big["blob"]]
    result = mpirun(ranks, args, env, cwd=tmp_path, timeout=120)
    assert "msglimit:" not in result.stderr, result
    assert result.returncode == 0, result
    expected = {"module": big["sha"], "file": big["sha"]}
    expected.update(
        {f"data {n} {io}": big["sha"] for n in (1, 2) for io in ("posix", "mpiio")}
    )
    assert results(env, ranks) == [expected] * ranks
    # The layer was in every rank, and the pieces were as large as allowed.
    largest = [int(line.split()[1]) for line in log.read_text().splitlines()]
    assert len(largest) == ranks and max(largest) == LIMIT, largest


EDGES = """
import hashlib, sys
from mpi4py import MPI
from mpistage.runtime import bulk
bulk.PIECE_SIZE = step = int(sys.argv[1])
world = MPI.COMM_WORLD
sizes = [0, 1, step - 1, step, step + 1, 2 * step, 5 * step + 3]
got = []
for size in sizes:
    blob = bytes((i * 7 + size) % 251 for i in range(size))
    if world.rank == 0:
        for dest in range(1, world.size):
            MPI.Request.Waitall(bulk.post(world, blob, dest, 5))
        got.append(True)
    else:
        status = MPI.Status()
        message = world.Mprobe(0, 5, status)
        got.append(bulk.take(world, message, status) == blob)
    into = bytearray(blob) if world.rank == 0 else bytearray(size)
    bulk.bcast(world, into)
    got.append(into == blob)
emit(got)
"""


@pytest.mark.parametrize("step", [63, 64, 65])
def test_messages_of_edge_sizes_arrive_whole(tmp_path, stage_env, msglimit, step):
    """Empty, one byte, a piece less one, one piece, a piece more: all whole."""
    env = dict(stage_env, MPISTAGE_TEST_MAX_BYTES=str(step), LD_PRELOAD=str(msglimit))
    target = write_target(tmp_path / "edges.py", EDGES)
    result = mpirun(3, [target, step], env, cwd=tmp_path)
    assert "msglimit:" not in result.stderr, result
    assert result.returncode == 0, result
    assert results(env, 3) == [[True] * 14] * 3
