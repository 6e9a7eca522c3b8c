"""Per-node cost of ``mpistage run`` under real Slurm, on the simulated shared FS.

Usage (root, with the test cluster up: ``scripts/slurm-cluster up``)::

    .venv/bin/python benchmarks/slurm_run.py [--latency 0.5ms] [--repeat 3]

It lays out ``mpistage bench``'s realistic layout (interpreter, stdlib and a
venv with mpi4py, the MPICH wheel, numpy and mpistage, all on the FUSE
simfs; docs/bench.md) below the cluster's shared directory, which every
slurmd's mount namespace sees, and packs that venv with ``pack --env``.
Then, in ``salloc -N 2``, it takes the launches that ``mpistage run --env
BUNDLE -- srun -n 4 MOUNT/venv/bin/python -c CODE`` makes and runs them one
at a time, counting shared-FS metadata operations per process (simfs counts
per pid; the stage and clean steps have one process per node, ``sbcast``
one per job, on this host):

- ``F``: ``from mpi4py import MPI`` on each node, the floor any MPI program pays;
- ``stage``: the stage step as ``mpistage run`` makes it in an allocation:
  a private directory on each node, ``sbcast`` of the bundle and of the
  extractor, the extractor run by the node's own python
  (mpistage.cli.slurmstage);
- ``stage, python per node``: the stage step as it is without ``sbcast``,
  ``mpistage stage`` started from the shared environment on each node (its
  rank 0's node also reads the bundle);
- ``run``: the run step, every rank from its node's staged interpreter;
- ``clean``: the clean step (``/bin/sh`` and ``rm`` of the node);

and then ``mpistage run`` itself, end to end, started from the shared
environment as a user would. Steps are interleaved across repeats; the
table gives medians.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from mpistage.settings import get

STATE = get("MPISTAGE_SLURM_STATE")
CODE = "import numpy, numpy.linalg; from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"
FLOOR = "from mpi4py import MPI"


def main():
    """Parse the options; run inside an allocation, making one if needed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--latency", default="0.5ms", help="per metadata operation")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--ranks", type=int, default=4)
    args = p.parse_args()
    os.environ.setdefault("SLURM_CONF", f"{STATE}/slurm.conf")
    if not os.environ.get("SLURM_JOB_ID"):
        salloc = ["salloc", "-N", "2", "--quiet", sys.executable, *sys.argv]
        sys.exit(subprocess.call(salloc))
    measure(args)


def measure(args):
    """Lay out, pack, then count each step; print the table."""
    from mpistage.bench.envs import env_bundle
    from mpistage.bench.sweep import StartupTestbed
    from mpistage.bench.units import parse_time
    from mpistage.bench.workloads import make

    tempfile.tempdir = os.path.join(STATE, "shared")  # seen by every node
    latency = parse_time(args.latency, "--latency")
    bench = StartupTestbed(make("numpy"), "realistic", "site", latency, False)
    try:
        progress("laying out the realistic layout on the shared FS")
        bench.layout.build(bench.workload)
        bench.fs.latency, latency = 0.0, bench.fs.latency
        bench.fs.mount()
        progress("packing the venv (pack --env), untimed")
        bundle = env_bundle(bench)
        bench.fs.unmount()
        bench.fs.latency = latency
        bench.fs.mount()
        rows = count_steps(bench, bundle, args)
    finally:
        bench.close()
    report(rows, args)


def count_steps(bench, bundle, args):
    """Run every step *repeat* times, interleaved; return the rows."""
    from mpistage.cli.run import Plan, parser

    python = bench.layout.python
    line = ["srun", "-n", str(args.ranks), python, "-c", CODE]
    plan = Plan(parser().parse_args(["--env", bundle, "--", *line]))
    env = plan.run_environ()
    nodes = os.environ["SLURM_NNODES"]
    per_node = ["srun", "-N", nodes, "-n", nodes, "--ntasks-per-node=1"]
    scratch = tempfile.mkdtemp(prefix="mpistage-slurm-run-")
    steps = {
        "F": [[*per_node, python, "-c", FLOOR]],
        "stage": plan.stage_commands(scratch),
        "run": [plan.run_command(env)],
        "clean": [plan.clean_command()],
        "stage, python per node": [plan.stage_command()],
        "clean again": [plan.clean_command()],
    }
    envs = {"run": env}
    whole = [python, bench.layout.command, "run", "--env", bundle, "--", *line]
    rows = []
    for rep in range(args.repeat):
        for name, commands in steps.items():
            rows.append(step(bench, name, commands, envs.get(name), rep))
        rows.append(step(bench, "mpistage run", [whole], None, rep, driver=True))
    return rows


def step(bench, name, commands, env, rep, driver=False):
    """Run the launches of one step with fresh counts; return its row.

    What this host's processes did (``sbcast``, ``mpistage run`` itself)
    is once per job; the rest is the nodes'.
    """
    from mpistage.bench.simfs import meta_ops, read_ops

    bench.fs.reset()
    start = time.perf_counter()
    own = set()
    for command in commands:
        proc = subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, cwd="/", start_new_session=True
        )
        status = proc.wait(timeout=600)
        if status:
            raise SystemExit(f"{name} failed with status {status}: {command!r}")
        if driver or os.path.basename(command[0]) == "sbcast":
            own.add(str(proc.pid))
    seconds = time.perf_counter() - start
    stats = bench.fs.stats()
    per_pid = stats.get("per_pid", {})
    job = sum(meta_ops(per_pid.pop(pid, {})) for pid in own)
    ops = sorted((meta_ops(c) for c in per_pid.values()), reverse=True)
    readers = [p for p, c in per_pid.items() if read_ops(c)]
    row = {
        "step": name,
        "repeat": rep,
        "seconds": seconds,
        "processes": len(per_pid),
        "ops_max": ops[0] if ops else 0,
        "ops_min": ops[-1] if ops else 0,
        "ops_total": meta_ops(stats) - job,
        "driver_ops": job,
        "reads": read_ops(stats),
        "readers": len(readers),
    }
    progress(f"{rep} {name:24} {seconds:6.2f} s  {row}")
    return row


def report(rows, args):
    """Print the medians per step as a markdown table."""
    print(f"\nlatency {args.latency}, {args.ranks} ranks on 2 nodes, ", end="")
    print(f"medians of {args.repeat}")
    print(
        "| step | wall s | processes on the shared FS | ops, busiest process | "
        "ops, least busy | ops, all | ops once per job (this host) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in dict.fromkeys(r["step"] for r in rows):
        mine = [r for r in rows if r["step"] == name]

        def med(key, mine=mine):
            return statistics.median(r[key] for r in mine)

        print(
            f"| {name} | {med('seconds'):.2f} | {med('processes'):.0f} | "
            f"{med('ops_max'):.0f} | {med('ops_min'):.0f} | {med('ops_total'):.0f} | "
            f"{med('driver_ops'):.0f} |"
        )


def progress(line):
    """One progress line on stderr."""
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
