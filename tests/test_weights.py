"""Model weights once per job: ``mpistage.data.staged_dir`` and ``tensors``.

Every test launches a real ``mpiexec`` on emulated nodes; the targets write
one JSON result per rank (``emit``), which the tests compare with what the
files hold. Pieces are made tiny where it matters (``bulk.PIECE_SIZE``), so
that one piece spans several files and one file several pieces.
"""

import hashlib
import json
import os
import shutil
import stat
import time
from pathlib import Path

import pytest

from stagetools import MPIEXEC, PYTHON, job_dirs, mpirun, results, run, write_target

pytestmark = pytest.mark.usefixtures("reap_mpich_shm")

QUICK = 20  # seconds a job of failures may take, at most

PRELUDE = """
import hashlib, json, os, stat, sys, time
from mpi4py import MPI
import mpistage.runtime.bulk as bulk
from mpistage import StageError, data
comm = MPI.COMM_WORLD
ARGS = json.loads(sys.argv[1])

def sha(b):
    return hashlib.sha256(b).hexdigest()

def tree(top):
    found = {}
    for folder, _, names in os.walk(top):
        for name in names:
            path = os.path.join(folder, name)
            st = os.stat(path)
            with open(path, "rb") as f:
                found[os.path.relpath(path, top)] = [
                    sha(f.read()), stat.S_IMODE(st.st_mode), st.st_mtime_ns
                ]
    return found

def places(candidate):
    found = []
    for user in os.listdir(candidate):
        found += [f"{user}/{n}" for n in os.listdir(os.path.join(candidate, user))]
    return found
"""


def sha(data):
    return hashlib.sha256(data).hexdigest()


def expected_tree(top, names):
    """What a rank must find in its copy of *top*: the files *names*."""
    found = {}
    for rel in names:
        st = (Path(top) / rel).stat()
        mode = (stat.S_IMODE(st.st_mode) | 0o400) & 0o555
        found[rel] = [sha((Path(top) / rel).read_bytes()), mode, st.st_mtime_ns]
    return found


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint-shaped tree: shards, an index, tokenizer files, an empty file."""
    top = tmp_path_factory.mktemp("ckpt") / "tiny-model"
    (top / "tokenizer" / "extra").mkdir(parents=True)
    (top / "unused").mkdir()
    rng = __import__("random").Random(7)
    sizes = {"a.safetensors": 10_007, "b.safetensors": 333, "c.safetensors": 1}
    for name, size in sizes.items():
        (top / name).write_bytes(rng.randbytes(size))
    (top / "config.json").write_text('{"hidden_size": 8}\n')
    (top / "tokenizer" / "vocab.txt").write_text("a\nb\nc\n")
    (top / "tokenizer" / "extra" / "merges.txt").write_bytes(rng.randbytes(99))
    (top / "tokenizer" / "empty").write_bytes(b"")
    (top / "unused" / "notes.md").write_text("not staged with include\n")
    (top / "b.safetensors").chmod(0o640)
    return top


def all_files(top):
    return sorted(str(p.relative_to(top)) for p in Path(top).rglob("*") if p.is_file())


def launch(n, nodes, body, args, env, tmp_path, prefix=()):
    """Run *body* on *n* ranks and *nodes* emulated nodes; return (result, outs)."""
    target = write_target(tmp_path / "target.py", PRELUDE + body)
    env = dict(env, MPISTAGE_EMULATE_NODES=str(nodes))
    command = [*prefix, MPIEXEC, "-n", n, PYTHON, target, json.dumps(args)]
    result = run(command, env=env)
    assert result.returncode == 0, result
    return result, results(env, n)


STAGED = """
bulk.PIECE_SIZE = ARGS["piece"]
out = {}
with data.staged_dir(ARGS["top"], comm=comm, include=ARGS["include"]) as local:
    out["tree"] = tree(local)
    place = os.path.dirname(local)
    out["name"] = os.path.basename(local)
    out["place"] = [stat.S_IMODE(os.stat(place).st_mode), os.stat(place).st_uid]
    out["below"] = os.path.realpath(place).startswith(ARGS["stage"] + "/")
    with open(os.path.join(local, "a.safetensors"), "rb") as f:
        import mmap
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        out["inode"] = list(os.fstat(f.fileno())[1:3])
    comm.Barrier()
