"""``mpistage bench weights``: a sharded checkpoint on the shared FS, plain vs mpistage.

P ranks on N emulated nodes load every tensor of a safetensors checkpoint
that lives on the simulated shared file system (:mod:`mpistage.bench.simfs`),
each node through a simfs mount of its own, as in ``mpistage bench data``
(:mod:`mpistage.bench.data`, whose testbed, counters and memory figures this
benchmark shares):

- ``plain-map``: every rank opens each shard from the shared FS, parses its
  header and maps it (``numpy.frombuffer`` over ``mmap``), as ``safe_open``
  and ``torch.load(mmap=True)`` do: the ranks of a node share their node's
  client cache, every node fetches the checkpoint;
- ``plain-read``: every rank reads each shard into memory of its own
  (``safetensors.numpy.load_file``), where the checkpoint is small enough
  for a copy per rank (and the ``safetensors`` package is installed);
- ``mpistage``: :func:`mpistage.data.tensors`: one read per job, one copy
  per node, every rank's arrays view it.

The checkpoints: one made here of ``--size`` bytes in ``--shards`` shards of
float32 tensors with their ``model.safetensors.index.json``, and, with
``--checkpoint DIR``, a real one (copied onto the shared FS first).

Each cell is one ``mpiexec`` launch. *load s* runs from a common start until
the slowest rank has touched every page of every tensor; the shared FS's
bytes and operations are simfs's counters, all mounts together; the memory
per node is the sum of the node's ranks' Pss once every rank holds its
tensors (a page shared by k ranks counts 1/k in each).
"""

import json as _json
import os as _os
import sys as _sys

from mpistage.bench.data import DataTestbed, fs_counts, node_memory
from mpistage.bench.testbed import progress
from mpistage.bench.units import MB, MIB

MEMORY_SHARE = 0.6  # of a node's memory the largest cell may hold
PRIVATE_SHARE = 0.2  # of it the private copies of plain-read may take
CELL_TIMEOUT = 900  # seconds: a cell that takes longer is stuck
TENSOR_BYTES = 64 * MIB  # bytes of one crafted tensor at most
PAGE = 4096  # a touch reads one byte per page
MODES = ("plain-map", "plain-read", "mpistage")

DRIVER = r"""
import json, mmap, os, sys, time
from mpi4py import MPI
import numpy as np

cfg = json.loads(sys.argv[1])
comm = MPI.COMM_WORLD
PAGE = cfg["page"]

def pss_kib():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("Pss:"))

def barrier():  # sleeps: waiting ranks leave the cores to the working ones
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.0005)

def shards(path):
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = ["model.safetensors"]
    return [os.path.join(path, n) for n in names]

DTYPES = {"F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "U8": "u1",
          "BOOL": "bool", "F64": "<f8", "I8": "i1", "I16": "<i2"}

def plain_map(path):  # what safe_open / torch.load(mmap=True) do, per rank
    found = {}
    for shard in shards(path):
        with open(shard, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
            memory = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        header.pop("__metadata__", None)
        for name, t in header.items():
            lo, hi = t["data_offsets"]
            dtype = np.dtype(DTYPES[t["dtype"]])
            count, offset = (hi - lo) // dtype.itemsize, 8 + length + lo
            flat = np.frombuffer(memory, dtype, count, offset)
            found[name] = flat.reshape(t["shape"])
    return found

def plain_read(path):
    from safetensors.numpy import load_file
    found = {}
    for shard in shards(path):
        found.update(load_file(shard))
    return found

def touch(tensors):  # one byte per page of every tensor, in name order
    total = 0
    for name in sorted(tensors):
        flat = np.ascontiguousarray(tensors[name]).reshape(-1).view(np.uint8)
        if flat.size:
            total += int(flat[::PAGE].sum(dtype=np.int64)) + int(flat[-1])
    return total

node = comm.rank * cfg["nodes"] // comm.size  # as MPISTAGE_EMULATE_NODES splits
os.chdir(os.path.dirname(cfg["paths"][node]))
path = os.path.basename(cfg["paths"][node])
if cfg["mode"] == "mpistage":
    from mpistage import data
before = pss_kib()
barrier()
start = time.perf_counter()
if cfg["mode"] == "mpistage":
    tensors = data.tensors(path, comm=comm)
    steps = tensors.seconds
else:
    load = plain_map if cfg["mode"] == "plain-map" else plain_read
    tensors, steps = load(path), {}
total = touch(tensors)
seconds = time.perf_counter() - start
barrier()
row = dict(rank=comm.rank, pid=os.getpid(), before=before, after=pss_kib(),
           seconds=seconds, total=total, steps=steps)
rows = comm.gather(row, root=0)
barrier()
if comm.rank == 0:
    with open(cfg["result"], "w") as f:
        json.dump(rows, f)
"""

CELL = ("checkpoint", "mode", "ranks", "nodes")
FIGURES = (
    "seconds",
    "stream_s",
    "fs_bytes",
    "fs_ops",
    "fs_meta_ops",
    "fs_processes",
    "node_pss_mib",
    "node_array_mib",
)


