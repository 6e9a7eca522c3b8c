"""Live imports of big files: the reader never holds one, and none arrives torn.

A file of 1 MiB or more that the reader serves travels in pieces: rank 0
copies it into its node's copy piece by piece and sends each piece down the
tree as it goes (from the buffer it read, or later from its copy), so no
rank holds the file. Each file ends with one byte that says whether its
bytes are the original's: when the original cannot be read whole (it
shrank while the job ran), every node drops it and its ranks read the
original, as plain python would. Every case runs 4 ranks on 2 emulated
nodes (one case on 4 too), with 1 MiB pieces.
"""

import hashlib
import json
import os

import pytest

from stagetools import job_dirs, mpirun, results, write_target

pytestmark = pytest.mark.usefixtures("reap_mpich_shm")
BIG = 160 << 20  # bytes of bigpkg/big.bin
SHRUNK = 3 << 20  # what is left of it when it shrinks while read

# 1 MiB pieces; the app runs through mpistage as given.
PIECES = """
import sys
import mpistage.runtime.bulk as bulk
bulk.PIECE_SIZE = 1 << 20
from mpistage.__main__ import main
main(sys.argv[2:])
"""

# The original shrinks to SHRUNK bytes while rank 0 reads its third piece.
SHRINKS = """
import os, sys
import mpistage.runtime.bulk as bulk
import mpistage.runtime.live.pieces as pieces
bulk.PIECE_SIZE = 1 << 20
real, left = pieces.fill, int(sys.argv[1])
def fill(fd, view, offset):
    path = os.readlink(f"/proc/self/fd/{fd}")
    if path.endswith("/big.bin") and offset == 2 << 20:
        os.truncate(path, left)
    return real(fd, view, offset)
pieces.fill = fill
from mpistage.__main__ import main
main(sys.argv[2:])
"""

# Each rank reads the package's big.bin through importlib.resources, and
# says how much its peak resident memory grew meanwhile (the reader's copy
# and sends run in rank 0's process).
READ_BIG = """
import hashlib
import importlib.resources as resources
def peak():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith("VmHWM:"))
before = peak()
with (resources.files("bigpkg") / "big.bin").open("rb") as f:
    digest = hashlib.file_digest(f, "sha256").hexdigest()
    name = f.name
emit([digest, name, peak() - before])
"""


@pytest.fixture
def site(tmp_path):
    """A package with one big file of random bytes; return (site, its digest)."""
    folder = tmp_path / "site" / "bigpkg"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    blob = os.urandom(BIG)
    (folder / "big.bin").write_bytes(blob)
    return folder.parent, blob


def launch(tmp_path, stage_env, site, driver, arg, nodes=2):
    """Run READ_BIG live on 4 ranks, *nodes* emulated nodes, through *driver*."""
    report = tmp_path / "report.json"
    env = dict(
        stage_env,
        PYTHONPATH=str(site),
        MPISTAGE_EMULATE_NODES=str(nodes),
        MPISTAGE_REPORT=str(report),
    )
    target = write_target(tmp_path / "app.py", READ_BIG)
    args = ["-c", driver, str(arg), target]
    result = mpirun(4, args, env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result
    return results(env, 4), json.loads(report.read_text())


@pytest.mark.parametrize("nodes", [2, 4])
def test_the_reader_never_holds_a_big_file_it_serves(
    tmp_path, stage_env, stage_dir, site, nodes
):
    """Rank 0 reads the 160 MiB file for every node, and no rank's peak
    resident memory grows by 48 MiB meanwhile; every rank reads the file
    from its node's copy. On 4 nodes one leader passes the pieces on to
    another (the tree of leaders)."""
    folder, blob = site
    original = str(folder / "bigpkg" / "big.bin")
    got, report = launch(tmp_path, stage_env, folder, PIECES, 0, nodes)
    digest = hashlib.sha256(blob).hexdigest()
    for rank_digest, name, grew in got:
        assert rank_digest == digest
        assert name != original and name.endswith(original), name  # the copy
        assert grew < 48 << 20, grew
    assert report["live"]["late"] == 0, report["live"]
    assert job_dirs(stage_dir) == []


def test_a_big_file_that_shrinks_while_read_is_read_from_the_original(
    tmp_path, stage_env, stage_dir, site
):
    """No node keeps the torn copy: every rank reads the original, as it is now."""
    folder, blob = site
    original = str(folder / "bigpkg" / "big.bin")
    got, report = launch(tmp_path, stage_env, folder, SHRINKS, SHRUNK)
    digest = hashlib.sha256(blob[:SHRUNK]).hexdigest()
    assert [got_rank[:2] for got_rank in got] == [[digest, original]] * 4
    assert report["live"]["late"] == 0, report["live"]
    assert job_dirs(stage_dir) == []
