"""``mpistage bench model``: what start-up costs at 1k-128k ranks.

A small analytic model. It turns counts one measures at one or a few ranks
(shared-FS metadata operations and bytes per rank, per node and per job, the
bundle's size, the local CPU time of start-up) into the seconds each step
takes at P ranks on N nodes. The modes differ only in those counts:

- ``plain``: every rank imports everything from the shared file system;
- ``mpistage``: the runner; every rank still starts its interpreter and
  mpi4py from the shared FS (F operations), rank 0 also reads the bundle and
  checks it for staleness, the leaders get it by broadcast and write one copy
  per node, then every rank imports locally;
- ``mpistage-trust``: the runner without the staleness check;
- ``staged-env``: a stage step (one process per node) copies the whole
  environment to every node; the run step makes no shared-FS operation.

The equations are in docs/scale.md and in :func:`predict`. Standard library
only; matplotlib is imported for ``--plot`` alone.
"""

import dataclasses as _dataclasses
import math as _math
import sys as _sys

from mpistage import StageError

STEPS = ("metadata", "read", "broadcast", "write", "run")
MODES = ("plain", "mpistage", "mpistage-trust", "staged-env")
INF = float("inf")


@_dataclasses.dataclass
class Machine:
    """The machine's parameters, in seconds, bytes and operations."""

    mds_rate: float = 2000.0  # ops/s one stream gets: 1 / latency of one op
    mds_concurrency: float = 20.0  # ops the metadata server serves at once
    node_cache: float = 0.0  # share of a rank's ops its node's cache answers
    ranks_per_node: int = 32
    fs_bw: float = 35e9  # shared FS, all clients together, bytes/s
    client_bw: float = 1e9  # shared FS, one reading process, bytes/s
    net_latency: float = 5e-6
    net_bw: float = 5e9
    bcast: str = "pipeline"  # or "binomial"
    chunk: float = 4 * 2**20
    local_bw: float = 1e9  # a leader checksums and writes its copy, bytes/s
    cores: float | None = None  # cores all ranks share (one machine); None: 1 each


@_dataclasses.dataclass
class Inputs:
    """What one mode costs, in counts measured at one or a few ranks."""

    ops_rank: float = 0.0  # shared-FS metadata ops of every rank
    ops_rank0_extra: float = 0.0  # rank 0's ops beyond ops_rank
    ops_node: float = 0.0  # ops of the stage step's process on each node
    ops_job: float = 0.0  # ops once per job (the launcher)
    bytes_rank: float = 0.0  # shared-FS bytes every rank reads
    bytes_node: float = 0.0  # shared-FS bytes the stage process of a node reads
    bundle_bytes: float = 0.0  # read once, broadcast, written once per node
    run_s: float = 0.0  # local CPU time of start-up and imports, per rank
    write_s: float | None = None  # staging seconds per node; None: bundle/local_bw


# -- the equations ------------------------------------------------------------


def nodes_for(ranks, machine):
    """Return how many nodes *ranks* ranks fill at the machine's ranks per node."""
    return max(1, _math.ceil(ranks / machine.ranks_per_node))


def predict(inputs, ranks, nodes, machine):
    """Return the seconds of each step, and their sum as ``total``."""
    nodes = min(nodes, ranks)
    steps = {
        "metadata": metadata_seconds(inputs, ranks, nodes, machine),
        "read": read_seconds(inputs, ranks, nodes, machine),
        "broadcast": broadcast_seconds(inputs.bundle_bytes, nodes, machine),
        "write": write_seconds(inputs, nodes, machine),
        "run": inputs.run_s * shared(ranks, machine.cores),
    }
    steps["total"] = sum(steps.values())
    return steps


def metadata_ops(inputs, ranks, nodes, machine):
    """Return the metadata ops the server answers in a job of *ranks* ranks.

    The first rank of a node pays all its ops; the others pay the share
    their node's client cache does not answer.
    """
    others = (ranks - nodes) * inputs.ops_rank * (1 - machine.node_cache)
    return (
        inputs.ops_job
        + inputs.ops_rank0_extra
        + nodes * (inputs.ops_rank + inputs.ops_node)
        + others
    )


def metadata_seconds(inputs, ranks, nodes, machine):
    """Return the time the metadata server needs: its throughput, or one
    process's chain of round trips if that is longer."""
    total = metadata_ops(inputs, ranks, nodes, machine)
    chain = inputs.ops_node + inputs.ops_rank + inputs.ops_rank0_extra
    return max(
        total / (machine.mds_rate * machine.mds_concurrency),
        chain / machine.mds_rate,
    )


def read_seconds(inputs, ranks, nodes, machine):
    """Return the time of the shared-FS data reads: everyone's, then the bundle."""
    together = ranks * inputs.bytes_rank + nodes * inputs.bytes_node
    alone = max(inputs.bytes_rank, inputs.bytes_node)
    spread = max(together / machine.fs_bw, alone / machine.client_bw)
    return spread + inputs.bundle_bytes / machine.client_bw