comm.Barrier()  # every leader has removed its copy by now
out["gone"] = not os.path.exists(local)
out["left"] = places(ARGS["stage"])
out["mapped after"] = sha(mapped[:]) == ARGS["a"]
emit(out)
"""


@pytest.mark.parametrize(
    "ranks,nodes,piece,include",
    [(4, 2, 61, None), (3, 1, 1 << 20, ["*.safetensors", "tokenizer/extra"])],
)
def test_staged_dir_same_tree_on_every_rank(
    tmp_path, stage_env, stage_dir, checkpoint, ranks, nodes, piece, include
):
    """Every rank finds the tree (or what *include* takes) in its node's copy.

    The copy is in a place of the node's own (0700, below the candidate),
    the files are read-only with their original's times; the ranks of one
    node map one file, those of different nodes different ones. The copy
    is gone after the block; a map of it stays readable.
    """
    args = dict(
        top=str(checkpoint),
        piece=piece,
        include=include,
        stage=str(stage_dir),
        a=sha((checkpoint / "a.safetensors").read_bytes()),
    )
    _, found = launch(ranks, nodes, STAGED, args, stage_env, tmp_path)
    names = all_files(checkpoint)
    if include:
        names = [n for n in names if n.endswith(".safetensors") or "extra/" in n]
    want = expected_tree(checkpoint, names)
    per_node = ranks // nodes
    for rank, out in enumerate(found):
        assert out["tree"] == want, rank
        assert out["name"] == "tiny-model"
        assert out["place"] == [0o700, os.getuid()]
        assert out["below"] and out["gone"] and out["mapped after"], out
        assert out["left"] == [f"mpistage-{os.getuid()}"] or out["left"] == [], out
    inodes = [tuple(out["inode"]) for out in found]
    for node in range(nodes):
        assert len(set(inodes[node * per_node : (node + 1) * per_node])) == 1
    assert len(set(inodes)) == nodes
    assert job_dirs(stage_dir) == []


BAD = """
bulk.PIECE_SIZE = 100
real_preadv, real_pwritev = os.preadv, os.pwritev
def after_first_read(action):
    def preadv(fd, buffers, offset):
        n = real_preadv(fd, buffers, offset)
        os.preadv = real_preadv
        action()
        return n
    return preadv
def failing_write(calls):
    def pwritev(fd, buffers, offset):
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real_pwritev(fd, buffers, offset)
    return pwritev
out = {}
for case, path, how in ARGS["cases"]:
    if how == "shrink" and comm.rank == 0:
        os.preadv = after_first_read(lambda: os.truncate(path + "/a.bin", 10))
    if how == "swap" and comm.rank == 0:
        link = path + "/b.bin"
        os.preadv = after_first_read(lambda: (os.unlink(link), os.symlink("a", link)))
    if how == "full" and comm.rank == comm.size // 2:  # the leader of node 1
        os.pwritev = failing_write([])
    if how == "differ":
        path = path + str(comm.rank % 2)
    start = time.monotonic()
    try:
        with data.staged_dir(path, comm=comm, include=ARGS["include"].get(case)):
            message = "no error"
    except StageError as exc:
        message = str(exc)
    os.preadv, os.pwritev = real_preadv, real_pwritev
    comm.Barrier()
    out[case] = [message, time.monotonic() - start, places(ARGS["stage"])]
with data.staged_dir(ARGS["good"], comm=comm) as local:
    out["good afterwards"] = tree(local)
