"""Live imports never hang: many runs of a scipy program under CPU load.

Usage::

    .venv/bin/python benchmarks/live_soak.py [--runs 200] [--ranks 4,8]
        [--nodes 2] [--load 2] [--timeout 120] [-o bench-out/soak]

Each run is ``mpiexec -n RANKS mpistage app.py`` with no bundle (live
imports) on NODES emulated nodes, while LOAD busy processes take the CPU.
The program is what a new user wrote: ``import scipy.linalg,
scipy.sparse``, a solve, and a closing ``allreduce`` (mpi4py's first
lowercase reduction on a communicator, which the ranks that finish first
sit in while others still import). A run that outlives TIMEOUT seconds is a hang. It
prints, per rank count, the runs, failures, hangs, the median and maximum
time, and the runs in which some request went unanswered in time (the
ranks then imported from the originals, as ``MPISTAGE_LIVE_WAIT`` says);
the rows go to ``OUT/soak.json`` too.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VENV = Path(sys.executable).parent
APP = """\
from mpi4py import MPI
import scipy.linalg, scipy.sparse
import numpy as np
world = MPI.COMM_WORLD
a = np.eye(3) * (world.rank + 1)
x = scipy.linalg.solve(a, np.ones(3))
total = scipy.sparse.identity(3).sum() + x.sum()
print(world.allreduce(int(total > 0)), flush=True)
"""


def parse():
    """Return the command line's options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--ranks", default="4,8")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--load", type=int, default=2, help="busy processes")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("-o", "--out", default="bench-out/soak")
    return parser.parse_args()


def busy(count):
    """Start *count* processes that spin until killed."""
    spin = "while True: pass"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]


def one_run(folder, ranks, nodes, timeout):
    """Run the program once; return (outcome, seconds, late requests)."""
    report = folder / "report.json"
    report.unlink(missing_ok=True)
    env = dict(os.environ, MPISTAGE_EMULATE_NODES=str(nodes))
    env["MPISTAGE_REPORT"] = str(report)
    args = [VENV / "mpiexec", "-n", str(ranks), VENV / "mpistage", folder / "app.py"]
    start = time.monotonic()
    proc = subprocess.Popen(
        args, env=env, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        return "hang", time.monotonic() - start, 0
    seconds = time.monotonic() - start
    said = "".join(out.decode().split())  # the ranks' lines may interleave
    ok = proc.returncode == 0 and said == str(ranks) * ranks
    late = 0
    if report.exists():
        late = (json.loads(report.read_text()).get("live") or {}).get("late", 0)
    return ("ok" if ok else "failed"), seconds, late


def campaign(folder, ranks, options):
    """Run the program *options.runs* times at *ranks*; return the summary row."""
    outcomes, times, late_runs = {"ok": 0, "failed": 0, "hang": 0}, [], 0
    for index in range(options.runs):
        outcome, seconds, late = one_run(folder, ranks, options.nodes, options.timeout)
        outcomes[outcome] += 1
        times.append(seconds)
        late_runs += bool(late)
        if outcome != "ok":
            print(f"  run {index}: {outcome} after {seconds:.1f} s", flush=True)
    return {
        "ranks": ranks,
        "nodes": options.nodes,
        "load": options.load,
        "runs": options.runs,
        **outcomes,
        "median_s": round(statistics.median(times), 2),
        "max_s": round(max(times), 2),
        "runs_with_late_requests": late_runs,
    }


def main():
    """Run the campaigns; print and save the summary."""
    options = parse()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpistage-soak-") as tmp:
        folder = Path(tmp)
        (folder / "app.py").write_text(APP)
        load = busy(options.load)
        try:
            for ranks in (int(r) for r in options.ranks.split(",")):
                rows.append(campaign(folder, ranks, options))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            for proc in load:
                proc.kill()
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(rows, indent=1))
    print("| ranks | nodes | runs | ok | failed | hangs | median s | max s | late |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['ranks']} | {r['nodes']} | {r['runs']} | {r['ok']} | {r['failed']} "
            f"| {r['hang']} | {r['median_s']} | {r['max_s']} "
            f"| {r['runs_with_late_requests']} |"
        )
    return 1 if any(r["hang"] or r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
