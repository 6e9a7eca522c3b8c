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
    while time.monotonic() < deadline and (  # renamed first, then removed
        any(Path(p).exists() for p in paths) or job_dirs(stage_dir)
    ):
        time.sleep(0.05)
    assert not any(Path(p).exists() for p in paths)
    assert job_dirs(stage_dir) == []


# -- tensors: safetensors checkpoints ---------------------------------------------


def write_raw(path, header, data):
    """Write a safetensors file by hand: the length, the JSON *header*, *data*."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    Path(path).write_bytes(len(blob).to_bytes(8, "little") + blob + data)


def save_sharded(folder, shards, metadata=None):
    """Write *shards* ({file: {name: array}}) and their index, as transformers does."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    weight_map = {}
    for name, arrays in shards.items():
        save_file(arrays, folder / name, metadata=metadata)
        weight_map.update({tensor: name for tensor in arrays})
    index = {"metadata": {"total_size": 1}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A single file and a sharded checkpoint written by safetensors (numpy)."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("safetensors")
    from safetensors.numpy import save_file

    base = tmp_path_factory.mktemp("weights")
    rng = np.random.default_rng(3)
    single = {
        "w": rng.standard_normal((33, 7)).astype(np.float32),
        "h": rng.standard_normal(5).astype(np.float16),
        "ids": np.arange(11, dtype=np.int64),
        "mask": np.array([True, False, True]),
        "bytes": rng.integers(0, 255, (3, 1, 2), dtype=np.uint8),
        "scalar": np.array(2.5, dtype=np.float64),
        "none": np.zeros((0, 4), dtype=np.int32),
    }
    save_file(single, base / "one.safetensors", metadata={"format": "np"})
    shards = {
        "model-00001-of-00003.safetensors": {"a.weight": single["w"] * 2},
        "model-00002-of-00003.safetensors": {
            "b.weight": rng.standard_normal((64, 3)).astype(np.float32),
            "b.bias": np.arange(3, dtype=np.int16),
        },
        "model-00003-of-00003.safetensors": {"c": np.arange(1000, dtype=np.uint32)},
    }
    sharded = save_sharded(base / "sharded", shards, metadata={"format": "pt"})
    (sharded / "consolidated.safetensors").write_bytes(b"not in the index")
    return {"single": str(base / "one.safetensors"), "sharded": str(sharded)}


TENSORS = """
import mmap
import numpy as np
from safetensors.numpy import load_file
bulk.PIECE_SIZE = 97

def where(array):
    address = array.__array_interface__["data"][0]
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return [parts[1], parts[3] + " " + parts[4]]

out = {}
for case, path in ARGS["paths"].items():
    found = data.tensors(path, comm=comm)
    if os.path.isdir(path):
        index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
        files = sorted(set(index["weight_map"].values()))
        want = {}
        for name in files:
            want.update(load_file(os.path.join(path, name)))
    else:
        want = load_file(path)
    same = sorted(found) == sorted(want) and all(
        found[k].dtype == want[k].dtype and found[k].shape == want[k].shape
        and np.array_equal(found[k], want[k]) for k in want
    )
    refused = []
    for name, array in found.items():
        if array.size == 0:
            continue
        try:
            array[(0,) * array.ndim] = 1
            refused.append(False)
        except ValueError:
            refused.append(True)
        try:
            array.flags.writeable = True
            refused.append(False)
        except ValueError:
            refused.append(True)
    biggest = max(found.values(), key=lambda a: a.size)
    out[case] = {
        "same": same, "read only": all(refused), "dict": isinstance(found, dict),
        "map": where(biggest), "metadata": found.metadata, "index": found.index,
    }
    comm.Barrier()  # every leader has removed the names by now
    out[case]["left"] = places(ARGS["stage"])
    out[case]["valid after"] = float(biggest.sum()) == float(want[
        next(k for k in want if want[k].size == biggest.size)].sum())
emit(out)
"""


@pytest.mark.parametrize("ranks,nodes", [(4, 2), (3, 3)])
def test_tensors_are_what_safetensors_reads(
    tmp_path, stage_env, stage_dir, checkpoints, ranks, nodes
):
    """Every rank gets the tensors safetensors reads, read-only, viewing one map
    per node (shared), of a file whose name is gone already."""
    args = dict(paths=checkpoints, stage=str(stage_dir))
    _, found = launch(ranks, nodes, TENSORS, args, stage_env, tmp_path)
    per_node = ranks // nodes
    shards = sorted(
        p.name for p in Path(checkpoints["sharded"]).glob("model-*.safetensors")
    )
    for case in ("single", "sharded"):
        outs = [out[case] for out in found]
        for out in outs:
            assert out["same"] and out["read only"] and out["dict"], out
            assert out["left"] == [] and out["valid after"], out
            assert out["map"][0] == "r--s", out  # a shared, read-only map
        if case == "single":
            assert outs[0]["metadata"] == {"one.safetensors": {"format": "np"}}
            assert outs[0]["index"] is None
        else:
            assert outs[0]["metadata"] == {s: {"format": "pt"} for s in shards}
            assert outs[0]["index"] == {"total_size": 1}
        inodes = [out["map"][1] for out in outs]
        for node in range(nodes):
            assert len(set(inodes[node * per_node : (node + 1) * per_node])) == 1
        assert len(set(inodes)) == nodes


TORCH = """
import torch
from safetensors.torch import load_file
found = data.tensors(ARGS["path"], comm=comm, framework="pt")
want = load_file(ARGS["path"])
emit({
    "same": sorted(found) == sorted(want)
    and all(torch.equal(found[k], want[k]) for k in want),
    "torch": all(isinstance(v, torch.Tensor) for v in found.values()),
})
"""


def test_tensors_for_torch(tmp_path, stage_env, checkpoints):
    pytest.importorskip("torch", reason="torch is not installed in this venv")
    args = dict(path=checkpoints["single"])
    _, found = launch(4, 2, TORCH, args, stage_env, tmp_path)
    assert found == [{"same": True, "torch": True}] * 4


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_one_read_of_each_shard_per_job(tmp_path, stage_env, checkpoints):
    """strace: in the whole job each shard is opened once and each byte read once;
    the index is read once, and the file the index leaves out is never opened."""
    body = "bulk.PIECE_SIZE = 300\ndata.tensors(ARGS['path'], comm=comm)\nemit(0)\n"
    target = write_target(tmp_path / "target.py", PRELUDE + body)
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    log = tmp_path / "strace.log"
    # -ff: a file per thread, so that no call is split by another thread's
    tracer = ["strace", "-ff", "-y", "-e", "trace=%file,%desc", "-o", log]
    args = json.dumps(dict(path=checkpoints["sharded"]))
    result = run([*tracer, MPIEXEC, "-n", 4, PYTHON, target, args], env=env)
    assert result.returncode == 0, result
    lines = [
        ln for p in tmp_path.glob("strace.log.*") for ln in p.read_text().splitlines()
    ]
    folder = Path(checkpoints["sharded"])
    calls = [(ln.split("(")[0], ln) for ln in lines if "(" in ln]
    for shard in sorted(folder.glob("*.safetensors*")):
        mine = [(call, ln) for call, ln in calls if f"<{shard}>" in ln]
        opens = [ln for call, ln in mine if call.startswith("open")]
        reads = [ln for call, ln in mine if "read" in call]
        got = sum(int(ln.rsplit("=", 1)[1].split("<")[0]) for ln in reads)
        if shard.name == "consolidated.safetensors":
            assert opens == [] and got == 0, shard
        else:
            assert len(opens) == 1, (shard, opens)
            assert got == shard.stat().st_size, shard


def hostile(folder, checkpoints):
    """Return {case: (path, what the message says)} of bad checkpoints."""
    folder = Path(folder)
    folder.mkdir()
    f32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    cases = {
        "header of 2**63 bytes": ({}, b"", "its header claims 9223372036854775808"),
        "invalid JSON": (b'{"a": ', b"", "is no valid JSON"),
        "names twice": (
            b'{"a": ' + json.dumps(f32).encode() + b', "a": {}}',
            bytes(8),
            "'a' appears twice",
        ),
        "offsets out of range": (
            {"a": f32},
            bytes(4),
            "[0, 8], past the 4 bytes of data",
        ),
        "overlapping offsets": (
            {"a": f32, "b": dict(f32, data_offsets=[4, 12])},
            bytes(12),
            "tensors 'a' and 'b' overlap",
        ),
        "shape and bytes differ": (
            {"a": dict(f32, shape=[3])},
            bytes(8),
            "shape [3] of F32 needs 12 bytes",
        ),
        "unknown dtype": ({"a": dict(f32, dtype="F128")}, bytes(8), "dtype 'F128'"),
        "bytes of no tensor": ({"a": f32}, bytes(12), "bytes 8 to 12 of its data"),
    }
    found = {}
    for number, (case, (header, data, says)) in enumerate(cases.items()):
        path = folder / f"{number}.safetensors"
        if case == "header of 2**63 bytes":
            path.write_bytes((1 << 63).to_bytes(8, "little") + b"{}")
        else:
            write_raw(path, header, data)
        found[case] = (str(path), says)
    sharded = Path(checkpoints["sharded"])
    swapped = folder / "swapped"
    shutil.copytree(sharded, swapped)
    theirs = folder / "theirs.safetensors"
    theirs.write_bytes((swapped / "model-00002-of-00003.safetensors").read_bytes())
    if os.getuid() == 0:
        os.chown(theirs, 65534, 65534)  # another user's file
    victim = swapped / "model-00002-of-00003.safetensors"
    victim.unlink()
    victim.symlink_to(theirs)
    found["a shard swapped for a symlink"] = (str(swapped), f"{str(victim)!r} is a")
    wrong = folder / "wrong-index"
    shutil.copytree(sharded, wrong)
    index = json.loads((wrong / "model.safetensors.index.json").read_text())
    index["weight_map"]["c"] = "model-00001-of-00003.safetensors"
    (wrong / "model.safetensors.index.json").write_text(json.dumps(index))
    found["index names the wrong shard"] = (str(wrong), "puts tensor 'c' in")
    escape = folder / "escape"
    escape.mkdir()
    weight_map = {"weight_map": {"w": "../0.safetensors"}}
    (escape / "model.safetensors.index.json").write_text(json.dumps(weight_map))
    found["index leaves its directory"] = (str(escape), "not a file name beside")
    return found


HOSTILE = """
out = {}
for case, path in ARGS["cases"].items():
    framework = "tf" if case == "framework" else "np"
    start = time.monotonic()
    try:
        data.tensors(path, comm=comm, framework=framework)
        message = "no error"
    except StageError as exc:
        message = str(exc)
    comm.Barrier()
    with open("/proc/self/maps") as f:
        mapped = [line for line in f if ARGS["stage"] in line]
    out[case] = [message, time.monotonic() - start, places(ARGS["stage"]), mapped]
out["good afterwards"] = len(data.tensors(ARGS["good"], comm=comm))
emit(out)
"""


def test_hostile_checkpoints_one_line_nothing_mapped_nothing_left(
    tmp_path, stage_env, stage_dir, checkpoints
):
    """A bad header, a bad index, a shard swapped for a symlink to another
    user's file: one line on every rank, nothing mapped, no copy left."""
    cases = hostile(tmp_path / "hostile", checkpoints)
    cases["framework"] = (checkpoints["single"], "framework='tf': use 'np'")
    args = dict(
        cases={case: path for case, (path, _) in cases.items()},
        stage=str(stage_dir),
        good=checkpoints["sharded"],
    )
    result, found = launch(4, 2, HOSTILE, args, stage_env, tmp_path)
    assert result.elapsed < QUICK, result
    for case, (_, says) in cases.items():
        messages = {out[case][0] for out in found}
        assert len(messages) == 1, (case, found)
        message = messages.pop()
        assert says in message and "\n" not in message, (case, message)
        for out in found:
            assert out[case][1] < 5 and out[case][2:] == [[], []], (case, out[case])
    assert {out["good afterwards"] for out in found} == {4}


# -- the command line: mpistage data, the runner's --data, mpistage run --data -----

APP = """
import json, os
from mpi4py import MPI
paths = os.environ["MPISTAGE_DATA_DIR"].split(":")
found = {p: sorted(os.listdir(p)) for p in paths}
name = os.path.join(os.environ["MPISTAGE_TEST_OUT"], f"{MPI.COMM_WORLD.rank}.json")
with open(name, "w") as f:
    json.dump(found, f)
"""


def node_copies(found, nodes, per_node):
    """The node-local paths each node's ranks saw (all the same within a node)."""
    seen = []
    for node in range(nodes):
        mine = found[node * per_node : (node + 1) * per_node]
        assert all(out == mine[0] for out in mine), mine
        seen.append(mine[0])
    return seen


def test_the_runner_stages_data_before_the_program(
    tmp_path, stage_env, stage_dir, checkpoint, checkpoints
):
    """``mpistage --data DIR --data DIR2 app.py``: the program finds both copies in
    ``MPISTAGE_DATA_DIR``, each node its own; nothing is left after the job."""
    app = tmp_path / "app.py"
    app.write_text(APP)
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    env["MPISTAGE_LIVE"] = "no"
    sharded = checkpoints["sharded"]
    args = ["-m", "mpistage", "--data", checkpoint, "--data", sharded, app]
    result = mpirun(4, args, env)
    assert result.returncode == 0, result
    seen = node_copies(results(env, 4), 2, 2)
    for copies in seen:
        first, second = copies
        assert Path(first).name == "tiny-model" and Path(second).name == "sharded"
        assert copies[first] == sorted(p.name for p in checkpoint.iterdir())
        assert copies[second] == sorted(os.listdir(sharded))
    assert seen[0].keys() != seen[1].keys()
    assert job_dirs(stage_dir) == []


def test_the_runner_refuses_a_missing_data_directory(tmp_path, stage_env):
    app = tmp_path / "app.py"
    app.write_text(APP)
    missing = tmp_path / "missing"
    env = dict(stage_env, MPISTAGE_DATA=str(missing), MPISTAGE_LIVE="no")
    result = mpirun(2, ["-m", "mpistage", app], env)
    assert result.returncode == 1, result
    said = f"cannot read data directory {str(missing)!r}: No such file or directory"
    assert result.errors() == [f"mpistage: error: {said}"]


def test_mpistage_run_data(tmp_path, stage_env, checkpoint):
    """``mpistage run --data DIR -- mpiexec ... python app.py``: a stage step reads
    DIR once and copies it per node, the run step finds it, the clean step
    removes it."""
    app = tmp_path / "app.py"
    app.write_text(APP)
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    folder = tmp_path / "env" / "n{node}"
    command = [PYTHON, "-m", "mpistage", "run", "--data", checkpoint, "--to", folder]
    command += ["--", MPIEXEC, "-n", 4, PYTHON, app]
    result = run(command, env=env)
    assert result.returncode == 0, result
    seen = node_copies(results(env, 4), 2, 2)
    for node, copies in enumerate(seen):
        assert list(copies) == [str(tmp_path / "env.data" / f"n{node}" / "tiny-model")]
        assert list(copies.values()) == [sorted(p.name for p in checkpoint.iterdir())]
    assert not (tmp_path / "env.data").exists()


def test_mpistage_data_stages_for_a_later_step(tmp_path, stage_env, checkpoint):
    """``mpistage data DIR --to FOLDER``: the copies stay, marked; a FOLDER that is
    not empty is refused in one line."""
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    folder = tmp_path / "copy-{node}"
    command = [MPIEXEC, "-n", 2, PYTHON, "-m", "mpistage", "data", checkpoint]
    command += ["--to", folder, "--include", "*.safetensors"]
    result = run(command, env=env)
    assert result.returncode == 0, result
    assert result.stdout == f'export MPISTAGE_DATA_DIR="{folder}/tiny-model"\n'
    for node in (0, 1):
        copy = tmp_path / f"copy-{node}"
        assert (copy / ".mpistage-stage").read_text().count("state=complete") == 1
        names = sorted(p.name for p in (copy / "tiny-model").iterdir())
        assert names == ["a.safetensors", "b.safetensors", "c.safetensors"]
    again = run(command, env=env)
    assert again.returncode == 1, again
    assert "is not empty; choose a new or empty directory" in again.stderr
    assert len(again.errors()) == 1
