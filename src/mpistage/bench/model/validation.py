"""The model against measured totals: ``mpistage bench model --validate``.

Each measured cell is predicted with its own op counts and the costs fitted
from its mode's 1-rank cell (:mod:`.fit`), so the 1-rank rows match by
construction and the others show how far the model carries.
"""

from mpistage.bench.model.equations import metadata_ops, predict
from mpistage.bench.model.fit import cell_inputs, fits
from mpistage.bench.model.measured import cells, pick_rows


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