def parser():
    """Return the argument parser of ``mpistage bench weights``."""
    from mpistage.cli import argument_parser

    p = argument_parser(
        prog="mpistage bench weights",
        description="Load every tensor of a safetensors checkpoint from the "
        "simulated shared file system on P ranks: every rank mapping the "
        "shards vs mpistage.data.tensors.",
    )
    p.add_argument("--size", default="2GB", help="crafted checkpoint (default 2GB)")
    p.add_argument("--shards", type=int, default=8, help="its shards (default 8)")
    p.add_argument(
        "--checkpoint", metavar="DIR", help="a real checkpoint directory too"
    )
    p.add_argument("--ranks", default="4,16", help="rank counts (default 4,16)")
    p.add_argument("--nodes", type=int, default=4, help="emulated nodes (default 4)")
    p.add_argument("--latency", default="0.5ms", help="metadata latency of simfs")
    p.add_argument(
        "--bandwidth", default="none", help="simfs bandwidth, all clients together"
    )
    p.add_argument("--repeat", type=int, default=1, help="runs per cell (median)")
    p.add_argument("-o", "--out", default="bench-weights", help="output directory")
    return p


def cli_weights(argv):
    """Run ``mpistage bench weights``; print the table, write weights.json."""
    from mpistage.bench.units import parse_counts, parse_size

    args = parser().parse_args(argv)
    args.local = False
    size = int(parse_size(args.size, "--size"))
    ranks = parse_counts(args.ranks, "--ranks")
    testbed = WeightsTestbed(args)
    try:
        checkpoints = {"crafted": testbed.crafted(size, max(1, args.shards))}
        if args.checkpoint:
            checkpoints["real"] = testbed.copied(args.checkpoint)
        rows = testbed.run_all(checkpoints, ranks, max(1, args.repeat))
    finally:
        testbed.close()
    write(argv, args, rows)
    print(table(rows))
    print(f"\nwrote {_os.path.join(args.out, 'weights.json')}")
    return 0


class WeightsTestbed(DataTestbed):
    """The checkpoints on the shared FS, a simfs mount per node, the cells."""

    def crafted(self, size, shards):
        """Write a checkpoint of *size* bytes in *shards* shards; return its name."""
        name = f"crafted-{size}"
        progress(f"writing {name} ({size / MB:.0f} MB in {shards} shards)")
        write_checkpoint(_os.path.join(self.source, name), size, shards)
        return name

    def copied(self, folder):
        """Copy the real checkpoint *folder* onto the shared FS; return its name."""
        import shutil

        name = _os.path.basename(_os.path.abspath(folder))
        shutil.copytree(folder, _os.path.join(self.source, name))
        return name

    def size(self, name):
        """The bytes of the checkpoint *name*."""
        top = _os.path.join(self.source, name)
        return sum(_os.path.getsize(_os.path.join(top, f)) for f in _os.listdir(top))

    def views(self, name):
        """The checkpoint *name* as each node sees it, through its own mount."""
        return [self.view(n, fs.mountpoint, name) for n, fs in enumerate(self.fs)]

    def reset(self):
        """Empty the nodes' client caches of every checkpoint, zero the counters."""
        for fs in self.fs:
            for top, _, files in _os.walk(fs.mountpoint):
                for name in files:
                    if not name.startswith(".simfs"):
                        drop(_os.path.join(top, name))
            fs.reset()

    def cells(self, checkpoints, ranks):
        """Every cell that fits this machine's memory, in the order they run."""
        from mpistage.data.steps import node_room

        room, _ = node_room()
        found = []
        for label, name in checkpoints.items():
            size = self.size(name)
            for n in ranks:
                for mode in MODES:
                    private = mode == "plain-read"
                    holds = n * size if private else self.nodes * size
                    share = PRIVATE_SHARE if private else MEMORY_SHARE
                    if room is not None and holds > share * room:
                        progress(f"skipped {mode} at {n} ranks: {holds} bytes")
                        continue
                    if mode == "plain-read" and not has_safetensors():
                        continue
                    found.append(dict(checkpoint=label, name=name, mode=mode, ranks=n))
        return found

    def run_all(self, checkpoints, ranks, repeat):
        """Run every cell *repeat* times, interleaved; return the medians."""
        from mpistage.bench.rows import medians

        cells, rows = self.cells(checkpoints, ranks), []
        for _ in range(repeat):
            for cell in cells:
                nodes = min(self.nodes, cell["ranks"])
                paths = self.views(cell["name"])[:nodes]
                rows.append(self.run_cell(dict(cell, paths=paths, nodes=nodes)))
        for label in checkpoints:
            sums = {r["checksum"] for r in rows if r["checkpoint"] == label}
            if len(sums) != 1:
                raise RuntimeError(f"cells saw different tensors of {label}: {sums}")
        return medians(rows, CELL, FIGURES)

    def run_cell(self, cell):
        """Launch one cell; return its measurements."""
        import subprocess
        import time

        cfg = dict(cell, result=self.result, page=PAGE)
        env = dict(_os.environ, MPISTAGE_EMULATE_NODES=str(cell["nodes"]))
        command = [self.mpiexec, "-n", str(cell["ranks"]), _sys.executable]
        self.reset()
        start = time.monotonic()
        done = subprocess.run(
            [*command, "-m", "mpi4py", "-c", DRIVER, _json.dumps(cfg)],
            env=env,
            capture_output=True,
            text=True,
            timeout=CELL_TIMEOUT,
        )
        if done.returncode:
            raise RuntimeError(f"cell {cell!r} failed:\n{done.stderr}")
        row = measure(self, cell)
        progress(
            f"{cell['checkpoint']:7} {cell['mode']:10} ranks={cell['ranks']:2} "
            f"nodes={cell['nodes']}: {row['seconds']:.2f} s load, "
            f"{time.monotonic() - start:.1f} s job"
        )
        return row


