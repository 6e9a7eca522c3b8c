"""``mpistage bench data``: a large .npy on the shared FS, plain vs mpistage.data.

P ranks on N emulated nodes load one .npy file that lives on the simulated
shared file system (:mod:`mpistage.bench.simfs`):

- ``plain``: ``numpy.load`` on every rank, as a program does without help;
- ``mpistage``: :func:`mpistage.data.load`: *readers* ranks read, the node
  leaders exchange the parts, each node keeps one copy in shared memory.

Each cell is one ``mpiexec`` launch. It measures the bytes and operations
the shared FS served (simfs counters), the load's wall time (from a common
start to the slowest rank) and the memory per node: the sum of Pss
(``/proc/PID/smaps_rollup``) of the node's ranks once every rank holds the
array and has read all of it, which counts a page shared by k ranks 1/k
times in each. Python, numpy and mpistage stay local here: only the data
file is on the shared FS.

Each emulated node reads through a simfs mount of its own, so each node has
its own client page cache, as on Lustre or GPFS: ranks of one node that read
the same file at the same time may share the pages the node fetched, ranks
of different nodes never do.

A second table compares 1, 2 and 4 readers, with plain reads and with MPI-IO
collective reads, on a file of ``--size`` (or ``--big``) bytes.
"""

import json as _json
import os as _os
import sys as _sys

from mpistage.bench.testbed import Testbed, progress
from mpistage.bench.units import MB, MIB

MEMORY_SHARE = 0.8  # of a node's memory the largest cell may hold
CELL_TIMEOUT = 900  # seconds: a cell that takes longer is stuck
NPY_CHUNK = 64 * MIB  # bytes make_npy writes at a time
KIB_PER_MIB = 1024  # /proc counts Pss in KiB

DRIVER = r"""
import json, os, sys, time
from mpi4py import MPI
import numpy as np

cfg = json.loads(sys.argv[1])
comm = MPI.COMM_WORLD

def pss_kib():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("Pss:"))

def barrier():  # sleeps: waiting ranks leave the cores to the working ones
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.0005)

node = comm.rank * cfg["nodes"] // comm.size  # as MPISTAGE_EMULATE_NODES splits
# Every rank names the file alike (mpistage.data checks that the ranks agree):
# relative to its node's view, a local link into the node's own mount.
os.chdir(os.path.dirname(cfg["paths"][node]))
path = os.path.basename(cfg["paths"][node])
if cfg["mode"] == "mpistage":
    from mpistage import data
before = pss_kib()
barrier()
start = time.perf_counter()
if cfg["mode"] == "plain":
    array, steps = np.load(path), {}
else:
    shared = data.load(path, comm=comm, readers=cfg["readers"], io=cfg["io"])
    array, steps = shared, shared.seconds
seconds = time.perf_counter() - start
total = float(array.sum(dtype=np.float64))  # reads every page of the copy
barrier()
row = dict(rank=comm.rank, pid=os.getpid(), before=before, after=pss_kib(),
           seconds=seconds, total=total, steps=steps)
rows = comm.gather(row, root=0)
barrier()
if comm.rank == 0:
    with open(cfg["result"], "w") as f:
        json.dump(rows, f)
"""

COLUMNS = (
    "mode",
    "io",
    "readers",
    "ranks",
    "nodes",
    "seconds",
    "read_s",
    "broadcast_s",
    "fs_bytes",
    "fs_ops",
    "fs_meta_ops",
    "fs_processes",
    "node_pss_mib",
    "node_array_mib",
)
CELL = COLUMNS[:5]  # what names a cell
FIGURES = COLUMNS[5:]  # what a cell measures


