"""The bundle's broadcast against a plain mpi4py ``Bcast`` of the same bytes.

Usage::

    .venv/bin/python -m mpistage.bench.campaigns.bcast [--sizes 1G,2.5G]
        [--repeats 3] [--nodes 2] [--mpiexec .venv/bin/mpiexec]

One ``mpiexec -n NODES`` run on NODES emulated nodes (one rank each, so
every rank is a node leader). For each size, rank 0 holds that many
bytes, and each repeat times, one after the other, between barriers:

- ``mpistage``: :func:`mpistage.runtime.broadcast.broadcast`, the path
  a bundle takes to the leaders (its size first, an agreement, then the
  pieces of :func:`mpistage.runtime.bulk.step` bytes);
- ``plain``: ``comm.Bcast`` of the same buffer in the same pieces.

Both receive into one buffer allocated and touched beforehand, so the
figures are the transfers' alone. It prints, per size, the median seconds
of each, the throughput and the ratio ``plain / mpistage`` of the times
(1.0: as fast as the MPI's own ``Bcast``).
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

VENV = Path(sys.executable).parent


def parse(argv=None):
    """Return the command line's options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1G,2.5G", help="bytes, K/M/G suffixes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2, help="ranks, one per node")
    parser.add_argument("--mpiexec", default=str(VENV / "mpiexec"))
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def size_of(text):
    """Return the bytes that *text* (``1G``, ``2.5G``, ``512M``) names."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    unit = text[-1:].upper()
    if unit in scale:
        return int(float(text[:-1]) * scale[unit])
    return int(text)


def plain(comm, view):
    """``Bcast`` *view* from rank 0 in the pieces mpistage uses."""
    from mpi4py import MPI

    from mpistage.runtime import bulk

    step = bulk.step()
    for start in range(0, len(view), step):
        comm.Bcast([view[start : start + step], MPI.BYTE], root=0)


def staged(comm, buf, into):
    """The bundle's path: :func:`~mpistage.runtime.broadcast.broadcast`."""
    from mpistage.runtime.broadcast import broadcast

    broadcast(comm, buf, allocate=lambda size: into)


def timed(comm, step):
    """Seconds *step* took on the slowest rank, between barriers."""
    comm.Barrier()
    start = time.perf_counter()
    step()
    comm.Barrier()
    return comm.allreduce(time.perf_counter() - start, op=max_op())


def max_op():
    """MPI's maximum, imported late."""
    from mpi4py import MPI

    return MPI.MAX


def measure(topo, size, repeats):
    """Return (mpistage seconds, plain seconds) medians for *size* bytes."""
    leaders = topo.leaders
    buf = bytearray(os.urandom(1 << 20)) * (size >> 20) + bytearray(size % (1 << 20))
    if leaders.rank != 0:
        buf[:] = bytes(len(buf))  # touched, not the sender's bytes
    into, view = buf, memoryview(buf)
    ours, theirs = [], []
    for _ in range(repeats):
        ours.append(timed(leaders, lambda: staged(leaders, buf, into)))
        theirs.append(timed(leaders, lambda: plain(leaders, view)))
    view.release()
    return statistics.median(ours), statistics.median(theirs)


def inside(options):
    """In every rank: measure each size; rank 0 prints a row per size."""
    from mpi4py import MPI

    from mpistage.runtime import bulk
    from mpistage.runtime.topology import discover

    topo = discover(MPI.COMM_WORLD)
    if not topo.is_leader:
        raise SystemExit("one rank per node, please: --nodes sets both")
    if topo.world.rank == 0:
        print(f"{MPI.Get_library_version().splitlines()[0]}")
        print(f"{topo.leaders.size} leaders, pieces of {bulk.step() >> 20} MiB")
        print(f"{'bytes':>12} {'mpistage s':>10} {'plain s':>9} {'GB/s':>11} ratio")
    for text in options.sizes.split(","):
        size = size_of(text)
        ours, theirs = measure(topo, size, options.repeats)
        if topo.world.rank == 0:
            rates = f"{size / ours / 1e9:5.2f}/{size / theirs / 1e9:5.2f}"
            times = f"{ours:>10.3f} {theirs:>9.3f}"
            print(f"{size:>12} {times} {rates} {theirs / ours:.2f}")


def main(argv=None):
    """Launch the measurement under ``mpiexec``, or be it (``--inside``)."""
    options = parse(argv)
    if options.inside:
        return inside(options)
    env = dict(os.environ, MPISTAGE_EMULATE_NODES=str(options.nodes))
    here = ["-m", "mpistage.bench.campaigns.bcast", "--inside"]
    rest = ["--sizes", options.sizes, "--repeats", str(options.repeats)]
    args = [options.mpiexec, "-n", str(options.nodes), sys.executable, *here, *rest]
    return subprocess.run(args, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
