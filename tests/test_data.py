"""mpistage.data: one read per job, one copy per node, the same read-only bytes.

Every test launches a real ``mpiexec``; the targets write one JSON result per
rank (``emit``), which the tests compare with what numpy reads locally.
"""

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from stagetools import (
    MPIEXEC,
    PYTHON,
    clean_environ,
    mpirun,
    results,
    run,
    write_target,
)

pytestmark = pytest.mark.usefixtures("reap_mpich_shm")

QUICK = 20  # seconds a failing job may take, at most
LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)]  # (ranks, emulated nodes)

PRELUDE = """
import hashlib, json, os, sys, time
from mpi4py import MPI
import numpy as np
import mpistage.runtime.broadcast as broadcast
import mpistage.runtime.bulk as bulk
import mpistage.runtime.read as read
from mpistage import StageError, data
comm = MPI.COMM_WORLD
FILES = json.loads(sys.argv[1])

def sha(buf):
    return hashlib.sha256(buf).hexdigest()

def describe(array):
    try:
        array[(0,) * array.ndim] = 0
        writes = True
    except ValueError:
        writes = False
    try:
        array.flags.writeable = True
        unlocks = True
    except ValueError:
        unlocks = False
    return [sha(array.tobytes()), str(array.dtype), list(array.shape),
            array.flags.writeable, writes, unlocks, array.flags.f_contiguous]

def mapping(address):
    # The /proc/self/smaps entry that holds *address*: perms, inode, Pss.
    head, pss = None, None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if not parts[0].endswith(":"):
                if head is not None:
                    break
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= address < hi:
                    head = parts
            elif head is not None and parts[0] == "Pss:":
                pss = int(parts[1])
    return {"perms": head[1], "inode": head[3] + " " + head[4], "pss_kb": pss}

def address(view):
    return np.frombuffer(view, np.uint8).ctypes.data

def mapped(inode):
    with open("/proc/self/maps") as f:
        return any(line.split()[3:5] == inode.split() for line in f)
"""


def sha(data):
    return hashlib.sha256(data).hexdigest()


def describe(array):
    """What a rank reports for a correct read-only copy of *array*."""
    return [
        sha(array.tobytes()),
        str(array.dtype),
        list(array.shape),
        False,  # flags.writeable
        False,  # an assignment raises
        False,  # flags.writeable = True raises
        bool(array.flags.f_contiguous),
    ]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Small data files of every kind, with sizes no chunk size divides."""
    base = tmp_path_factory.mktemp("data")
    blob = random.Random(4).randbytes(10_007)
    paths = {name: base / name for name in ("blob.bin", "c.npy", "f.npy")}
    paths["blob.bin"].write_bytes(blob)
    np.save(paths["c.npy"], np.arange(3 * 257, dtype="<f8").reshape(3, 257))
    np.save(paths["f.npy"], np.asfortranarray(np.arange(35, dtype=">i4").reshape(5, 7)))
    paths["z.npz"] = base / "z.npz"
    np.savez(paths["z.npz"], w=np.eye(4, dtype="<f4"), v=np.arange(5))
    paths["zc.npz"] = base / "zc.npz"
    np.savez_compressed(paths["zc.npz"], w=np.eye(4))
    paths["empty.bin"] = base / "empty.bin"
    paths["empty.bin"].write_bytes(b"")
    return {k.split(".")[0]: str(v) for k, v in paths.items()}


def launch(n, nodes, body, files, env, tmp_path, extra=None, head=""):
    """Run *body* on *n* ranks and *nodes* emulated nodes; return the results."""
    target = write_target(tmp_path / "target.py", head + PRELUDE + body)
    env = dict(env, MPISTAGE_EMULATE_NODES=str(nodes))
    result = mpirun(n, [target, json.dumps({**files, **(extra or {})})], env)
    assert result.returncode == 0, result
    return results(env, n)


SAME = """
out = {"pid": os.getpid()}
for readers in sorted({1, comm.size}):
    for io in ("posix", "mpiio"):
        with data.read(FILES["blob"], comm=comm, readers=readers, io=io) as buf:
            view = buf.view
            out[f"blob {readers} {io}"] = [sha(view), view.readonly, view.format]
            try:
                view[0] = 0
            except TypeError:
                out[f"blob {readers} {io}"].append("refused")
            del view
