"""The node copies of :mod:`mpistage.data`: MPI shared-memory windows.

Each node's copy is one window that the node leader allocates and every rank
of the node maps. A copy is freed collectively on its node once no rank
holds a view of it (:func:`sweep`), and at interpreter exit the rest are
freed before mpi4py finalizes MPI (:func:`free_all`); a forked child never
frees its parent's copies.
"""

import atexit as _atexit
import os as _os
import sys as _sys

SEGMENTS = []  # this rank's live node copies, in the order they were made
PID = _os.getpid()  # a forked child never frees the parent's copies


class Segment:
    """One node's copy: an MPI shared-memory window, allocated by the leader.

    The leader allocates all the bytes, the other ranks none; every rank
    maps the leader's memory (``Shared_query(0)``). The window owns the node
    communicator: both are freed together, collectively on the node.
    """

    def __init__(self, node, size):
        from mpi4py import MPI

        self.node, self.alive = node, None
        self.win = MPI.Win.Allocate_shared(size if node.rank == 0 else 0, 1, comm=node)
        self.win.Lock_all(MPI.MODE_NOCHECK)  # for Sync: load/store access only
        SEGMENTS.append(self)

    def memory(self):
        """Return a writable memoryview of the node's copy (for filling it)."""
        return memoryview(self.win.Shared_query(0)[0])

    def readonly(self):
        """Return a read-only view that keeps this copy in use while it lives.

        The view exports a ctypes block at the window's address; a weak
        reference to the block tells :func:`sweep` when no view is left.
        """
        import ctypes
        import weakref

        buf, _ = self.win.Shared_query(0)
        block = type("SharedBlock", (ctypes.c_ubyte * len(buf),), {})
        block = block.from_address(buf.address)
        self.alive = weakref.ref(block)
        return memoryview(block).cast("B").toreadonly()

    def in_use(self):
        """Whether some view of this copy still lives on this rank."""
        return self.alive is not None and self.alive() is not None

    def sync(self):
        """Make the node's writes visible to all its ranks (collective, sleeping)."""
        from mpistage.runtime.collective import barrier

        self.win.Sync()
        barrier(self.node)
        self.win.Sync()

    def free(self):
        """Free the window and the node communicator (collective on the node)."""
        SEGMENTS.remove(self)
        self.win.Unlock_all()
        self.win.Free()
        self.node.Free()


def sweep(node):
    """Free the copies that no rank of *node* uses any more (collective on it).

    Only copies made on a communicator congruent to *node* are considered:
    exactly those ranks are here, and each holds the same list of them.
    """
    from array import array

    from mpi4py import MPI

    from mpistage.runtime.collective import wait

    same = (MPI.IDENT, MPI.CONGRUENT)
    mine = [s for s in SEGMENTS if s.node.Compare(node) in same]
    if not mine:
        return
    unused = array("i", [not s.in_use() for s in mine])
    wait(node.Iallreduce(MPI.IN_PLACE, [unused, MPI.INT], op=MPI.MIN))
    for segment, free in zip(mine, unused, strict=True):
        if free:
            segment.free()


@_atexit.register
def free_all():
    """At exit, free every copy left, in the order they were made (collective).

    It runs before mpi4py finalizes MPI (mpi4py does that after the atexit
    handlers), and only if MPI still runs.
    """
    mpi = _sys.modules.get("mpi4py.MPI")
    if not SEGMENTS or mpi is None or mpi.Is_finalized() or _os.getpid() != PID:
        return
    for segment in list(SEGMENTS):
        segment.free()
