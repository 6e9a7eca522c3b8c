"""``mpistage bench run``: start-up of each mode, side by side, in one sweep.

For every workload, rank count and mode (interleaved, repeated), it launches
``mpiexec`` with the files on the simulated shared file system, laid out as
:mod:`mpistage.bench.layout` says, and measures:

- ``total_s``: from launch until all ranks have imported the workload (rank 0
  takes the time after a barrier that follows every rank's imports); for
  ``staged-env`` the stage step is included;
- ``start_s``: from launch until the slowest rank began the workload's code;
- ``import_s``: the slowest rank's own import time;
- ``stage_s``: the runner's read + validate + broadcast + stage + activate,
  or the stage step's wall time (``auto-first``: from all ranks imported
  to the job's end, the bundle saved);
- ``end_s``: from all ranks imported to the job's end (``mpiexec``
  returned): the program's rest, reports, copies removed, MPI finalized;
  ``total_s + end_s`` is the whole job;
- shared-FS metadata operations (all but data reads): in total, of rank 0,
  the median and the largest of the other ranks, the largest of the ranks
  (other than 0) that imported mpi4py for their node (the node boot, from
  the runner's report), and the largest per node of a stage step (for
  ``env-launch``: the processes that are no rank, per node); data
  reads and bytes read.
"""

import json as _json
import os as _os
import statistics as _statistics

from mpistage.bench.simfs import meta_ops, read_ops
from mpistage.bench.testbed import Testbed, local_base, progress

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
    with open({result!r}, "w") as f:
        json.dump({{"ranks": rows, "t_all": time.time()}}, f)
"""

COLUMNS = (
    "workload",
    "layout",
    "via",
    "mode",
    "ranks",
    "nodes",
    "repeat",
    "total_s",
    "start_s",
    "import_s",
    "stage_s",
    "end_s",
    "meta_ops",
    "ops_rank0",
    "ops_rank_median",
    "ops_rank_max",
    "ops_first",
    "ops_stage_node",
    "read_ops",
    "bytes_read",
    "bundle_bytes",
)
FIGURES = COLUMNS[7:]


class StartupTestbed(Testbed):
    """The testbed one workload's sweep shares between its cells: the layout
    on the simulated shared FS, node-local storage, the driver's result files."""

    def __init__(self, workload, layout, via, latency, cache):
        import tempfile

        from mpistage.bench.layout import LAYOUTS
        from mpistage.bench.simfs import SimFS

        super().__init__("mpistage-bench-")
        self.workload, self.nodes, self.extra_env = workload, 1, {}
        self.local_dir = tempfile.mkdtemp(
            prefix="mpistage-bench-local-", dir=local_base()
        )
        self.source_site = _os.path.join(self.source, "site")
        self.shared_site = _os.path.join(self.mount, "site")
        self.result_path = _os.path.join(self.work, "result.json")
        self.report_path = _os.path.join(self.work, "report.json")
        _os.makedirs(self.source_site)
        self.layout = LAYOUTS[layout](self, via)
        self.fs = SimFS(self.source, self.mount, latency=latency, cache=cache)

    def run_cell(self, mode, ranks, nodes):
        """Launch one cell (modes use it to learn untimed)."""
        return run_cell(self, mode, ranks, nodes)

    def close(self):
        """Unmount and remove the temporary trees."""
        import shutil

        self.fs.unmount()
        super().close()
        shutil.rmtree(self.local_dir, ignore_errors=True)


def run_cell(testbed, mode, ranks, nodes):
    """Launch one cell and return its measurements."""
    for path in (testbed.result_path, testbed.report_path):
        if _os.path.exists(path):
            _os.unlink(path)
    site = mode.driver_site(testbed)
    path_line = f"sys.path.insert(0, {site!r})" if site else ""
    code = "" if mode.empty else testbed.workload.code
    driver = DRIVER.format(code=code, path_line=path_line, result=testbed.result_path)
    start, stats, extra = mode.launch(testbed, ranks, nodes, driver)
    row = measure(testbed, start, stats, extra, nodes)
    mode.after(testbed)
    return row