out["c"] = describe(data.load(FILES["c"], comm=comm).array)
out["f"] = describe(np.asarray(data.load(FILES["f"], comm=comm, readers=comm.size)))
out["npz"] = describe(data.load(FILES["z"], comm=comm, member="w").array)
raw = data.load(FILES["blob"], comm=comm, dtype="<u2", shape=(5, 1000), offset=7)
out["raw"] = describe(raw.array)
out["empty"] = len(data.read(FILES["empty"], comm=comm).view)
emit(out)
"""


@pytest.mark.parametrize("ranks,nodes", LAYOUTS)
def test_same_read_only_bytes_everywhere(tmp_path, stage_env, files, ranks, nodes):
    found = launch(ranks, nodes, SAME, files, stage_env, tmp_path)
    blob = Path(files["blob"]).read_bytes()
    expected = {
        "c": describe(np.load(files["c"])),
        "f": describe(np.load(files["f"])),
        "npz": describe(np.load(files["z"])["w"]),
        "raw": describe(np.frombuffer(blob[7:], "<u2").reshape(5, 1000)),
        "empty": 0,
    }
    for readers in {1, ranks}:
        for io in ("posix", "mpiio"):
            expected[f"blob {readers} {io}"] = [sha(blob), True, "B", "refused"]
    for rank, out in enumerate(found):
        out.pop("pid")
        assert out == expected, f"rank {rank}"


CHUNKED = """
bulk.PIECE_SIZE = read.READ_SIZE = int(sys.argv[2])
spread = []
real_stream = broadcast.stream
def counting(comm, size, *args, **kwargs):
    spread.append(size)
    return real_stream(comm, size, *args, **kwargs)
broadcast.stream = counting
out = {}
for readers in (1, 2, 3):
    for io in ("posix", "mpiio"):
        spread.clear()
        buf = data.read(FILES["blob"], comm=comm, readers=readers, io=io)
        out[f"{readers} {io}"] = [sha(buf.view), sum(spread)]
        buf.close()
emit(out)
"""


@pytest.mark.parametrize("chunk", [63, 64, 65])
def test_tiny_chunks(tmp_path, stage_env, files, chunk):
    """Parts of 1, 2 and 3 readers (one not a leader) cross nodes in tiny chunks."""
    target = write_target(tmp_path / "target.py", PRELUDE + CHUNKED)
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    result = mpirun(4, [target, json.dumps(files), chunk], env)
    assert result.returncode == 0, result
    blob = Path(files["blob"]).read_bytes()
    for rank, out in enumerate(results(env, 4)):
        leader = rank in (0, 2)  # 4 ranks on 2 nodes: ranks 0-1 and 2-3
        for key, (digest, spread) in out.items():
            assert digest == sha(blob), (rank, key)
            # Each leader takes part in broadcasting every part: all the bytes.
            assert spread == (len(blob) if leader else 0), (rank, key)


OPENS = """
emit({"pid": os.getpid()})
for name, readers, io in json.loads(sys.argv[2]):
    if name.endswith(".npy"):
        data.load(FILES[name], comm=comm, readers=readers, io=io).close()
    else:
        data.read(FILES[name], comm=comm, readers=readers, io=io).close()
