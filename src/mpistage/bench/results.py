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
    """Save :func:`figure` of *rows* as the PNG *path*."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(rows, meta)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)


MARKERS = "osD^vPX*<>ph"


def figure(rows, meta):
    """Time and the whole job's shared-FS operations against ranks, per mode.

    Left: seconds until every rank imported. Right: the metadata operations
    the shared FS served for the whole job (all ranks, and a mode's stage
    step), what its metadata server sees. Lower is better on both; the
    legend says what each mode is. A mode's points are shifted a little
    sideways, so that modes with equal values (``local`` and a cheap one,
    both near zero) stay visible; the ticks are the rank counts measured.
    """
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    series = {}
    for r in cell_medians(rows):
        series.setdefault((r["workload"], r["mode"]), []).append(r)
    workloads = sorted({w for w, _ in series})
    modes = in_order({m for _, m in series}, meta.get("layout", "packages"))
    ordered = sorted(series.items(), key=lambda i: (modes.index(i[0][1]), i[0][0]))
    for (workload, mode), points in ordered:
        index = modes.index(mode)
        shift = 2 ** (0.04 * (index - (len(modes) - 1) / 2))  # on the log2 axis
        ranks = [p["ranks"] * shift for p in points]
        label = mode_label(mode, meta.get("layout", "packages"))
        style = {
            "linestyle": ["-", "--", ":", "-."][workloads.index(workload) % 4],
            "color": f"C{index % 10}",
            "marker": MARKERS[index % len(MARKERS)],
            "label": label if len(workloads) == 1 else f"{workload} / {label}",
        }
        left.plot(ranks, [p["total_s"] for p in points], **style)
        right.plot(ranks, [max(p["meta_ops"], 1) for p in points], **style)
    measured = sorted({r["ranks"] for r in rows})
    decorate(left, "seconds until every rank imported", measured)
    decorate(right, "metadata operations, whole job (0 drawn at 1)", measured)
    left.set_title("time (lower is better)")
    right.set_title("shared-FS operations, all ranks (lower is better)")
    what = workloads[0] if len(workloads) == 1 else ", ".join(workloads)
    fig.suptitle(
        f"mpistage bench: start-up with {what}, {meta.get('layout', 'packages')} "
        f"layout on a simulated shared FS\n(metadata latency {meta['latency']}, "
        f"{meta['nodes']} emulated nodes)"
    )
    fig.tight_layout()
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2)
    return fig


def in_order(modes, layout):
    """*modes* in the order ``mpistage bench`` lists them, unknown ones last."""
    from mpistage.bench.modes import MODES

    known = list(MODES.get(layout, {}))
    return sorted(modes, key=lambda m: (known.index(m) if m in known else 99, m))


def mode_label(mode, layout):
    """``plain: every rank reads the shared FS``: a mode and what it is."""
    from mpistage.bench.modes import MODES

    known = MODES.get(layout, {}).get(mode)
    return f"{mode}: {known.summary}" if known and known.summary else mode


def decorate(axes, ylabel, ranks):
    """Label an axes of the plot: log scales, a tick at each rank count measured."""
    from matplotlib.ticker import FormatStrFormatter, NullFormatter, NullLocator

    axes.set_xlabel("ranks")
    axes.set_ylabel(ylabel)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xticks(ranks, [str(r) for r in ranks])
    axes.xaxis.set_minor_locator(NullLocator())
    axes.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    low, high = axes.get_ylim()
    if high < 30 * low:  # under two decades: label the minor ticks too
        axes.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    else:
        axes.yaxis.set_minor_formatter(NullFormatter())
    axes.grid(True, alpha=0.3)
