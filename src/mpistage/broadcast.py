"""Step 3 of the runner: rank 0 sends the bundle bytes to every node leader.

The bytes travel as raw ``MPI.BYTE`` buffers with ``Ibcast``, never pickled,
in chunks of :data:`CHUNK_SIZE` bytes so that each message stays far below
the 2 GiB count limit of many MPI libraries whatever the bundle's size.
Tests set :data:`CHUNK_SIZE` to a few bytes to exercise the chunked path.
"""

CHUNK_SIZE = 64 * 1024 * 1024


def broadcast(leaders, buf):
    """Broadcast *buf* from leader 0 to all leaders; return it on each."""
    from array import array

    from mpi4py import MPI

    from mpistage.collective import wait

    size = array("q", [len(buf) if leaders.rank == 0 else 0])
    wait(leaders.Ibcast([size, MPI.INT64_T], root=0))
    if leaders.rank != 0:
        buf = bytearray(size[0])
    view, step = memoryview(buf), max(1, int(CHUNK_SIZE))
    for start in range(0, size[0], step):
        wait(leaders.Ibcast([view[start : start + step], MPI.BYTE], root=0))
    return buf