"""

# (file, readers, io) and the ranks that may touch the file: 4 ranks on 2
# nodes; readers go to the node leaders (ranks 0 and 2) first, then rank 1.
OPEN_CASES = {
    "r1": (1, "posix", {0}),
    "r2": (2, "posix", {0, 2}),
    "r3": (3, "posix", {0, 1, 2}),
    "m2": (2, "mpiio", {0, 2}),
    "n1.npy": (1, "posix", {0}),
}


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_only_readers_touch_the_file(tmp_path, stage_env, files):
    """strace: exactly the reader ranks open (or stat) each file, no other."""
    copies = dict(files)
    for name in OPEN_CASES:
        copies[name] = str(tmp_path / f"{name}.data")
        shutil.copy(
            files["c"] if name.endswith(".npy") else files["blob"], copies[name]
        )
    target = write_target(tmp_path / "target.py", PRELUDE + OPENS)
    plan = [[name, readers, io] for name, (readers, io, _) in OPEN_CASES.items()]
    log = tmp_path / "strace.log"
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    tracer = ["strace", "-f", "--seccomp-bpf", "-e", "trace=%file", "-o", log]
    command = [MPIEXEC, "-n", 4, PYTHON, target, json.dumps(copies), json.dumps(plan)]
    result = run(tracer + command, env=env)
    assert result.returncode == 0, result
    rank_of = {out["pid"]: rank for rank, out in enumerate(results(env, 4))}
    for name, (_, _, ranks) in OPEN_CASES.items():
        pids = touching(log, copies[name])
        assert {rank_of.get(pid) for pid in pids} == ranks, name


def touching(log, path):
    """Return the pids that made any file system call on *path*."""
    quoted = json.dumps(path)
    lines = Path(log).read_text().splitlines()
    return {int(line.split()[0]) for line in lines if quoted in line}


ONE_COPY = """
buf = data.read(FILES["big"], comm=comm)
digest = sha(buf.view)  # touches every page
comm.Barrier()
where = mapping(address(buf.view))
emit({"sha": digest, **where})
comm.Barrier()
"""


@pytest.mark.parametrize("ranks,nodes", [(4, 2), (4, 1)])
def test_one_copy_per_node(tmp_path, stage_env, files, ranks, nodes):
    """The ranks of a node map the same pages; the node holds the file once."""
    big = tmp_path / "big.bin"
    big.write_bytes(random.Random(5).randbytes(4 << 20))
    found = launch(
        ranks, nodes, ONE_COPY, files, stage_env, tmp_path, {"big": str(big)}
    )
    assert {out["sha"] for out in found} == {sha(big.read_bytes())}
    per_node = ranks // nodes
    for node in range(nodes):
        mine = found[node * per_node : (node + 1) * per_node]
        assert len({out["inode"] for out in mine}) == 1, mine
        assert all(out["perms"].endswith("s") for out in mine), mine  # shared
        # Pss splits each shared page between its mappers: the node's ranks
        # together account for one copy of the file, not one per rank.
        assert abs(sum(out["pss_kb"] for out in mine) - 4096) <= 64, mine
    assert len({out["inode"] for out in found}) == nodes


BYTES_LIKE = """
import io, sys
blob = FILES["blob"]
want = open(blob, "rb").read()
out = {"python": list(sys.version_info[:2])}
buf = data.read(blob, comm=comm)
array = np.frombuffer(buf, np.uint8)
out["bytes"] = bytes(buf) == want
out["sha256"] = hashlib.sha256(buf).hexdigest() == hashlib.sha256(want).hexdigest()
out["frombuffer"] = array.tobytes() == want and not array.flags.writeable
out["memoryview_readonly"] = memoryview(buf).readonly
try:
    io.BytesIO(b"xx").readinto(buf)  # asks for a writable buffer
    out["writable_refused"] = False
except (TypeError, BufferError):
    out["writable_refused"] = True
inode = mapping(address(buf.view))["inode"]
kept = memoryview(buf)
buf.close()
out["kept_after_close"] = mapped(inode) and bytes(kept) == want
try:
    memoryview(buf)
    out["closed_refused"] = False
except (ValueError, SystemError):
    out["closed_refused"] = True
del kept, array
data.read(FILES["c"], comm=comm).close()  # any later call frees it
out["freed"] = not mapped(inode)
emit(out)
"""


def test_a_shared_buffer_is_bytes_like(tmp_path, stage_env, files):
    """``bytes``, ``hashlib`` and ``numpy.frombuffer`` take it on this Python.

    Before Python 3.12 no ``__buffer__`` helps: the venv's Python 3.11 runs
    the other mechanism (:mod:`mpistage.data.exports`).
    """
    found = launch(4, 2, BYTES_LIKE, files, stage_env, tmp_path)
    for rank, out in enumerate(found):
        assert out.pop("python") == list(sys.version_info[:2])
        assert out == {
            "bytes": True,
            "sha256": True,
            "frombuffer": True,
            "memoryview_readonly": True,
            "writable_refused": True,
            "kept_after_close": True,
            "closed_refused": True,
            "freed": True,
        }, f"rank {rank}"


# Registered before mpistage.data is imported, so it runs after data's own
# exit handler: the copy still held at exit must be gone by then.
AT_EXIT = """
import atexit, sys
assert "mpistage.data" not in sys.modules
out = {}
atexit.register(lambda: emit(dict(out, exit_freed=not mapped(out["exit"]))))
"""

LIFETIME = """
blob, other = FILES["blob"], FILES["c"]

with data.read(blob, comm=comm) as buf:
    inode = mapping(address(buf.view))["inode"]
    out["with_inside"] = mapped(inode)
out["with_after"] = mapped(inode)
try:
    buf.view
except ValueError:
    out["closed_refuses"] = True