def parser():
    """Return the argument parser of ``mpistage bench data``."""
    from mpistage.cli import argument_parser

    p = argument_parser(
        prog="mpistage bench data",
        description="Load a large .npy from the simulated shared file system "
        "on P ranks: numpy.load on every rank vs mpistage.data.load.",
    )
    p.add_argument("--size", default="256MiB", help=".npy size (default 256MiB)")
    p.add_argument("--ranks", default="1,4,16", help="rank counts (default 1,4,16)")
    p.add_argument("--nodes", type=int, default=4, help="emulated nodes (default 4)")
    p.add_argument(
        "--readers", default="1,2,4", help="readers to compare (default 1,2,4)"
    )
    p.add_argument("--io", default="posix,mpiio", help="read methods to compare")
    p.add_argument(
        "--big",
        metavar="SIZE",
        help="compare the readers on a file of SIZE (e.g. 3GiB) instead of --size",
    )
    p.add_argument("--latency", default="0.5ms", help="metadata latency of simfs")
    p.add_argument(
        "--bandwidth", default="none", help="simfs bandwidth, all clients together"
    )
    p.add_argument("--local", action="store_true", help="no simfs: a local file")
    p.add_argument("--repeat", type=int, default=1, help="runs per cell (median)")
    p.add_argument("-o", "--out", default="bench-data", help="output directory")
    return p


def cli_data(argv):
    """Run ``mpistage bench data``; print the tables, write data.json."""
    args = parser().parse_args(argv)
    plan = DataPlan(args)
    testbed = DataTestbed(args)
    try:
        compared = testbed.compare(plan)
        readers = testbed.readers(plan)
    finally:
        testbed.close()
    write(argv, args, plan, compared, readers)
    print(table(compared, "plain numpy.load vs mpistage.data.load"))
    print()
    print(table(readers, "mpistage.data.load: readers and read method"))
    print(f"\nwrote {_os.path.join(args.out, 'data.json')}")
    return 0


class DataPlan:
    """What to run, parsed and checked against this machine's memory."""

    def __init__(self, args):
        from mpistage.bench.units import parse_counts, parse_size

        self.size = int(parse_size(args.size, "--size"))
        self.big = int(parse_size(args.big, "--big")) if args.big else self.size
        self.ranks = parse_counts(args.ranks, "--ranks")
        self.readers = parse_counts(args.readers, "--readers")
        self.io = [m for m in args.io.split(",") if m]
        self.nodes, self.repeat = args.nodes, max(1, args.repeat)
        self.check()

    def check(self):
        """Refuse a plan whose copies cannot fit in this machine's memory."""
        from mpistage import StageError
        from mpistage.data.steps import IO_METHODS, node_room

        if set(self.io) - set(IO_METHODS) or not self.io:
            raise StageError(f"--io {','.join(self.io)!r}: use posix and/or mpiio")
        if self.nodes < 1:
            raise StageError(f"--nodes {self.nodes!r} must be 1 or more")
        room, what = node_room()
        need = max(max(self.ranks) * self.size, self.nodes * self.big)
        if room is not None and need > MEMORY_SHARE * room:
            raise StageError(
                f"the largest cell holds {need} bytes at once, more than "
                f"{MEMORY_SHARE:.0%} of "
                f"the {room} bytes of {what}: use a smaller --size or --big"
            )