def broadcast_seconds(nbytes, nodes, machine):
    """Return the time to broadcast *nbytes* from one leader to *nodes* leaders."""
    if nbytes <= 0 or nodes <= 1:
        return 0.0
    depth = _math.ceil(_math.log2(nodes))
    if machine.bcast == "binomial":
        return depth * (machine.net_latency + nbytes / machine.net_bw)
    chunk = min(machine.chunk, nbytes)
    chunks = _math.ceil(nbytes / chunk)
    return (depth + chunks - 1) * (machine.net_latency + chunk / machine.net_bw)


def write_seconds(inputs, nodes, machine):
    """Return the time a leader takes to write its node's copy."""
    if inputs.write_s is not None:
        alone = inputs.write_s
    else:
        alone = inputs.bundle_bytes / machine.local_bw
    return alone * shared(nodes, machine.cores)


def shared(count, cores):
    """Return how much slower *count* processes run on *cores* shared cores."""
    return max(1.0, count / cores) if cores else 1.0


# -- built-in inputs: numpy, realistic layout ---------------------------------

# Measured with `mpistage bench run --ranks 1,8,32 --nodes 4` (docs/benchmarks.md).
F_OPS = 1837  # python -c "from mpi4py import MPI", everything on the simulated FS
F_BYTES = 9.7e6
RUN_S = 0.20  # import numpy, numpy.linalg from node-local storage, one rank


def runner_inputs(rank0_extra):
    """The runner's inputs: F plus finding mpistage; rank 0 reads and checks."""
    return Inputs(
        ops_rank=F_OPS + 161,
        ops_rank0_extra=rank0_extra,
        bytes_rank=F_BYTES,
        bundle_bytes=117e6,
        run_s=RUN_S,
    )


DEFAULT_INPUTS = {
    "plain": Inputs(ops_rank=6142, bytes_rank=27.8e6, run_s=RUN_S),
    "mpistage": runner_inputs(334),
    "mpistage-trust": runner_inputs(213),
    "staged-env": Inputs(
        ops_node=2202, bytes_node=F_BYTES, bundle_bytes=200e6, run_s=RUN_S
    ),
}
DEFAULT_SOURCE = (
    "built-in numpy inputs (realistic layout on the simulated shared FS, "
    "1 rank, caches off; see docs/scale.md)"
)


def default_inputs():
    """Return a fresh copy of the built-in inputs, one per mode."""
    return {m: _dataclasses.replace(i) for m, i in DEFAULT_INPUTS.items()}


# -- unit parsing -------------------------------------------------------------

TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
SIZE_UNITS = {
    "": 1.0,
    "b": 1.0,
    "kb": 1e3,
    "kib": 2.0**10,
    "mb": 1e6,
    "mib": 2.0**20,
    "gb": 1e9,
    "gib": 2.0**30,
    "tb": 1e12,
}


def parse_quantity(text, units, what):
    """Parse ``"0.5ms"`` or ``"35GB/s"`` with *units*; raise StageError if bad."""
    import re

    match = re.fullmatch(r"\s*([0-9.]+(?:[eE][-+]?[0-9]+)?)\s*([^\s0-9]*)\s*", text)
    unit = match and match.group(2).lower().removesuffix("/s")
    if not match or unit not in units:
        raise StageError(f"{what} {text!r} is not a quantity like {example(units)}")
    return float(match.group(1)) * units[unit]


def example(units):
    """Return an example quantity for an error message."""
    return "'0.5ms'" if units is TIME_UNITS else "'4MiB' or '35GB/s'"


def parse_time(text, what="time"):
    """Parse a duration such as ``0.5ms`` into seconds."""
    return parse_quantity(str(text), TIME_UNITS, what)


def parse_size(text, what="size"):
    """Parse a size or bandwidth such as ``4MiB`` or ``35GB/s`` into bytes."""
    return parse_quantity(str(text), SIZE_UNITS, what)


# -- results.json -------------------------------------------------------------

ROW_KEYS = (
    "workload",
    "mode",
    "ranks",
    "nodes",
    "total_s",
    "stage_s",
    "meta_ops",
    "ops_rank0",
    "ops_rank_median",
    "ops_stage_node",
    "bytes_read",
    "bundle_bytes",
)
NUMBER_KEYS = ROW_KEYS[2:]


