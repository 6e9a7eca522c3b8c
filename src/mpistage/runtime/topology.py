"""Step 1: which ranks share a node, and who leads each node.

World → node communicator (``Split_type`` SHARED, or contiguous rank blocks
when ``MPISTAGE_EMULATE_NODES=N`` asks for N emulated nodes) → a communicator
of node leaders (rank 0 of each node). World rank 0 always leads node 0 and
is rank 0 of the leaders, so it can broadcast to them.

Under Slurm the launcher says which node each rank is on (``SLURM_NODEID``)
and MPI's own view may be wrong: with ``srun -m arbitrary`` the MPICH
wheel takes every rank for a node of its own. So when every rank has a
Slurm node id, nodes are the ranks with the same id and the same host
name (a variable passed on to other hosts by a launcher never merges two
hosts). Shared-memory windows need MPI's own view: ``discover(world,
shared=True)``.
"""

import os as _os

from mpistage.node.launch import emulated_nodes


class Topology:
    """The communicators of one job: world, this node, and the node leaders."""

    def __init__(self, world, node, leaders, index, count):
        self.world, self.node, self.leaders = world, node, leaders
        self.index, self.count = index, count

    @property
    def is_leader(self):
        """Whether this rank stages the bundle for its node."""
        return self.node.rank == 0


def discover(world, shared=False):
    """Split *world* into nodes and return the job's :class:`Topology`.

    With *shared*, nodes are what MPI can share memory within
    (``Split_type`` SHARED), whatever the launcher says: the nodes of
    :mod:`mpistage.data`'s shared-memory windows.
    """
    from mpi4py import MPI

    count = emulated_nodes(world.size)
    if count:
        index = world.rank * count // world.size
        node = world.Split(index, world.rank)
    elif not shared and world.allreduce(slurm_node() is not None, op=MPI.LAND):
        node = by_launcher(world)
    else:
        node = world.Split_type(MPI.COMM_TYPE_SHARED, world.rank)
    color = 0 if node.rank == 0 else MPI.UNDEFINED
    leaders = world.Split(color, world.rank)
    if not count:
        index = node.bcast(leaders.rank if node.rank == 0 else None, root=0)
        count = world.allreduce(1 if node.rank == 0 else 0)
    return Topology(world, node, leaders, index, count)


def slurm_node():
    """Return this rank's Slurm node id (``SLURM_NODEID``), or ``None``."""
    value = _os.environ.get("SLURM_NODEID", "")
    return int(value) if value.isdigit() else None


def by_launcher(world):
    """Split *world* by Slurm node id, then by host name within each id."""
    group = world.Split(slurm_node(), world.rank)
    names = group.allgather(_os.uname().nodename)
    node = group.Split(names.index(_os.uname().nodename), world.rank)
    group.Free()
    return node