class DataTestbed(Testbed):
    """The data files, a simfs mount per node, and the cells that load them."""

    def __init__(self, args):
        super().__init__("mpistage-bench-data-")
        self.result = _os.path.join(self.work, "result.json")
        self.nodes = args.nodes
        self.fs, self.files = [], {}
        for node in range(0 if args.local else args.nodes):
            where = _os.path.join(self.mount, f"node{node}")
            _os.makedirs(where)
            self.fs.append(mount(args, self.source, where))

    def paths(self, size):
        """Return the path of a .npy of *size* bytes as each node sees it."""
        name = f"array-{size}.npy"
        if size not in self.files:
            progress(f"writing {name} ({size / MIB:.0f} MiB)")
            make_npy(_os.path.join(self.source, name), size)
            self.files[size] = name
        if not self.fs:
            return [_os.path.join(self.source, name)] * self.nodes
        return [self.view(node, fs.mountpoint, name) for node, fs in enumerate(self.fs)]

    def view(self, node, mountpoint, name):
        """Return a local link to *name* through *node*'s own mount.

        Every rank then names the file alike (``name``, relative to its
        node's view, a local directory): changing into it costs the shared
        FS nothing, and only the readers open the file through the link.
        """
        folder = _os.path.join(self.work, f"view{node}")
        _os.makedirs(folder, exist_ok=True)
        link = _os.path.join(folder, name)
        if not _os.path.islink(link):
            _os.symlink(_os.path.join(mountpoint, name), link)
        return link

    def reset(self):
        """Empty the nodes' client caches, then zero the counters of every mount.

        Each cell starts with cold client caches (as a new job on other nodes
        would) and a warm server, which keeps the source file in its memory.
        """
        for fs in self.fs:
            for name in self.files.values():
                drop_cache(_os.path.join(fs.mountpoint, name))
            fs.reset()

    def stats(self):
        """Return the counters of all mounts, summed."""
        total = {"ops": {}, "per_pid": {}, "bytes": 0}
        for fs in self.fs:
            stats = fs.stats()
            total["bytes"] += stats.get("bytes", 0)
            total["per_pid"].update(stats.get("per_pid", {}))
            for op, n in stats.get("ops", {}).items():
                total["ops"][op] = total["ops"].get(op, 0) + n
        return total

    def compare(self, plan):
        """Plain and mpistage (1 reader, plain reads) at each rank count."""
        cells = [
            {"mode": mode, "io": "posix", "readers": 1, "ranks": n}
            for n in plan.ranks
            for mode in ("plain", "mpistage")
        ]
        return self.run_all(cells, plan, plan.size)

    def readers(self, plan):
        """mpistage with each readers count and read method, one rank per node."""
        cells = [
            {"mode": "mpistage", "io": io, "readers": k, "ranks": plan.nodes}
            for io in plan.io
            for k in plan.readers
            if k <= plan.nodes
        ]
        return self.run_all(cells, plan, plan.big)

    def run_all(self, cells, plan, size):
        """Run every cell *plan.repeat* times, interleaved; return the medians."""
        paths, rows = self.paths(size), []
        for _ in range(plan.repeat):
            for cell in cells:
                nodes = min(plan.nodes, cell["ranks"])
                cell = dict(cell, paths=paths[:nodes], nodes=nodes)
                rows.append(self.run_cell(cell, nodes, size))
        if len({row["checksum"] for row in rows}) != 1:
            raise RuntimeError(f"cells saw different arrays: {rows!r}")
        from mpistage.bench.rows import medians

        return medians(rows, CELL, FIGURES)

    def run_cell(self, cell, nodes, size):
        """Launch one cell; return its measurements."""
        import subprocess
        import time

        cfg = dict(cell, result=self.result)
        env = dict(_os.environ, MPISTAGE_EMULATE_NODES=str(nodes))
        # -m mpi4py: an exception on one rank aborts the job instead of hanging it
        ranks = str(cell["ranks"])
        command = [self.mpiexec, "-n", ranks, _sys.executable, "-m", "mpi4py"]
        self.reset()
        start = time.monotonic()
        done = subprocess.run(
            [*command, "-c", DRIVER, _json.dumps(cfg)],
            env=env,
            capture_output=True,
            text=True,
            timeout=CELL_TIMEOUT,
        )
        if done.returncode:
            raise RuntimeError(f"cell {cell!r} failed:\n{done.stderr}")
        row = measure(self, cell, nodes, size)
        progress(
            f"{cell['mode']:8} {cell['io']:5} readers={cell['readers']} "
            f"ranks={cell['ranks']:2} nodes={nodes}: {row['seconds']:.2f} s load, "
            f"{time.monotonic() - start:.1f} s job"
        )
        return row

    def close(self):
        """Unmount simfs and remove the files."""
        for fs in self.fs:
            fs.unmount()
        super().close()


def mount(args, source, mountpoint):
    """Mount simfs over *source*; return the :class:`SimFS`."""
    from mpistage import StageError
    from mpistage.bench.simfs import SimFS, fuse_available
    from mpistage.bench.units import parse_bandwidth, parse_time

    reason = fuse_available()
    if reason:
        raise StageError(f"{reason} (or use --local)")
    latency = parse_time(args.latency, "--latency")
    bandwidth = parse_bandwidth(args.bandwidth, "--bandwidth")
    return SimFS(source, mountpoint, latency=latency, bandwidth=bandwidth).mount()


def drop_cache(path):
    """Drop the page cache of the file at *path* (clean pages: no data lost)."""
    fd = _os.open(path, _os.O_RDONLY)
    try:
        _os.posix_fadvise(fd, 0, 0, _os.POSIX_FADV_DONTNEED)
    finally:
        _os.close(fd)