def read_json(path, what):
    """Return the JSON in the file *path* (a *what* file), or one clear error."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise StageError(f"cannot read {what} file {path!r}: {exc.strerror}") from None
    except ValueError as exc:
        raise StageError(f"{what} file {path!r} is not JSON: {exc}") from None


def load_results(path):
    """Return ``(meta, rows)`` of a ``mpistage bench run`` results file, checked."""
    data = read_json(path, "results")
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows:
        raise StageError(
            f"results file {path!r} has no 'rows' list: give the results.json "
            "that mpistage bench run wrote"
        )
    meta = data.get("meta")
    return (meta if isinstance(meta, dict) else {}), [
        check_row(path, i, row) for i, row in enumerate(rows)
    ]


def check_row(path, index, row):
    """Return *row* if it has every key the model reads, with numbers as numbers."""
    if not isinstance(row, dict):
        raise StageError(f"results file {path!r}: row {index} is not an object")
    for key in ROW_KEYS:
        if key not in row:
            raise StageError(
                f"results file {path!r}: row {index} has no key {key!r} "
                "(written by an older mpistage bench run? run it again)"
            )
    for key in NUMBER_KEYS:
        value, least = row[key], 1 if key in ("ranks", "nodes") else 0
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or value < least
        ):
            raise StageError(
                f"results file {path!r}: row {index} key {key!r} must be a "
                f"number >= {least}, not {value!r}"
            )
    return row


def pick_rows(rows, workload, layout):
    """Return the rows of one workload and layout; the workload must be clear."""
    rows = [r for r in rows if r.get("layout", layout) == layout]
    names = sorted({r["workload"] for r in rows})
    if not names:
        raise StageError(f"no rows with layout {layout!r}: choose one with --layout")
    if workload is None and len(names) > 1:
        raise StageError(
            f"the results hold workloads {', '.join(map(repr, names))}: "
            "choose one with --workload"
        )
    workload = workload or names[0]
    if workload not in names:
        raise StageError(
            f"no rows of workload {workload!r}; the results hold "
            f"{', '.join(map(repr, names))}"
        )
    return workload, [r for r in rows if r["workload"] == workload]


def cells(rows):
    """Return ``{(mode, ranks, nodes): row of medians over repeats}``."""
    import statistics

    groups = {}
    for row in rows:
        groups.setdefault((row["mode"], row["ranks"], row["nodes"]), []).append(row)
    return {
        key: {k: statistics.median(r[k] for r in group) for k in NUMBER_KEYS}
        for key, group in groups.items()
    }


def simulator(meta, cores):
    """Return the machine the benchmark simulated: one server, 1/latency ops/s."""
    import os

    if "latency" not in meta:
        raise StageError(
            "the results file has no 'meta.latency': give the results.json "
            "that mpistage bench run wrote"
        )
    latency = parse_time(meta["latency"], "meta.latency")
    bandwidth = meta.get("bandwidth")
    bw = parse_size(bandwidth, "meta.bandwidth") if bandwidth else INF
    return Machine(
        mds_rate=1.0 / latency,
        mds_concurrency=1.0,
        fs_bw=bw,
        client_bw=bw,
        net_latency=1e-6,
        chunk=64 * 2**20,  # the runner's own chunk size
        cores=cores or meta.get("cores") or os.cpu_count(),
    )


def cell_inputs(cell, fitted):
    """Return the inputs of one measured cell: its own op counts, fitted costs."""
    ops_rank = cell["ops_rank_median"]
    return _dataclasses.replace(
        fitted,
        ops_rank=ops_rank,
        ops_rank0_extra=max(cell["ops_rank0"] - ops_rank, 0.0),
        ops_node=cell["ops_stage_node"],
    )


def fit(cell, machine):
    """Fit a mode's local costs from its 1-rank cell on *machine*.

    The launcher's ops are what the cell's processes did beyond rank 0 and
    the stage step; the per-node staging time is ``stage_s`` less the stage
    step's metadata; the per-rank run time is what the total leaves.
    """
    bundle = cell["bundle_bytes"]
    node_ops = cell["ops_stage_node"]
    rest = max(cell["bytes_read"] - bundle, 0.0)
    inputs = Inputs(
        ops_rank=cell["ops_rank0"],
        ops_node=node_ops,
        ops_job=max(cell["meta_ops"] - cell["ops_rank0"] - node_ops, 0.0),
        bytes_rank=0.0 if node_ops else rest,
        bytes_node=rest if node_ops else 0.0,
        bundle_bytes=bundle,
        write_s=staging_seconds(cell, machine),
    )
    spent = predict(inputs, 1, 1, machine)["total"]
    inputs.run_s = max(cell["total_s"] - spent, 0.0)
    return inputs


def staging_seconds(cell, machine):
    """Return a node's staging time at one node: ``stage_s`` less what the
    model counts elsewhere (the stage step's metadata, the bundle's read)."""
    if not cell["bundle_bytes"]:
        return 0.0
    meta = cell["ops_stage_node"] / machine.mds_rate
    read = cell["bundle_bytes"] / machine.client_bw
    return max(cell["stage_s"] - meta - read, 0.0)


def fits(table, machine):
    """Return ``{mode: fitted inputs}`` for every mode with a 1-rank cell."""
    return {
        mode: fit(cell, machine)
        for (mode, ranks, _), cell in sorted(table.items())
        if ranks == 1
    }


def inputs_from_results(path, workload, layout):
    """Return ``(workload, {mode: Inputs}, notes)`` for a cluster prediction.

    Op counts come from each mode's widest cell (the median rank other than
    0); bytes, the launcher's ops and the run time from its 1-rank cell, fitted
    on the simulator the file describes. The staging time is left to the
    machine's node-local bandwidth.
    """
    meta, rows = load_results(path)
    workload, rows = pick_rows(rows, workload, layout)
    table = cells(rows)
    fitted = fits(table, simulator(meta, None))
    found, notes = {}, []
    for mode in sorted({m for m, _, _ in table}):
        widest = max((k for k in table if k[0] == mode), key=lambda k: k[1])
        base = fitted.get(mode) or missing_fit(mode, notes)
        inputs = cell_inputs(table[widest], _dataclasses.replace(base, write_s=None))
        if widest[1] == 1:
            inputs.ops_rank = one_rank_ops(mode, table, inputs, notes)
            inputs.ops_rank0_extra = max(
                table[widest]["ops_rank0"] - inputs.ops_rank, 0
            )
        found[mode] = inputs
    return workload, found, notes


def missing_fit(mode, notes):
    """Return built-in local costs for a mode without a 1-rank cell, noted."""
    notes.append(f"{mode}: no 1-rank row; run time and bytes are the built-in ones")
    return _dataclasses.replace(DEFAULT_INPUTS.get(mode, DEFAULT_INPUTS["plain"]))


def one_rank_ops(mode, table, inputs, notes):
    """Return the ops of a rank other than 0 when only 1-rank cells exist.

    Rank 0 of the runner also checks the bundle, so its count overstates the
    others'; ``floor`` (the interpreter and mpi4py alone) is closer.
    """
    if inputs.bundle_bytes and not inputs.ops_node and ("floor", 1, 1) in table:
        notes.append(f"{mode}: ops of ranks other than 0 taken from floor at 1 rank")
        return table[("floor", 1, 1)]["ops_rank0"]
    return table[next(k for k in table if k[0] == mode and k[1] == 1)]["ops_rank0"]


# -- hand inputs: a JSON file and --set MODE.KEY=VALUE ------------------------

INPUT_KEYS = tuple(f.name for f in _dataclasses.fields(Inputs))


def set_input(inputs, mode, key, value, where):
    """Set one input of *mode* in *inputs*, refusing unknown keys and bad values."""
    if key not in INPUT_KEYS:
        raise StageError(
            f"{where}: unknown input {key!r}; inputs are {', '.join(INPUT_KEYS)}"
        )
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = -1.0
    if not number >= 0:
        raise StageError(f"{where}: {mode}.{key} must be a number >= 0, not {value!r}")
    setattr(inputs.setdefault(mode, Inputs()), key, number)


def load_inputs(path, inputs):
    """Apply a JSON file ``{"mode": {"key": number, ...}, ...}`` to *inputs*."""
    data = read_json(path, "inputs")
    if not isinstance(data, dict) or not all(
        isinstance(v, dict) for v in data.values()
    ):
        raise StageError(
            f'inputs file {path!r} must be {{"mode": {{"key": number}}}}, '
            'e.g. {"plain": {"ops_rank": 5020}}'
        )
    for mode, values in data.items():
        for key, value in values.items():
            set_input(inputs, mode, key, value, path)


def apply_sets(sets, inputs):
    """Apply ``MODE.KEY=VALUE`` settings to *inputs*."""
    for item in sets:
        target, eq, value = item.partition("=")
        mode, dot, key = target.rpartition(".")
        if not (eq and dot and mode):
            raise StageError(f"--set {item!r} must look like plain.ops_rank=5020")
        set_input(inputs, mode, key, value, "--set")


# -- tables -------------------------------------------------------------------


def fmt_s(seconds):
    """Format seconds with about three significant digits."""
    if seconds == 0:
        return "0"
    if seconds < 0.0005:
        return "<0.001"
    if seconds < 10:
        return f"{seconds:.3f}" if seconds < 0.1 else f"{seconds:.2f}"
    return f"{seconds:.1f}" if seconds < 100 else f"{seconds:,.0f}"


def rate(bw):
    """Format a bandwidth in GB/s ("unlimited" for none)."""
    return "unlimited" if bw == INF else f"{bw / 1e9:g} GB/s"


def describe(machine, per_node=True):
    """Return one line that says which machine parameters a table used."""
    total = machine.mds_rate * machine.mds_concurrency
    cores = f"; {machine.cores:g} cores shared" if machine.cores else ""
    rpn = f"; {machine.ranks_per_node} ranks/node" if per_node else ""
    return (
        f"machine: metadata server {machine.mds_rate:,.0f} ops/s per stream × "
        f"{machine.mds_concurrency:g} = {total:,.0f} ops/s, node cache "
        f"{machine.node_cache:g}{rpn}; shared FS "
        f"{rate(machine.fs_bw)} (one reader {rate(machine.client_bw)}); network "
        f"{machine.net_latency * 1e6:g} µs, {rate(machine.net_bw)}, {machine.bcast}"
        f" broadcast of {machine.chunk / 2**20:g} MiB chunks; node-local write "
        f"{rate(machine.local_bw)}{cores}"
    )


def prediction_table(inputs, modes, ranks_list, machine):
    """Return the markdown table of every step, per rank count and mode."""
    lines = [
        "| ranks | nodes | mode | metadata s | read s | broadcast s | stage write s "
        "| run s | total s |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for ranks in ranks_list:
        nodes = nodes_for(ranks, machine)
        for mode in modes:
            steps = predict(inputs[mode], ranks, nodes, machine)
            cols = " | ".join(fmt_s(steps[s]) for s in (*STEPS, "total"))
            lines.append(f"| {ranks:,} | {nodes:,} | {mode} | {cols} |")
    return "\n".join(lines)


def inputs_table(inputs, modes):
    """Return the markdown table of the inputs each mode was modelled with."""
    lines = [
        "| mode | ops/rank | rank 0 extra ops | ops/node (stage) | ops/job "
        "| MB/rank | MB/node | bundle MB | run s/rank |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in modes:
        i = inputs[mode]
        lines.append(
            f"| {mode} | {i.ops_rank:,.0f} | {i.ops_rank0_extra:,.0f} "
            f"| {i.ops_node:,.0f} | {i.ops_job:,.0f} | {i.bytes_rank / 1e6:.1f} "
            f"| {i.bytes_node / 1e6:.1f} | {i.bundle_bytes / 1e6:.1f} "
            f"| {i.run_s:.2f} |"
        )
    return "\n".join(lines)


# -- validation ---------------------------------------------------------------


def validate(path, meta, rows, workload, layout, machine):
    """Return the markdown report of the model against a results file's totals."""
    shown = {r["workload"] for r in rows if r.get("layout", layout) == layout}
    workloads = [workload] if workload else sorted(shown) or [None]
    parts = [
        f"model against {path} (metadata latency {meta['latency']}: "
        f"{machine.mds_rate:,.0f} ops/s, concurrency {machine.mds_concurrency:g}; "
        f"{machine.cores:g} cores shared by all ranks and leaders). "
        "Op counts are each cell's own; the run time and per-node staging time "
        "are fitted from the 1-rank rows, so those rows match by construction.",
        "",
        "| workload | mode | ranks | nodes | measured s | predicted s | error % |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    fitted_lines, notes = [], []
    for name in workloads:
        _, picked = pick_rows(rows, name, layout)
        table = cells(picked)
        fitted = fits(table, machine)
        parts += validation_rows(name, table, fitted, machine)
        fitted_lines += fitted_rows(name, fitted)
        notes += unfitted(name, table, fitted) + implied_rate(
            name, table, fitted, machine
        )
    return "\n".join(parts + ["", *fitted_table(fitted_lines), *notes])


def unfitted(workload, table, fitted):
    """Return a note per mode left out for want of a 1-rank row."""
    left = sorted({m for m, _, _ in table} - set(fitted))
    return [f"\n{workload}/{m}: no 1-rank row to fit, left out" for m in left]


def validation_rows(workload, table, fitted, machine):
    """Return one table line per measured cell that has a fitted 1-rank cell."""
    lines = []
    for (mode, ranks, nodes), cell in sorted(table.items()):
        if mode not in fitted:
            continue
        inputs = cell_inputs(cell, fitted[mode])
        predicted = predict(inputs, int(ranks), int(nodes), machine)["total"]
        measured = cell["total_s"]
        error = (predicted - measured) / measured * 100 if measured else 0.0
        lines.append(
            f"| {workload} | {mode} | {ranks:.0f} | {nodes:.0f} | {measured:.2f} "
            f"| {predicted:.2f} | {error:+.1f} |"
        )
    return lines


def fitted_rows(workload, fitted):
    """Return the lines that show what was fitted, per mode."""
    return [
        f"| {workload} | {mode} | {i.run_s:.2f} | {i.write_s or 0:.2f} "
        f"| {i.ops_job:,.0f} |"
        for mode, i in fitted.items()
    ]


def fitted_table(lines):
    """Return the fitted-values table, or nothing if nothing was fitted."""
    if not lines:
        return ["no 1-rank rows: nothing to fit, nothing predicted"]
    return [
        "| workload | mode | fitted run s/rank | fitted staging s/node "
        "| launcher ops/job |",
        "|---|---|---:|---:|---:|",
        *lines,
    ]


def implied_rate(workload, table, fitted, machine):
    """Return a note: the ops/s the simulated server really gave plain's widest cell."""
    plain = [k for k in table if k[0] == "plain" and k[1] > 1]
    if not plain or "plain" not in fitted:
        return []
    key = max(plain, key=lambda k: k[1])
    inputs = cell_inputs(table[key], fitted["plain"])
    steps = predict(inputs, int(key[1]), int(key[2]), machine)
    busy = table[key]["total_s"] - (steps["total"] - steps["metadata"])
    if busy <= 0:
        return []
    ops = metadata_ops(inputs, int(key[1]), int(key[2]), machine)
    return [
        "",
        f"{workload}/plain at {key[1]:.0f} ranks: the server answered "
        f"{ops / busy:,.0f} ops/s against the {machine.mds_rate:,.0f} the model "
        "assumes (rerun with --mds-rate to use the measured rate).",
    ]


# -- the seeds: published start-up figures ------------------------------------

# python-mpi-bcast's stager is a C program; the bundle size is a guess.
PMB_INPUTS = Inputs(ops_node=50, bundle_bytes=300e6, run_s=1.0)

SEEDS = (
    {
        "case": "Hopper, Warp, 1,024 cores, /home (GPFS via DVS)",
        "ranks": 1024,
        "rpn": 24,
        "mode": "plain",
        "inputs": Inputs(ops_rank=3388 + 1632, run_s=1.0),
        "published": 400.0,
        "source": "seed 002: close to 400 s; 3,388 opens + 1,632 stats per core",
    },
    {
        "case": "Hopper, Warp, 36K cores, Lustre /scratch",
        "ranks": 36864,
        "rpn": 24,
        "mode": "plain",
        "inputs": Inputs(ops_rank=3388 + 1632, run_s=1.0),
        "published": 4200.0,
        "source": "seed 002: about 10 × DLFM's 7 min (≈70 min, approximate)",
    },
    {
        "case": "Hopper, Warp, 40K cores, DLcache + FMcache",
        "ranks": 40000,
        "rpn": 24,
        "mode": "mpistage-trust",
        "inputs": Inputs(ops_rank=917, bundle_bytes=200e6, run_s=1.0),
        "published": 420.0,
        "source": "seed 002: around 7 min; F = 917 (python -c '', Python 2.7)",
    },
    {
        "case": "Blue Waters, 16,384 ranks, numpy + mpi4py",
        "ranks": 16384,
        "rpn": 32,
        "mode": "plain",
        "inputs": Inputs(ops_rank=4557, bytes_rank=9.7e6, run_s=0.5),
        "published": 437.6,
        "source": "seed 000: 7m17.6s; 4,557 ops from import numpy.fft, Python 2.7",
    },
    {
        "case": "Blue Waters, 16,384 ranks, mpiimport, outside its imports",
        "ranks": 16384,
        "rpn": 32,
        "mode": "mpistage-trust",
        "inputs": Inputs(ops_rank=917, bytes_rank=0.37e6, bundle_bytes=20e6, run_s=0.5),
        "published": 76.1,
        "source": "seed 000: 3m18.9s less 122.8 s in mpiimport's own import phase",
    },
    {
        "case": "python-mpi-bcast, Edison, 127,440 ranks, scipy",
        "ranks": 127440,
        "rpn": 24,
        "mode": "staged-env",
        "inputs": PMB_INPUTS,
        "published": 215.2,
        "launch_bound": True,
        "source": "87.2 s stage step + 128.0 s run step, each with its srun launch",
    },
    {
        "case": "python-mpi-bcast, its stage step",
        "ranks": 127440,
        "rpn": 24,
        "mode": "staged-env",
        "inputs": PMB_INPUTS,
        "published": 87.2,
        "steps": ("metadata", "read", "broadcast", "write"),
        "source": "srun of 5,310 processes; 2.16 s bcast, 43.1 s tar, 1.2 s chmod",
    },
    {
        "case": "python-mpi-bcast, rank 0's read and the broadcast",
        "ranks": 127440,
        "rpn": 24,
        "mode": "staged-env",
        "inputs": PMB_INPUTS,
        "published": 2.16,
        "steps": ("read", "broadcast"),
        "source": "its bcast timer (also each leader's write of the .tar.gz)",
    },
)


def seed_table(machine):
    """Return the markdown table of the model beside the published figures."""
    lines = [
        "| case | mode modelled | inputs | model s | published s | model / published "
        "| MDS ops/s that would match | published figure |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    return "\n".join(lines + [seed_row(seed, machine) for seed in SEEDS])


def seed_row(seed, machine):
    """Return the table line of one seed case."""
    machine = _dataclasses.replace(machine, ranks_per_node=seed["rpn"])
    nodes = nodes_for(seed["ranks"], machine)
    steps = predict(seed["inputs"], seed["ranks"], nodes, machine)
    model = sum(steps[s] for s in seed.get("steps", ("total",)))
    mode = seed["mode"]
    if "steps" in seed:
        mode += f" ({' + '.join(seed['steps'])})"
    cols = (
        seed["case"],
        mode,
        seed_inputs(seed, nodes),
        fmt_s(model),
        fmt_s(seed["published"]),
        f"{model / seed['published']:.2f}",
        matching_rate(seed, steps, nodes, machine),
        seed["source"],
    )
    return "| " + " | ".join(cols) + " |"


def seed_inputs(seed, nodes):
    """Return a short text of a seed case's inputs."""
    i = seed["inputs"]
    parts = [f"{seed['ranks']:,} ranks on {nodes:,} nodes"]
    for value, label in (
        (i.ops_rank, "ops/rank"),
        (i.ops_node, "ops/node"),
        (i.bytes_rank / 1e6, "MB/rank"),
        (i.bundle_bytes / 1e6, "MB bundle"),
        (i.run_s, "s run"),
    ):
        if value:
            parts.append(f"{value:,.4g} {label}")
    return ", ".join(parts)


def matching_rate(seed, steps, nodes, machine):
    """Return the aggregate metadata rate at which the model meets the figure."""
    if "steps" in seed or seed.get("launch_bound"):
        return "-"
    left = seed["published"] - (steps["total"] - steps["metadata"])
    ops = metadata_ops(seed["inputs"], seed["ranks"], nodes, machine)
    return f"{ops / left:,.0f}" if left > 0 and ops else "-"


# -- plot ---------------------------------------------------------------------


def plot(inputs, modes, ranks_list, machine, path):
    """Save time against ranks, log scales, one line per mode."""
    try:
        import matplotlib
    except ImportError:
        raise StageError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = plot_ranks(ranks_list)
    fig, axes = plt.subplots(figsize=(7, 4.5))
    for mode in modes:
        ys = [
            predict(inputs[mode], n, nodes_for(n, machine), machine)["total"]
            for n in xs
        ]
        axes.plot(xs, ys, marker=".", label=mode)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("ranks")
    axes.set_ylabel("modelled start-up time (s)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    served = machine.mds_rate * machine.mds_concurrency
    fig.suptitle(
        f"mpistage bench model: metadata server {served:,.0f} ops/s, "
        f"{machine.ranks_per_node} ranks/node",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ranks(ranks_list):
    """Return the given rank counts and the powers of two between them."""
    low, high = min(ranks_list), max(ranks_list)
    powers = [2**k for k in range(high.bit_length() + 1) if low <= 2**k <= high]
    return sorted({*ranks_list, *powers})


# -- command line -------------------------------------------------------------


def parser():
    """Return the argument parser of ``mpistage bench model``."""
    import argparse

    p = argparse.ArgumentParser(
        prog="mpistage bench model",
        description="Model start-up time at scale from counts measured at small "
        "scale; check the model against measurements and published figures.",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument("--validate", metavar="RESULTS", help="model vs measured totals")
    what.add_argument("--seeds", action="store_true", help="model vs published figures")
    p.add_argument("--results", metavar="RESULTS", help="inputs from bench run")
    p.add_argument("--workload", help="workload of the results file")
    p.add_argument("--layout", default="realistic", help="layout of the rows to use")
    p.add_argument("--inputs", metavar="JSON", help='{"mode": {"key": number}}')
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODE.KEY=VALUE",
        help=f"set one input; keys: {', '.join(INPUT_KEYS)}",
    )
    p.add_argument(
        "--ranks", default="1024,16384,131072", help="rank counts (%(default)s)"
    )
    p.add_argument("--modes", default=",".join(MODES), help="(%(default)s)")
    p.add_argument("--plot", metavar="PNG", help="save time against ranks")
    machine_flags(p)
    return p


def machine_flags(p):
    """Add one flag per machine parameter; unset flags keep the base machine's."""
    g = p.add_argument_group("machine (defaults: a Lustre-class system, docs/scale.md)")
    flag = g.add_argument
    flag("--mds-rate", type=float, metavar="OPS", help="ops/s one stream gets (2000)")
    flag("--mds-concurrency", type=float, metavar="N", help="ops served at once (20)")
    flag("--node-cache", type=float, metavar="SHARE", help="ops answered on-node (0)")
    flag("--ranks-per-node", type=int, metavar="N", help="(32)")
    flag("--fs-bw", metavar="BW", help="shared FS, all clients together (35GB/s)")
    flag("--client-bw", metavar="BW", help="shared FS, one reader (1GB/s)")
    flag("--net-latency", metavar="TIME", help="interconnect latency (5us)")
    flag("--net-bw", metavar="BW", help="interconnect bandwidth (5GB/s)")
    flag("--bcast", choices=("pipeline", "binomial"), help="(pipeline)")
    flag("--chunk", metavar="SIZE", help="pipelined broadcast chunk (4MiB)")
    flag("--local-bw", metavar="BW", help="node-local checksum and write (1GB/s)")
    flag("--cores", type=float, metavar="N", help="cores all ranks share (none)")


def machine_from_args(args, base):
    """Return *base* with the machine flags the user gave."""
    changes = {}
    for name in ("mds_rate", "mds_concurrency", "node_cache", "ranks_per_node"):
        changes[name] = getattr(args, name)
    changes["cores"] = args.cores
    changes["bcast"] = args.bcast
    changes["net_latency"] = args.net_latency and parse_time(args.net_latency)
    for name in ("fs_bw", "client_bw", "net_bw", "chunk", "local_bw"):
        value = getattr(args, name)
        changes[name] = value and parse_size(value, "--" + name.replace("_", "-"))
    machine = _dataclasses.replace(
        base, **{k: v for k, v in changes.items() if v is not None}
    )
    check_machine(machine)
    return machine


def check_machine(machine):
    """Refuse parameters the equations cannot use."""
    positive = ("mds_rate", "mds_concurrency", "ranks_per_node", "fs_bw")
    positive += ("client_bw", "net_bw", "chunk", "local_bw")
    for name in positive:
        if not getattr(machine, name) > 0:
            flag = "--" + name.replace("_", "-")
            raise StageError(f"{flag} must be > 0, not {getattr(machine, name)!r}")
    if not 0 <= machine.node_cache < 1:
        raise StageError(f"--node-cache must be in [0, 1), not {machine.node_cache!r}")
    if machine.cores is not None and not machine.cores > 0:
        raise StageError(f"--cores must be > 0, not {machine.cores!r}")


def gather_inputs(args, modes):
    """Return ``(label, {mode: Inputs}, notes)`` from the layered sources.

    Built-in inputs first, then the results file's modes, then the inputs
    file, then ``--set``: each layer changes only what it names.
    """
    label, inputs, notes = DEFAULT_SOURCE, default_inputs(), []
    if args.results:
        workload, found, notes = inputs_from_results(
            args.results, args.workload, args.layout
        )
        inputs.update(found)
        label = f"{workload} from {args.results}"
        missing = [m for m in modes if m not in found]
        notes += [f"{m}: not in the results; built-in inputs" for m in missing]
    if args.inputs:
        load_inputs(args.inputs, inputs)
        label += f", with {args.inputs}"
    apply_sets(args.set, inputs)
    if args.set:
        label += ", with --set " + " ".join(args.set)
    return label, inputs, notes


def pick_modes(text):
    """Return the mode names of ``--modes``."""
    modes = [m for m in text.split(",") if m]
    if not modes:
        raise StageError(f"--modes {text!r} names no mode, e.g. {','.join(MODES)}")
    return modes


def check_modes(modes, inputs):
    """Refuse modes without inputs."""
    unknown = [m for m in modes if m not in inputs]
    if unknown:
        raise StageError(
            f"no inputs for mode {', '.join(map(repr, unknown))}: modes with inputs "
            f"are {', '.join(sorted(inputs))} (add one with --set MODE.KEY=VALUE)"
        )


def run_prediction(args):
    """Print the prediction table (and save the plot); return 0."""
    machine = machine_from_args(args, Machine())
    from mpistage.bench.cli import parse_ranks

    ranks = parse_ranks(args.ranks)
    modes = pick_modes(args.modes)
    label, inputs, notes = gather_inputs(args, modes)
    check_modes(modes, inputs)
    print(f"inputs: {label}\n{describe(machine)}\n")
    print(prediction_table(inputs, modes, ranks, machine))
    print("\ninputs per mode:\n")
    print(inputs_table(inputs, modes))
    for note in notes:
        print(f"note: {note}")
    if args.plot:
        plot(inputs, modes, ranks, machine, args.plot)
        print(f"\nwrote {args.plot}")
    return 0


def run_validation(args):
    """Print the validation report; return 0."""
    meta, rows = load_results(args.validate)
    machine = machine_from_args(args, simulator(meta, args.cores))
    print(validate(args.validate, meta, rows, args.workload, args.layout, machine))
    return 0


def run_seeds(args):
    """Print the seed comparison table; return 0."""
    machine = machine_from_args(args, Machine())
    print(describe(machine, per_node=False) + "\n")
    print(seed_table(machine))
    return 0


def cli(argv):
    """Run ``mpistage bench model``; print errors as one line; return the status."""
    args = parser().parse_args(argv)
    try:
        if args.validate:
            return run_validation(args)
        if args.seeds:
            return run_seeds(args)
        return run_prediction(args)
    except StageError as exc:
        print(f"mpistage: error: {exc}", file=_sys.stderr, flush=True)
        return 1
