"""The weights term: a checkpoint of W bytes in s shards onto every node.

What a job pays, after start-up, to give every rank the tensors of a model
checkpoint (``mpistage bench model --weights 140GB``), on the same machine
as the start-up model (:class:`~mpistage.bench.model.equations.Machine`):

- ``plain``: every rank opens, stats and maps (or reads) each shard from
  the shared file system. A node's client cache serves its other ranks the
  bytes one rank fetched, so every node fetches W; every rank pays the
  metadata operations of its opens. A rank that reads into memory of its
  own (``safetensors`` ``load_file``) holds W itself: W per rank of memory.
- ``mpistage`` (:func:`mpistage.data.tensors`, ``staged_dir``): rank 0
  opens each shard once and reads W once; the pieces are broadcast to the
  node leaders and written into each node's copy as they arrive. Reading,
  sending and writing overlap, so the stream takes the slowest of the three
  plus one piece through the other two.

docs/scale.md writes the same equations in symbols.
"""

from mpistage.bench.model.equations import broadcast_seconds, nodes_for
from mpistage.bench.units import GB, MIB

OPS_PER_FILE = 4  # a lookup, the open, a stat, the close's release
PIECE = 64 * MIB  # bytes of one piece of the stream (bulk.PIECE_SIZE)
MODES = ("plain", "mpistage")


def metadata_seconds(ops_total, ops_chain, machine):
    """The server's time: its throughput, or one process's chain if longer."""
    return max(
        ops_total / (machine.mds_rate * machine.mds_concurrency),
        ops_chain / machine.mds_rate,
    )


def weights_seconds(mode, size, shards, ranks, nodes, machine):
    """Return the seconds of *mode*'s steps, and their sum as ``total``.

    ``plain``: metadata and the nodes' reads. ``mpistage``: metadata, then
    the stream, whose ``read`` (one reader) overlaps the broadcast and the
    leaders' writes.
    """
    ops = OPS_PER_FILE * (shards + 1)  # the shards and the index
    if mode == "plain":
        steps = {
            "metadata": metadata_seconds(ranks * ops, ops, machine),
            "read": max(nodes * size / machine.fs_bw, size / machine.client_bw),
        }
        steps["total"] = steps["metadata"] + steps["read"]
        return steps
    read = size / machine.client_bw
    send = broadcast_seconds(size, nodes, machine)
    write = size / machine.local_bw
    piece = min(PIECE, size)
    fill = piece / machine.client_bw + piece / machine.local_bw
    steps = {
        "metadata": metadata_seconds(ops, ops, machine),
        "read": read,
        "stream": max(read, send, write) + fill,
    }
    steps["total"] = steps["metadata"] + steps["stream"]
    return steps


def weights_table(size, shards, ranks_list, machine):
    """Return the markdown table of the weights term per rank count and mode."""
    from mpistage.bench.model.tables import fmt_s

    lines = [
        f"weights: {size / GB:g} GB in {shards} shards",
        "",
        "| ranks | nodes | mode | metadata s | shared-FS read s | stream s "
        "| total s | read from shared FS | memory per node |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for ranks in ranks_list:
        nodes = nodes_for(ranks, machine)
        per_node = -(-ranks // nodes)
        for mode in MODES:
            s = weights_seconds(mode, size, shards, ranks, nodes, machine)
            fetched = size * (nodes if mode == "plain" else 1)
            memory = f"{size / GB:g} GB"
            if mode == "plain":
                memory += f" mapped, {per_node * size / GB:g} GB read"
            stream = fmt_s(s["stream"]) if "stream" in s else "-"
            lines.append(
                f"| {ranks:,} | {nodes:,} | {mode} | {fmt_s(s['metadata'])} "
                f"| {fmt_s(s['read'])} | {stream} | {fmt_s(s['total'])} "
                f"| {fetched / GB:,.0f} GB | {memory} |"
            )
    return "\n".join(lines)
