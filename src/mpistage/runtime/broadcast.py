"""Step 3: rank 0 sends the bundle bytes to every node leader.

The bytes travel as raw ``MPI.BYTE`` buffers with ``Ibcast``, never pickled,
in chunks of :data:`CHUNK_SIZE` bytes so that each message stays far below
the 2 GiB count limit of many MPI libraries whatever the bundle's size.
Tests set :data:`CHUNK_SIZE` to a few bytes to exercise the chunked path.
The size goes first, as a 64-bit integer, so a receiver can refuse a size
it has no memory for before anything else is sent.

Python objects (a checked manifest, a verdict) go the same way
(:func:`share`): rank 0 pickles them first and every rank agrees on that,
so rank 0 never fails inside a broadcast the others are already in.
"""

CHUNK_SIZE = 64 * 1024 * 1024


def share_size(comm, size, root=0):
    """Return *size* (given on *root*) on every rank of *comm*."""
    from mpi4py import MPI

    from mpistage.runtime.collective import wait

    buf = memoryview(bytearray(8)).cast("q")
    buf[0] = size if comm.rank == root else 0
    wait(comm.Ibcast([buf, MPI.INT64_T], root=root))
    return buf[0]


def chunks(comm, view, root=0):
    """Broadcast the buffer *view* from *root* in :data:`CHUNK_SIZE` pieces."""
    from mpi4py import MPI

    from mpistage.runtime.collective import wait

    step = max(1, int(CHUNK_SIZE))
    for start in range(0, len(view), step):
        wait(comm.Ibcast([view[start : start + step], MPI.BYTE], root=root))


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
    chunks(leaders, memoryview(buf).cast("B"))
    return buf


def receive_buffer(allocate, size):
    """Allocate *size* bytes to receive into, with a clear error if it fails."""
    from mpistage import StageError

    try:
        return allocate(size)
    except MemoryError:
        raise StageError(f"a node leader cannot allocate {size} bytes") from None