emit(out)
"""


def bad_trees(folder, checkpoint):
    """Return {case: (path, how, what the message must say)} of bad trees."""
    folder = Path(folder)
    folder.mkdir()

    def tree_with(name, make):
        top = folder / name
        top.mkdir()
        (top / "a.bin").write_bytes(os.urandom(1000))
        (top / "b.bin").write_bytes(os.urandom(500))
        make(top)
        return str(top)

    link = tree_with("link", lambda t: (t / "c.bin").symlink_to("/etc/hostname"))
    fifo = tree_with("fifo", lambda t: os.mkfifo(t / "pipe"))
    plain = [tree_with(n, lambda t: None) for n in ("shrink", "swap", "full")]
    missing = str(folder / "missing")
    return {
        "symlink inside": (link, "", f"{link + '/c.bin'!r} is a symlink"),
        "missing": (missing, "", f"cannot read data directory {missing!r}: No such"),
        "fifo inside": (fifo, "", f"{fifo + '/pipe'!r} is not a regular file"),
        "shrinks while read": (plain[0], "shrink", "a.bin' changed while being read"),
        "swapped for a symlink": (plain[1], "swap", "b.bin': is a symlink"),
        "a node's place fills up": (plain[2], "full", "no space left for the copy"),
        "ranks differ": (plain[2], "differ", "the ranks' arguments differ: path="),
        "include takes nothing": (str(checkpoint), "", "holds no files matching"),
    }


def test_bad_trees_one_line_everywhere_nothing_left(
    tmp_path, stage_env, stage_dir, checkpoint
):
    """Each bad tree is the same one line on every rank, quickly, and no copy stays.

    Failures before the stream (a symlink, a FIFO, a missing path), in the
    middle of it on rank 0 (a file that shrinks, one swapped for a symlink)
    and on a leader (its place full): the job goes on, and stages a good
    tree afterwards.
    """
    cases = bad_trees(tmp_path / "bad", checkpoint)
    args = dict(
        cases=[[case, path, how] for case, (path, how, _) in cases.items()],
        include={"include takes nothing": ["*.nothing"]},
        stage=str(stage_dir),
        good=str(checkpoint),
    )
    result, found = launch(4, 2, BAD, args, stage_env, tmp_path)
    assert result.elapsed < QUICK, result
    for case, (_, _, says) in cases.items():
        messages = {out[case][0] for out in found}
        assert len(messages) == 1, (case, found)  # the same on every rank
        message = messages.pop()
        assert says in message and "\n" not in message, (case, message)
        for out in found:
            assert out[case][1] < 5, (case, out[case])
            assert out[case][2] in ([], [f"mpistage-{os.getuid()}"]), (case, out)
    want = expected_tree(checkpoint, all_files(checkpoint))
    assert all(out["good afterwards"] == want for out in found)


def without_read_override():
    """A prefix that makes root obey file modes (``setpriv``), ``[]``, or ``None``."""
    if os.getuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        return None
    caps = "-dac_override,-dac_read_search"
    prefix = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]
    probe = run([*prefix, "true"])
    return prefix if probe.returncode == 0 else None


UNREADABLE = """
try:
    data.staged_dir(ARGS["top"], comm=comm)
except StageError as exc:
    emit([str(exc), places(ARGS["stage"])])
"""


def test_unreadable_file(tmp_path, stage_env, stage_dir):
    prefix = without_read_override()
    if prefix is None:
        pytest.skip("running as root without setpriv: every file is readable")
    top = tmp_path / "locked"
    top.mkdir()
    (top / "a.bin").write_bytes(b"x" * 100)
    (top / "b.bin").write_bytes(b"secret")
    (top / "b.bin").chmod(0)
    args = dict(top=str(top), stage=str(stage_dir))
    _, found = launch(4, 2, UNREADABLE, args, stage_env, tmp_path, prefix)
    said = f"cannot read data file {str(top / 'b.bin')!r}: Permission denied"
    assert [out[0] for out in found] == [said] * 4
    assert job_dirs(stage_dir) == []


LEFT_OPEN = """
copy = data.staged_dir(ARGS["top"], comm=comm)
with open(os.path.join(copy.path, "config.json")) as f:
    f.read()
emit({"path": copy.path, "pid": os.getpid()})
comm.Barrier()
if ARGS["abort"] and comm.rank == ARGS["abort"]:
    comm.Abort(3)
comm.Barrier()
"""


@pytest.mark.parametrize("abort", [0, 2])
def test_copy_goes_with_the_job(tmp_path, stage_env, stage_dir, checkpoint, abort):
    """A copy never closed goes at exit; after ``MPI_Abort`` its watchdog removes it."""
    target = write_target(tmp_path / "target.py", PRELUDE + LEFT_OPEN)
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    args = json.dumps(dict(top=str(checkpoint), abort=abort))
    result = mpirun(4, [target, args], env)
    assert (result.returncode != 0) == bool(abort), result
    paths = {out["path"] for out in results(env, 4)}
    assert len(paths) == 2
    deadline = time.monotonic() + 10
    while any(Path(p).exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(Path(p).exists() for p in paths)
    assert job_dirs(stage_dir) == []
