"""The model's equations: the machine, a mode's inputs, the seconds of each step.

Every step is a function of the mode's counts (:class:`Inputs`), the rank
and node counts and the machine (:class:`Machine`); :func:`predict` adds
them up. docs/scale.md writes the same equations in symbols.
"""

import dataclasses as _dataclasses
import math as _math

from mpistage.bench.units import MIB

STEPS = ("metadata", "read", "broadcast", "write", "run", "launch")
MODES = (
    "plain",
    "mpistage",
    "mpistage-trust",
    "staged-env",
    "env-launch",
    "env-launch-bcast",
)
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
    chunk: float = 4 * MIB
    local_bw: float = 1e9  # a leader checksums and writes its copy, bytes/s
    cores: float | None = None  # cores all ranks share (one machine); None: 1 each
    # The launcher's start and MPI_Init: base + per node + per rank, fitted on
    # python-mpi-bcast's Edison sweep (seeds.EDISON_* and seeds.edison_launch).
    launch_base: float = 2.998
    launch_node: float = 6.441e-3
    launch_rank: float = 6.717e-4
    # The launcher's file broadcast (srun --bcast, sbcast): Slurm sends one
    # block at a time down a tree of tree_width (file_bcast.c: MAX_THREADS 8)
    # and waits for every node's reply before the next block.
    tree_width: int = 8
    tree_block: float = 8 * MIB


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
    bundle_per_node: float = 0.0  # 1: each node reads the bundle itself, no broadcast
    bundle_tree: float = 0.0  # 1: the launcher's tree broadcasts it (srun --bcast)
    stage_launch: float = 0.0  # 1: a stage step, one process per node, launched first
    run_s: float = 0.0  # local CPU time of start-up and imports, per rank
    write_s: float | None = None  # staging seconds per node; None: bundle/local_bw


def nodes_for(ranks, machine):
    """Return how many nodes *ranks* ranks fill at the machine's ranks per node."""
    return max(1, _math.ceil(ranks / machine.ranks_per_node))


def predict(inputs, ranks, nodes, machine):
    """Return the seconds of each step, and their sum as ``total``."""
    nodes = min(nodes, ranks)
    steps = {
        "metadata": metadata_seconds(inputs, ranks, nodes, machine),
        "read": read_seconds(inputs, ranks, nodes, machine),
        "broadcast": bundle_broadcast_seconds(inputs, nodes, machine),
        "write": write_seconds(inputs, nodes, machine),
        "run": inputs.run_s * shared(ranks, machine.cores),
        "launch": job_launch_seconds(inputs, ranks, nodes, machine),
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
    return spread + bundle_read_seconds(inputs, nodes, machine)


def bundle_read_seconds(inputs, nodes, machine):
    """Return the time to read the bundle: once, or once per node at once.

    Read per node (``mpistage-env``), the nodes share the file system's
    bandwidth, and none reads faster than one reader can.
    """
    size = inputs.bundle_bytes
    if inputs.bundle_per_node:
        return max(nodes * size / machine.fs_bw, size / machine.client_bw)
    return size / machine.client_bw


def launch_seconds(ranks, nodes, machine):
    """Return the launcher's start of *ranks* processes on *nodes* nodes, with
    MPI_Init: a fixed part, a part per node (the fan-out), a part per rank
    (the PMI exchange of every rank's address)."""
    return (
        machine.launch_base + nodes * machine.launch_node + ranks * machine.launch_rank
    )


def job_launch_seconds(inputs, ranks, nodes, machine):
    """Return the launches of a job: its own, and a stage step's before it."""
    seconds = launch_seconds(ranks, nodes, machine)
    if inputs.stage_launch:
        seconds += launch_seconds(nodes, nodes, machine)
    return seconds


def bundle_broadcast_seconds(inputs, nodes, machine):
    """Return the time the bundle takes to reach every node after its read."""
    if inputs.bundle_tree:
        return tree_seconds(inputs.bundle_bytes, nodes, machine)
    return broadcast_seconds(broadcast_bytes(inputs), nodes, machine)


def tree_seconds(nbytes, nodes, machine):
    """Return the launcher's broadcast of *nbytes* to *nodes* nodes (sbcast).

    Each block goes down ⌈log_W N⌉ levels; at each level a node sends it to
    its W children over its one link; the next block leaves only when every
    node has answered. So the levels do not overlap: every level costs
    W·S/β for the whole file, plus one latency per block.
    """
    if nbytes <= 0 or nodes <= 1:
        return 0.0
    depth, reach = 0, 1
    while reach < nodes:
        depth, reach = depth + 1, reach * machine.tree_width
    blocks = _math.ceil(nbytes / machine.tree_block)
    per_level = machine.tree_width * nbytes / machine.net_bw
    return depth * (blocks * machine.net_latency + per_level)


def broadcast_bytes(inputs):
    """Return the bytes the leaders broadcast: none if each node reads its own."""
    return 0.0 if inputs.bundle_per_node else inputs.bundle_bytes


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