def make_npy(path, size):
    """Write a float64 .npy of about *size* bytes, :data:`NPY_CHUNK` at a time."""
    import numpy

    itemsize = numpy.dtype(numpy.float64).itemsize
    count = max(1, size // itemsize)
    array = numpy.lib.format.open_memmap(path, "w+", numpy.float64, (count,))
    step = NPY_CHUNK // itemsize
    for start in range(0, count, step):
        stop = min(count, start + step)
        array[start:stop] = numpy.arange(start, stop, dtype=numpy.float64)
    array.flush()
    del array


def measure(testbed, cell, nodes, size):
    """Turn one cell's driver output and simfs counters into a row."""
    with open(testbed.result) as f:
        ranks = _json.load(f)
    sums = {r["total"] for r in ranks}
    if len(sums) != 1:
        raise RuntimeError(f"ranks saw different arrays: {sorted(sums)}")
    stats = testbed.stats()
    cell = {k: v for k, v in cell.items() if k != "paths"}
    return dict(
        cell,
        nodes=nodes,
        size=size,
        seconds=max(r["seconds"] for r in ranks),
        read_s=max(r["steps"].get("read", 0.0) for r in ranks),
        broadcast_s=max(r["steps"].get("broadcast", 0.0) for r in ranks),
        checksum=sums.pop(),
        **fs_counts(stats, {r["pid"] for r in ranks}),
        **node_memory(ranks, nodes),
    )


def fs_counts(stats, pids):
    """Return the shared FS's bytes, ops, metadata ops and client ranks."""
    from mpistage.bench.simfs import meta_ops, read_ops

    per_pid = stats.get("per_pid", {})
    return {
        "fs_bytes": stats.get("bytes", 0),
        "fs_ops": meta_ops(stats) + read_ops(stats),
        "fs_meta_ops": meta_ops(stats),
        "fs_processes": sum(1 for pid in per_pid if int(pid) in pids),
    }


def node_memory(ranks, nodes):
    """Return the largest per-node sums of Pss, and of Pss gained by the load."""
    size = len(ranks)
    pss, gained = [0] * nodes, [0] * nodes
    for r in ranks:
        node = r["rank"] * nodes // size  # MPISTAGE_EMULATE_NODES: contiguous blocks
        pss[node] += r["after"]
        gained[node] += r["after"] - r["before"]
    return {
        "node_pss_mib": max(pss) / KIB_PER_MIB,
        "node_array_mib": max(gained) / KIB_PER_MIB,
    }


def table(rows, title):
    """Return *rows* as a markdown table."""
    lines = [
        f"**{title}**",
        "",
        "| mode | io | readers | ranks | nodes | load s | read s | broadcast s "
        "| MB read from shared FS | shared-FS ops (metadata) | ranks on shared FS "
        "| MiB per node (Pss) | MiB per node for the array |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        steps = (
            "| - | - "
            if r["mode"] == "plain"
            else (f"| {r['read_s']:.2f} | {r['broadcast_s']:.2f} ")
        )
        lines.append(
            f"| {r['mode']} | {r['io']} | {r['readers']} | {r['ranks']} "
            f"| {r['nodes']} | {r['seconds']:.2f} {steps}"
            f"| {r['fs_bytes'] / MB:.0f} "
            f"| {r['fs_ops']:.0f} ({r['fs_meta_ops']:.0f}) | {r['fs_processes']:.0f} "
            f"| {r['node_pss_mib']:.0f} | {r['node_array_mib']:.0f} |"
        )
    return "\n".join(lines)


def write(argv, args, plan, compared, readers):
    """Write data.json below ``--out``."""
    _os.makedirs(args.out, exist_ok=True)
    meta = {
        "argv": list(argv),
        "size": plan.size,
        "big": plan.big,
        "nodes": plan.nodes,
        "latency": None if args.local else args.latency,
        "bandwidth": None if args.local else args.bandwidth,
        "cpus": _os.cpu_count(),
    }
    with open(_os.path.join(args.out, "data.json"), "w") as f:
        _json.dump({"meta": meta, "compare": compared, "readers": readers}, f, indent=1)