def has_safetensors():
    """Whether the ``safetensors`` package is there (for ``plain-read``)."""
    import importlib.util

    return importlib.util.find_spec("safetensors") is not None


def drop(path):
    """Drop the page cache of *path* on its mount (clean pages: nothing lost)."""
    from mpistage.bench.data import drop_cache

    try:
        drop_cache(path)
    except OSError:
        pass  # a file of the checkpoint's the mount no longer shows


def write_checkpoint(folder, size, shards):
    """Write a safetensors checkpoint of about *size* bytes: F32 tensors, an index."""
    import numpy

    _os.makedirs(folder)
    per_shard, weight_map = max(4, size // shards), {}
    for number in range(1, shards + 1):
        shard = f"model-{number:05d}-of-{shards:05d}.safetensors"
        names = write_shard(_os.path.join(folder, shard), per_shard, number, numpy)
        weight_map.update(dict.fromkeys(names, shard))
    index = {"metadata": {"total_size": per_shard * shards}, "weight_map": weight_map}
    with open(_os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        _json.dump(index, f)


def write_shard(path, size, number, numpy):
    """Write one shard of float32 tensors, :data:`TENSOR_BYTES` each at most."""
    rows = 1024
    tensors, left, offset = {}, size // 4 * 4, 0
    while left:
        nbytes = min(TENSOR_BYTES, left)
        count = nbytes // 4
        shape = [count // rows, rows] if count % rows == 0 else [count]
        name = f"layers.{number}.{len(tensors)}.weight"
        span = [offset, offset + nbytes]
        tensors[name] = {"dtype": "F32", "shape": shape, "data_offsets": span}
        offset, left = offset + nbytes, left - nbytes
    header = _json.dumps(tensors).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        for entry in tensors.values():
            lo, hi = entry["data_offsets"]
            start = (number << 24) + lo // 4
            f.write(numpy.arange(start, start + (hi - lo) // 4, dtype="<f4").tobytes())
    return list(tensors)


def measure(testbed, cell):
    """Turn one cell's driver output and simfs counters into a row."""
    with open(testbed.result) as f:
        ranks = _json.load(f)
    sums = {r["total"] for r in ranks}
    if len(sums) != 1:
        raise RuntimeError(f"ranks saw different tensors: {sorted(sums)}")
    stats = testbed.stats()
    keep = {k: v for k, v in cell.items() if k not in ("paths", "name")}
    return dict(
        keep,
        size=testbed.size(cell["name"]),
        seconds=max(r["seconds"] for r in ranks),
        stream_s=max(r["steps"].get("stream", 0.0) for r in ranks),
        checksum=sums.pop(),
        **fs_counts(stats, {r["pid"] for r in ranks}),
        **node_memory(ranks, cell["nodes"]),
    )


def table(rows):
    """Return *rows* as a markdown table."""
    lines = [
        "| checkpoint | MB | mode | ranks | nodes | load s | stream s "
        "| MB read from shared FS | shared-FS ops (metadata) | ranks on shared FS "
        "| MiB per node (Pss) | MiB per node for the tensors |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        stream = f"{r['stream_s']:.2f}" if r["mode"] == "mpistage" else "-"
        lines.append(
            f"| {r['checkpoint']} | {r['size'] / MB:.0f} | {r['mode']} "
            f"| {r['ranks']} | {r['nodes']} | {r['seconds']:.2f} | {stream} "
            f"| {r['fs_bytes'] / MB:.0f} | {r['fs_ops']:.0f} ({r['fs_meta_ops']:.0f}) "
            f"| {r['fs_processes']:.0f} | {r['node_pss_mib']:.0f} "
            f"| {r['node_array_mib']:.0f} |"
        )
    return "\n".join(lines)


def write(argv, args, rows):
    """Write weights.json below ``--out``."""
    _os.makedirs(args.out, exist_ok=True)
    meta = {
        "argv": list(argv),
        "nodes": args.nodes,
        "latency": args.latency,
        "bandwidth": args.bandwidth,
        "cpus": _os.cpu_count(),
    }
    with open(_os.path.join(args.out, "weights.json"), "w") as f:
        _json.dump({"meta": meta, "rows": rows}, f, indent=1)
