"""``mpistage bench run``: startup of each mode, side by side, in one run.

For every workload, rank count and mode (interleaved, repeated), it launches
``mpiexec`` with the workload on the simulated shared file system and
measures:

- ``total_s``: from launch until all ranks have imported the workload (rank 0
  takes the time after a barrier that follows every rank's imports);
- ``start_s``: from launch until the slowest rank began the workload's code,
  i.e. ``mpiexec`` plus interpreter start (plus staging, for ``mpistage``);
- ``import_s``: the slowest rank's own import time;
- ``stage_s``: the runner's read + broadcast + stage + activate (``mpistage``);
- shared-FS metadata operations (all but data reads) in total and for the
  busiest rank, data reads and bytes read.

The driver puts the workload's root on ``sys.path`` itself, as applications
that ship their packages do, so interpreter start-up does not search it.
"""

import json as _json
import os as _os
import subprocess as _subprocess
import sys as _sys
import time as _time

DRIVER = """\
import os, sys, time
t_ready = time.time()
{path_line}
{code}
t_done = time.time()
from mpi4py import MPI
world = MPI.COMM_WORLD
rows = world.gather((world.rank, os.getpid(), t_ready, t_done), root=0)
world.Barrier()
if world.rank == 0:
    import json
    with open(os.environ["MPISTAGE_BENCH_RESULT"], "w") as f:
        json.dump({{"ranks": rows, "t_all": time.time()}}, f)
"""

COLUMNS = (
    "workload",
    "mode",
    "ranks",
    "nodes",
    "repeat",
    "total_s",
    "start_s",
    "import_s",
    "stage_s",
    "meta_ops",
    "meta_ops_rank_max",
    "meta_ops_rank_mean",
    "read_ops",
    "bytes_read",
)


class Bench:
    """The places and tools one benchmark run shares between its cells."""

    def __init__(self, out, workload, latency, cache):
        import shutil
        import tempfile

        from mpistage.bench.simfs import SimFS

        self.out, self.workload = out, workload
        self.work = tempfile.mkdtemp(prefix="mpistage-bench-")
        self.local_dir = tempfile.mkdtemp(
            prefix="mpistage-bench-local-", dir=local_base()
        )
        self.source = _os.path.join(self.work, "shared")
        self.source_site = _os.path.join(self.source, "site")
        self.mount = _os.path.join(self.work, "mnt")
        self.shared_site = _os.path.join(self.mount, "site")
        self.result_path = _os.path.join(self.work, "result.json")
        self.report_path = _os.path.join(self.work, "report.json")
        mpiexec = _os.path.join(_os.path.dirname(_sys.executable), "mpiexec")
        self.mpiexec = mpiexec if _os.path.exists(mpiexec) else shutil.which("mpiexec")
        _os.makedirs(self.source_site)
        _os.makedirs(self.mount)
        self.fs = SimFS(self.source, self.mount, latency=latency, cache=cache)

    def run_cell(self, mode, ranks, nodes):
        """Launch one cell (modes use it to learn untimed)."""
        return run_cell(self, mode, ranks, nodes)

    def close(self):
        """Unmount and remove the temporary trees."""
        import shutil

        self.fs.unmount()
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.local_dir, ignore_errors=True)


def local_base():
    """Return node-local RAM disk when present, else the temp directory."""
    return "/dev/shm" if _os.path.isdir("/dev/shm") else None


def run_cell(bench, mode, ranks, nodes):
    """Launch one cell and return its measurements."""
    for path in (bench.result_path, bench.report_path):
        if _os.path.exists(path):
            _os.unlink(path)
    env = dict(
        _os.environ,
        MPISTAGE_BENCH_RESULT=bench.result_path,
        PYTHONDONTWRITEBYTECODE="1",
        **mode.env(bench, nodes),
    )
    site = mode.site(bench)
    path_line = f"sys.path.insert(0, {site!r})" if site else ""
    code = DRIVER.format(code=bench.workload.code, path_line=path_line)
    bench.fs.reset()
    start = _time.time()
    done = _subprocess.run(
        mode.command(bench, ranks, code),
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode:
        raise RuntimeError(f"{mode.name} at {ranks} ranks failed:\n{done.stderr}")
    row = measure(bench, mode, start, bench.fs.stats())
    mode.after(bench)
    return row


def measure(bench, mode, start, stats):
    """Turn one cell's driver result, runner report and FS stats into a row."""
    with open(bench.result_path) as f:
        result = _json.load(f)
    ranks = result["ranks"]
    per_pid = stats.get("per_pid", {})
    rank_ops = [meta_ops(per_pid.get(str(pid), {})) for _, pid, _, _ in ranks]
    return {
        "total_s": result["t_all"] - start,
        "start_s": max(r[2] for r in ranks) - start,
        "import_s": max(r[3] - r[2] for r in ranks),
        "stage_s": mode.stage_seconds(bench),
        "meta_ops": meta_ops(stats),
        "meta_ops_rank_max": max(rank_ops),
        "meta_ops_rank_mean": sum(rank_ops) / len(rank_ops),
        "read_ops": stats.get("ops", {}).get("read", 0),
        "bytes_read": stats.get("bytes", 0),
    }


def meta_ops(counts):
    """Return the metadata operations (all but data reads) in *counts*."""
    ops = counts.get("ops", {})
    return sum(ops.values()) - ops.get("read", 0)


def cells(ranks_list, nodes, modes, repeat):
    """Yield (repeat, ranks, nodes, mode) in interleaved order."""
    for rep in range(repeat):
        for ranks in ranks_list:
            order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
            for mode in order:
                yield rep, ranks, min(nodes, ranks), mode


def run_workload(workload, *, ranks, nodes, modes, repeat, latency, cache, out):
    """Run every cell of one workload; return the rows."""
    from mpistage.bench.modes import MODES

    bench = Bench(out, workload, latency, cache)
    rows = []
    try:
        progress(f"[{workload.name}] building the workload on the shared FS")
        workload.build(bench.source_site)
        bench.fs.mount()
        chosen = [MODES[m]() for m in modes]
        for mode in chosen:
            mode.prepare(bench)
        plan = list(cells(ranks, nodes, chosen, repeat))
        for i, (rep, n, k, mode) in enumerate(plan, 1):
            row = run_cell(bench, mode, n, k)
            row.update(
                workload=workload.name, mode=mode.name, ranks=n, nodes=k, repeat=rep
            )
            rows.append(row)
            progress(
                f"[{workload.name}] {i}/{len(plan)} {mode.name:9} {n:3} ranks "
                f"{k} nodes: {row['total_s']:.2f} s, {row['meta_ops']} metadata ops"
            )
    finally:
        bench.close()
    return rows


def progress(line):
    """Print one progress line to stderr."""
    print(line, file=_sys.stderr, flush=True)