buf = data.read(blob, comm=comm)
inode = mapping(address(buf.view))["inode"]
part = buf.view[100:200] if comm.rank % 2 else None  # one rank per node keeps it
buf.close()
out["kept_by_a_view"] = mapped(inode)
out["view_ok"] = part is None or bytes(part) == open(blob, "rb").read()[100:200]
del part
data.read(other, comm=comm).close()  # any later call frees what nobody uses
out["freed_once_dropped"] = not mapped(inode)

array = data.load(other, comm=comm).array  # the handle is gone at once
inode = mapping(array.ctypes.data)["inode"]
data.read(other, comm=comm).close()
out["kept_by_array"] = mapped(inode) and np.array_equal(array, np.load(other))
del array
data.read(other, comm=comm).close()
out["array_freed"] = not mapped(inode)

keep = data.load(other, comm=comm)
out["exit"] = mapping(keep.array.ctypes.data)["inode"]
"""


def test_lifetime(tmp_path, stage_env, files):
    found = launch(4, 2, LIFETIME, files, stage_env, tmp_path, head=AT_EXIT)
    for rank, out in enumerate(found):
        out.pop("exit")
        assert out == {
            "with_inside": True,
            "with_after": False,
            "closed_refuses": True,
            "kept_by_a_view": True,
            "view_ok": True,
            "freed_once_dropped": True,
            "kept_by_array": True,
            "array_freed": True,
            "exit_freed": True,
        }, f"rank {rank}"


BAD = """
read.READ_SIZE = 1000
real_preadv = os.preadv
def resize(path, size):
    def preadv(fd, buffers, offset):
        n = real_preadv(fd, buffers, offset)
        os.truncate(path, size)  # after the first part is in
        return n
    return preadv
out = {}
for case, path, kwargs in json.loads(sys.argv[2]):
    size = kwargs.pop("resize", None)
    if size is not None and comm.rank == 0:  # rank 0 is the only reader
        open(path, "wb").write(open(FILES["blob"], "rb").read())
        os.preadv = resize(path, size)
    start = time.monotonic()
    try:
        shared = (data.load if kwargs.pop("load", False) else data.read)(
            path, comm=comm, **kwargs
        )
    except StageError as exc:
        out[case] = [str(exc), time.monotonic() - start]
    else:
        out[case] = ["no error", time.monotonic() - start]
    os.preadv = real_preadv
    comm.Barrier()
good = data.read(FILES["blob"], comm=comm)
out["good afterwards"] = [sha(good.view), 0]
emit(out)
"""


AS_ARRAY = """
x = data.load(FILES["c"], comm=comm)
ref = np.load(FILES["c"])
out = {
    "ndarray": isinstance(x, np.ndarray),
    "asarray": np.array_equal(np.asarray(x), ref),
    "shape": list(x.shape),
    "row": np.array_equal(x[0], ref[0]),
    "sum": float(x.sum()),
    "plus": type(x + 1).__name__,
    "read only": not x.flags.writeable,
}
with data.load(FILES["f"], comm=comm) as f:
    same = np.array_equal(f, np.load(FILES["f"]))
    out["fortran"] = bool(f.flags.f_contiguous) and same
