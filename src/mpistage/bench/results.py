"""What ``mpistage bench run`` writes: CSV, JSON, a markdown table, a plot."""

import os as _os

from mpistage.bench.rows import medians
from mpistage.bench.sweep import COLUMNS, FIGURES
from mpistage.bench.units import MB

KEY = ("workload", "layout", "via", "mode", "ranks", "nodes")
DPI = 110


def write_all(rows, out, meta):
    """Write results.csv, results.json and results.png below *out*."""
    import json

    _os.makedirs(out, exist_ok=True)
    write_csv(rows, _os.path.join(out, "results.csv"))
    with open(_os.path.join(out, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    plot(rows, _os.path.join(out, "results.png"), meta)


def write_csv(rows, path):
    """Write one line per cell and repeat."""
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row[k] for k in COLUMNS})


def cell_medians(rows):
    """Return one row per (workload, layout, via, mode, ranks, nodes), sorted."""
    merged = medians(rows, KEY, FIGURES)
    return sorted(
        merged, key=lambda r: (r["workload"], r["layout"], r["ranks"], r["mode"])
    )


def table(rows):
    """Return the medians as a markdown table: time and metadata ops per rank."""
    lines = [
        "| workload | layout | ranks | nodes | mode | total s | stage s "
        "| ops rank 0 | ops other ranks (median / max) | ops, first rank of a node "
        "| ops per node, stage step | MB read |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in cell_medians(rows):
        layout = r["layout"] + (" (PYTHONPATH)" if r["via"] == "pythonpath" else "")
        lines.append(
            f"| {r['workload']} | {layout} | {r['ranks']} | {r['nodes']} "
            f"| {r['mode']} | {r['total_s']:.2f} | {r['stage_s']:.2f} "
            f"| {r['ops_rank0']:.0f} "
            f"| {r['ops_rank_median']:.0f} / {r['ops_rank_max']:.0f} "
            f"| {count(r['ops_first'])} "
            f"| {r['ops_stage_node']:.0f} | {r['bytes_read'] / MB:.1f} |"
        )
    return "\n".join(lines)


def count(value):
    """Return an op count for the table, ``–`` for none."""
    return f"{value:.0f}" if value else "–"


def plot(rows, path, meta):
    """Save time vs ranks and ops vs ranks, one line per mode and workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    series = {}
    for r in cell_medians(rows):
        series.setdefault((r["workload"], r["mode"]), []).append(r)
    styles = ["-", "--", ":", "-."]
    workloads = sorted({w for w, _ in series})
    modes = sorted({m for _, m in series})
    for (workload, mode), points in sorted(series.items()):
        ranks = [p["ranks"] for p in points]
        style = {
            "linestyle": styles[workloads.index(workload) % len(styles)],
            "color": f"C{modes.index(mode)}",
            "marker": "o",
            "label": f"{workload} / {mode}",
        }
        left.plot(ranks, [p["total_s"] for p in points], **style)
        right.plot(ranks, [max(p["ops_rank_max"], 1) for p in points], **style)
    decorate(left, "time until all ranks imported (s)")
    decorate(right, "shared-FS metadata ops, busiest rank (0 as 1)")
    left.set_yscale("log")
    right.set_yscale("log")
    fig.suptitle(
        f"mpistage bench ({meta.get('layout', 'packages')} layout): "
        f"metadata latency {meta['latency']}, {meta['nodes']} emulated nodes"
    )
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def decorate(axes, ylabel):
    """Label an axes of the plot."""
    axes.set_xlabel("ranks")
    axes.set_ylabel(ylabel)
    from matplotlib.ticker import FormatStrFormatter

    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_formatter(FormatStrFormatter("%d"))
    axes.grid(True, alpha=0.3)
