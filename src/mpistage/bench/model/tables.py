"""The tables ``mpistage bench model`` prints, and how they write numbers."""

from mpistage.bench.model.equations import INF, STEPS, nodes_for, predict
from mpistage.bench.units import GB, MB, MIB, US


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
    return "unlimited" if bw == INF else f"{bw / GB:g} GB/s"


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
        f"{machine.net_latency / US:g} µs, {rate(machine.net_bw)}, {machine.bcast}"
        f" broadcast of {machine.chunk / MIB:g} MiB chunks; node-local write "
        f"{rate(machine.local_bw)}{cores}; launch {machine.launch_base:g} s + "
        f"{machine.launch_node * 1e3:.3g} ms/node + {machine.launch_rank * 1e3:.3g} "
        f"ms/rank; launcher tree of {machine.tree_width}, {machine.tree_block / MIB:g}"
        " MiB blocks"
    )


def prediction_table(inputs, modes, ranks_list, machine):
    """Return the markdown table of every step, per rank count and mode."""
    lines = [
        "| ranks | nodes | mode | metadata s | read s | broadcast s | stage write s "
        "| run s | launch s | total s |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
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
            f"| {i.ops_node:,.0f} | {i.ops_job:,.0f} | {i.bytes_rank / MB:.1f} "
            f"| {i.bytes_node / MB:.1f} | {i.bundle_bytes / MB:.1f}"
            f"{' per node' if i.bundle_per_node else ''}"
            f"{' by the launcher' if i.bundle_tree else ''} "
            f"| {i.run_s:.2f} |"
        )
    return "\n".join(lines)