out["closed"] = f.closed
emit(out)
"""


def test_load_returns_an_array(tmp_path, stage_env, files):
    target = write_target(tmp_path / "t.py", PRELUDE + AS_ARRAY)
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    result = mpirun(4, [target, json.dumps(files)], env)
    assert result.returncode == 0, result
    ref = np.load(files["c"])
    for found in results(env, 4):
        assert found == {
            "ndarray": True,
            "asarray": True,
            "shape": list(ref.shape),
            "row": True,
            "sum": float(ref.sum()),
            "plus": "ndarray",
            "read only": True,
            "fortran": True,
            "closed": True,
        }


def bad_cases(files, folder):
    """Return {case: (path, keywords, what the message must say)}."""
    folder = Path(folder)
    huge = folder / "huge.bin"
    with open(huge, "wb") as f:
        f.truncate(1 << 40)  # sparse: 1 TiB that takes no disk
    (folder / "text.npy").write_text("not an array\n")
    missing, blob = str(folder / "missing.bin"), files["blob"]
    changing = str(folder / "changing.bin")
    return {
        "missing": (missing, {}, f"cannot read data file {missing!r}: No such file"),
        "directory": (str(folder), {}, "not a regular file"),
        "below a file": (blob + "/x", {}, "Not a directory"),
        "no readers": (blob, {"readers": 0}, "readers=0 must be from 1 to the number"),
        "readers above job": (blob, {"readers": 5}, "number of ranks (4)"),
        "larger than memory": (str(huge), {}, "needs 1099511627776 bytes"),
        "shrinks": (changing, {"resize": 5000}, "10007 bytes, then 5000"),
        "grows": (changing, {"resize": 20000}, "10007 bytes, then 20000"),
        "compressed member": (
            files["zc"],
            {"load": True, "member": "w"},
            "is compressed",
        ),
        "no such member": (files["z"], {"load": True, "member": "q"}, "no member 'q'"),
        "not a npy": (str(folder / "text.npy"), {"load": True}, "is no .npy file"),
    }


@pytest.fixture(scope="module")
def bad_run(tmp_path_factory, files):
    """All bad inputs, one after the other, in one job of 4 ranks on 2 nodes."""
    folder = tmp_path_factory.mktemp("bad")
    cases = bad_cases(files, folder)
    out = folder / "out"
    out.mkdir()
    env = dict(clean_environ(), MPISTAGE_TEST_OUT=str(out), MPISTAGE_EMULATE_NODES="2")
    target = write_target(folder / "target.py", PRELUDE + BAD)
    plan = [[case, path, kwargs] for case, (path, kwargs, _) in cases.items()]
    result = mpirun(4, [target, json.dumps(files), json.dumps(plan)], env)
    assert result.returncode == 0, result
    assert result.elapsed < QUICK, result
    return cases, results(env, 4)


BAD_CASES = [
    "missing",
    "directory",
    "below a file",
    "no readers",
    "readers above job",
    "larger than memory",
    "shrinks",
    "grows",
    "compressed member",
    "no such member",
    "not a npy",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_same_error_on_every_rank(bad_run, case):
    cases, found = bad_run
    messages = {out[case][0] for out in found}
    assert len(messages) == 1, found  # the same error on every rank
    message = messages.pop()
    assert cases[case][2] in message
    assert "\n" not in message
    assert all(out[case][1] < 5 for out in found), found


def test_bad_input_leaves_the_job_usable(bad_run, files):
    _, found = bad_run
    blob = Path(files["blob"]).read_bytes()
    assert {out["good afterwards"][0] for out in found} == {sha(blob)}


# Each rank's stderr goes to a file of its own, and its exit status to stdout.
PER_RANK = '"$0" "$@" 2>"$MPISTAGE_TEST_OUT/err.$PMI_RANK"; echo "rank $PMI_RANK $?"'


def test_bad_input_uncaught_ends_every_rank(tmp_path, stage_env):
    missing = tmp_path / "missing.bin"
    code = (
        "from mpi4py import MPI\nfrom mpistage import data\n"
        f"data.read({str(missing)!r}, comm=MPI.COMM_WORLD)\nprint('not reached')"
    )
    stage_env["MPISTAGE_EMULATE_NODES"] = "2"
    command = [MPIEXEC, "-n", 4, "sh", "-c", PER_RANK, PYTHON, "-c", code]
    result = run(command, env=stage_env)
    assert result.elapsed < QUICK, result
    assert sorted(result.stdout.splitlines()) == [f"rank {r} 1" for r in range(4)]
    expected = f"cannot read data file {str(missing)!r}: No such file or directory"
    out = Path(stage_env["MPISTAGE_TEST_OUT"])
    for rank in range(4):
        last = (out / f"err.{rank}").read_text().splitlines()[-1]
        assert last == f"mpistage.StageError: {expected}", rank


def without_read_override():
    """Return a command prefix that makes root obey file modes, or ``None``."""
    if os.getuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        return None
    caps = "-dac_override,-dac_read_search"
    prefix = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]
    probe = subprocess.run([*prefix, "true"], capture_output=True)
    return prefix if probe.returncode == 0 else None


UNREADABLE = """
try:
    data.read(sys.argv[2], comm=comm)
except StageError as exc:
    emit(str(exc))
"""


def test_unreadable_file(tmp_path, stage_env, files):
    prefix = without_read_override()
    if prefix is None:
        pytest.skip("running as root without setpriv: every file is readable")
    locked = tmp_path / "locked.bin"
    locked.write_bytes(b"secret")
    locked.chmod(0)
    target = write_target(tmp_path / "target.py", PRELUDE + UNREADABLE)
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    args = [MPIEXEC, "-n", 4, PYTHON, target, json.dumps(files), locked]
    start = time.monotonic()
    result = run(prefix + args, env=env)
    assert result.returncode == 0, result
    assert time.monotonic() - start < QUICK
    expected = f"cannot read data file {str(locked)!r}: Permission denied"
    assert results(env, 4) == [expected] * 4
