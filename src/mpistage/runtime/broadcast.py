"""Step 3: rank 0 sends the bundle bytes to every node leader.

The bytes travel as raw ``MPI.BYTE`` buffers, never pickled, on the bulk
path (:func:`mpistage.runtime.bulk.bcast`): pieces of
:data:`~mpistage.runtime.bulk.PIECE_SIZE` bytes, far below the 2 GiB count
limit of many MPI libraries whatever the bundle's size, each polled without
sleeps so that they move at the MPI's own speed. The size goes first, as a
64-bit integer, on the control path (it sleeps while it waits), so a
receiver can refuse a size it has no memory for before anything else is
sent, and a leader that waits for rank 0 to finish reading takes no CPU.

Python objects (a checked manifest, a verdict) go the same way
(:func:`share`): rank 0 pickles them first and every rank agrees on that,
so rank 0 never fails inside a broadcast the others are already in.
"""


def __getattr__(name):
    """``CHUNK_SIZE``: the older name of :data:`~mpistage.runtime.bulk.PIECE_SIZE`.

    Read only, for the benchmark's model; the size has one home, in bulk.
    """
    if name == "CHUNK_SIZE":
        from mpistage.runtime.bulk import PIECE_SIZE

        return PIECE_SIZE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def share_size(comm, size, root=0):
    """Return *size* (given on *root*) on every rank of *comm*."""
    from mpi4py import MPI

    from mpistage.runtime.collective import wait

    buf = memoryview(bytearray(8)).cast("q")
    buf[0] = size if comm.rank == root else 0
    wait(comm.Ibcast([buf, MPI.INT64_T], root=root))
    return buf[0]


def share(comm, value):
    """Return rank 0's *value* on every rank of *comm* (collective)."""
    import pickle

    from mpistage.runtime.collective import attempt

    blob = attempt(comm, lambda: pickle.dumps(value) if comm.rank == 0 else None)
    data = broadcast(comm, blob)
    return value if comm.rank == 0 else pickle.loads(data)


def broadcast(leaders, buf, allocate=bytearray):
    """Broadcast *buf* from leader 0 to all leaders; return it on each.

    *allocate* makes the receive buffer from the size (a ``bytearray`` by
    default; :mod:`mpistage.data` passes shared memory).
    """
    from mpistage.runtime.collective import attempt

    size = share_size(leaders, len(buf) if leaders.rank == 0 else 0)
    if leaders.rank != 0:
        buf = attempt(leaders, receive_buffer, allocate, size)
    else:
        attempt(leaders, lambda: None)
    from mpistage.runtime.bulk import bcast

    bcast(leaders, buf)
    return buf


def receive_buffer(allocate, size):
    """Allocate *size* bytes to receive into, with a clear error if it fails."""
    from mpistage import StageError

    try:
        return allocate(size)
    except MemoryError:
        raise StageError(f"a node leader cannot allocate {size} bytes") from None