def measure(testbed, start, stats, extra, nodes):
    """Turn one cell's driver result and shared-FS stats into a row."""
    with open(testbed.result_path) as f:
        result = _json.load(f)
    ranks = sorted(result["ranks"])  # (rank, pid, t_ready, t_done), as DRIVER sends
    ops = per_rank_ops(stats, ranks)
    others = ops[1:] or ops
    stage = stats.get("stage", {})
    return {
        "total_s": result["t_all"] - start,
        "start_s": max(ready for _, _, ready, _ in ranks) - start,
        "import_s": max(done - ready for _, _, ready, done in ranks),
        "stage_s": extra.get("stage_s", 0.0),
        "end_s": extra.get("ended", result["t_all"]) - result["t_all"],
        "meta_ops": meta_ops(stats) + meta_ops(stage),
        "ops_rank0": ops[0],
        "ops_rank_median": _statistics.median(others),
        "ops_rank_max": max(others),
        "ops_first": max((ops[r] for r in first_ranks(testbed) if r), default=0),
        "ops_stage_node": extra.get("ops_node")
        or max(map(meta_ops, stage.get("per_pid", {}).values()), default=0),
        "read_ops": read_ops(stats) + read_ops(stage),
        "bytes_read": stats.get("bytes", 0) + stage.get("bytes", 0),
        "bundle_bytes": extra.get("bundle_bytes") or bundle_bytes(testbed),
    }


def per_rank_ops(stats, ranks):
    """Return the metadata operations of each rank, in rank order."""
    per_pid = stats.get("per_pid", {})
    return [meta_ops(per_pid.get(str(pid), {})) for _, pid, _, _ in ranks]


def first_ranks(testbed):
    """Return the ranks that imported mpi4py for their node (the runner's report)."""
    if not _os.path.exists(testbed.report_path):
        return []
    with open(testbed.report_path) as f:
        start = _json.load(f).get("start") or {}
    return start.get("first", [])


def bundle_bytes(testbed):
    """Return the size of the bundle the runner staged in the last cell, if any."""
    if not _os.path.exists(testbed.report_path):
        return 0
    with open(testbed.report_path) as f:
        return _json.load(f).get("bundle_bytes", 0)


def schedule(ranks_list, nodes, modes, repeat):
    """Yield (repeat, ranks, nodes, mode) in interleaved order."""
    for rep in range(repeat):
        for ranks in ranks_list:
            order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
            for mode in order:
                yield rep, ranks, min(nodes, ranks), mode


def run_workload(
    workload,
    *,
    layout,
    via,
    ranks,
    nodes,
    modes,
    repeat,
    latency,
    cache,
    extra_env=None,
):
    """Run every cell of one workload; return the rows."""
    from mpistage.bench.modes import MODES

    testbed = StartupTestbed(workload, layout, via, latency, cache)
    testbed.extra_env = extra_env or {}
    rows = []
    try:
        progress(f"[{workload.name}] laying out the {layout} layout on the shared FS")
        testbed.layout.build(workload)
        chosen = [MODES[layout][m]() for m in modes]
        prepare(testbed, chosen, workload.name)
        plan = list(schedule(ranks, nodes, chosen, repeat))
        for i, (rep, n, k, mode) in enumerate(plan, 1):
            row = run_cell(testbed, mode, n, k)
            row.update(
                workload=workload.name,
                layout=layout,
                via=via,
                mode=mode.name,
                ranks=n,
                nodes=k,
                repeat=rep,
            )
            rows.append(row)
            progress(
                f"[{workload.name}] {i}/{len(plan)} {mode.name:14} {n:3} ranks "
                f"{k} nodes: {row['total_s']:.2f} s, ops rank 0 {row['ops_rank0']}, "
                f"others {row['ops_rank_median']:.0f} (max {row['ops_rank_max']})"
            )
    finally:
        testbed.close()
    return rows


def prepare(testbed, modes, name):
    """Prepare every mode on a mount without latency, then remount with it.

    Packing reads thousands of files through the mount; the latency would
    only make that slow, and none of it is measured.
    """
    latency, testbed.fs.latency = testbed.fs.latency, 0.0
    testbed.fs.mount()
    for mode in modes:
        progress(f"[{name}] preparing {mode.name}")
        mode.prepare(testbed)
    testbed.fs.unmount()
    testbed.fs.latency = latency
    testbed.fs.mount()
