"""Side-by-side startup figures for plain python and the mpistage runner.

For ``import numpy, numpy.linalg`` at several rank counts (with emulated
nodes), it measures, interleaved in one run:

* wall time of the whole ``mpiexec`` launch (median of ``--repeat`` runs);
* file-system calls that touched the original site-packages: all ranks,
  rank 0, and the busiest other rank, counted with ``strace`` in separate
  runs (tracing slows a run down, so it is not timed).

Modes: ``plain`` python, the runner (``mpistage``, whose rank 0 also checks
the bundle for staleness), and the runner with ``--trust`` (no check).

Usage: ``python benchmarks/strace_startup.py [--ranks 1,4,16] [--nodes 4]``.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

CODE = "import numpy, numpy.linalg; numpy.linalg.inv(numpy.eye(3))"
# Calls that name a path, and directory reads (strace -y shows their paths).
TRACE = "trace=%file,getdents64"


def mpiexec():
    """Return the mpiexec next to this Python, or the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


def command(mode, ranks, bundle, trace_dir=None):
    """Return the launch command of *mode* at *ranks* ranks."""
    py = [sys.executable]
    if trace_dir:
        strace = f"exec strace -f -qq -y -e {TRACE} -o {trace_dir}/trace.$PMI_RANK"
        py = ["sh", "-c", strace + ' "$0" "$@"', sys.executable]
    if mode != "plain":
        py += ["-m", "mpistage", "--bundle", bundle]
    if mode == "mpistage --trust":
        py += ["--trust"]
    return [mpiexec(), "-n", str(ranks), *py, "-c", CODE]


def env(nodes, ranks):
    """Return the environment of a run (staging in the default, /dev/shm)."""
    return dict(os.environ, MPISTAGE_EMULATE_NODES=str(min(nodes, ranks)))


def timed(cmd, environ):
    """Run *cmd*; return its wall time in seconds."""
    start = time.perf_counter()
    subprocess.run(cmd, env=environ, check=True, timeout=600)
    return time.perf_counter() - start


def site_ops(trace_dir, site):
    """Return calls whose lines mention *site*: all, rank 0, busiest other."""
    counts = {}
    for trace in Path(trace_dir).glob("trace.*"):
        lines = trace.read_text(errors="replace").splitlines()
        counts[int(trace.suffix[1:])] = sum(site in line for line in lines)
    others = [n for rank, n in counts.items() if rank != 0]
    return sum(counts.values()), counts[0], max(others, default=0)


def traced(mode, ranks, bundle, environ, site):
    """Run *mode* under strace; return its site-packages call counts."""
    with tempfile.TemporaryDirectory() as trace_dir:
        cmd = command(mode, ranks, bundle, trace_dir)
        subprocess.run(cmd, env=environ, check=True, timeout=600)
        return site_ops(trace_dir, site)


def main():
    """Run the comparison and print a markdown table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="1,4,16")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    site = sysconfig.get_paths()["purelib"]
    work = tempfile.mkdtemp(prefix="mpistage-bench-")
    bundle = os.path.join(work, "numpy.mpistage")
    subprocess.run(
        [sys.executable, "-m", "mpistage", "pack", "-o", bundle, "numpy"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    print(
        f"| ranks | nodes | mode | wall s (median of {args.repeat}) "
        "| site-packages calls: all ranks | rank 0 | busiest other rank |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|")
    for ranks in [int(r) for r in args.ranks.split(",")]:
        environ = env(args.nodes, ranks)
        walls = {m: [] for m in ("plain", "mpistage", "mpistage --trust")}
        for _ in range(args.repeat):
            for mode in walls:
                walls[mode].append(timed(command(mode, ranks, bundle), environ))
        for mode in walls:
            total, first, other = traced(mode, ranks, bundle, environ, site)
            nodes = min(args.nodes, ranks)
            print(
                f"| {ranks} | {nodes} | {mode} | "
                f"{statistics.median(walls[mode]):.2f} | {total} | {first} "
                f"| {other if ranks > 1 else '-'} |",
                flush=True,
            )
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
