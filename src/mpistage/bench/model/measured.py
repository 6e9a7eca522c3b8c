"""What ``mpistage bench run`` measured: its results file, one row per cell.

The model reads the rows of one workload and layout, checks that every key
it uses is there and a number, reduces the repeats of a cell to their
medians, and rebuilds the machine the benchmark simulated from the file's
settings.
"""

from mpistage import StageError
from mpistage.bench.model.equations import INF, Machine
from mpistage.bench.units import parse_size, parse_time

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
OPTIONAL_KEYS = ("ops_first",)  # read as 0 from results that predate them
NUMBER_KEYS = ROW_KEYS[2:] + OPTIONAL_KEYS
CELL_KEY = ("mode", "ranks", "nodes")
LOCAL_NET_LATENCY = 1e-6  # ranks of one machine talk through shared memory


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
    for key in OPTIONAL_KEYS:
        row.setdefault(key, 0)
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
    from mpistage.bench.rows import medians

    figures = [k for k in NUMBER_KEYS if k not in CELL_KEY]
    merged = medians(rows, CELL_KEY, figures)
    return {tuple(row[k] for k in CELL_KEY): row for row in merged}


def simulator(meta, cores):
    """Return the machine the benchmark simulated: one server, 1/latency ops/s."""
    import os

    from mpistage.runtime.broadcast import CHUNK_SIZE

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
        net_latency=LOCAL_NET_LATENCY,
        chunk=CHUNK_SIZE,
        cores=cores or meta.get("cores") or os.cpu_count(),
        # The bench's own launch is in its fitted run time and launcher ops.
        launch_base=0.0,
        launch_node=0.0,
        launch_rank=0.0,
    )
