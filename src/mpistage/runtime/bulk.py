"""Bulk bytes between ranks: in pieces any MPI takes, at the MPI's own speed.

Every payload whose size the user decides (a bundle, a data file's parts,
a live push with a module's libraries) travels here, never as one message:

- no single message exceeds :func:`step` bytes (``MPISTAGE_PIECE_SIZE``,
  16 MiB by default), far below the 2**31 - 1 count limit of an MPI
  without MPI-4 large counts (Open MPI 4.1 refuses more with
  ``MPI_ERR_ARG``). Tests set :data:`PIECE_SIZE` (or the variable, for
  the processes they start) to a few bytes to exercise the many-piece
  path on small data, as mpi4py's ``util/pkl5`` does;
- a broadcast (:func:`bcast`) is one ``Ibcast`` per piece, completed by
  :func:`complete`, which calls ``Test()`` without sleeping. A nonblocking
  collective advances only inside MPI calls (Open MPI's schedules move one
  step per call), so the sleeps of :func:`mpistage.runtime.collective.wait`,
  right for a rank that waits for a decision, would hold the bytes up. The
  spin has a bound, :data:`SPIN_FOR` seconds per piece; a piece still
  unfinished then (a slow peer) is waited for the sleeping way, so a rank
  takes the CPU from others only while bytes flow;
- a point-to-point message (:func:`post`, :func:`take`) shorter than a
  piece is one message, as before. A longer one goes as pieces on one
  tag, the first of exactly :data:`PIECE_SIZE` bytes: the whole size (8
  bytes) and the first bytes, so that the receiver makes one buffer of
  the whole size and receives each following piece in place, in order.
  All pieces are posted at once, so a receiver that has the first one
  never waits on the sender's thread for the rest, only on the MPI.

Control messages (sizes, verdicts, requests) stay with
:mod:`~mpistage.runtime.collective`: small, and worth no spinning.
"""

PIECE_SIZE = None  # bytes in one message at most; None: MPISTAGE_PIECE_SIZE
SPIN_FOR = 1.0  # seconds one piece is polled without sleeping
HEAD = 8  # bytes of the whole size, in front of a long message's first piece


def step():
    """Bytes in one piece: :data:`PIECE_SIZE` if set, else ``MPISTAGE_PIECE_SIZE``."""
    if PIECE_SIZE is not None:
        return max(1, int(PIECE_SIZE))
    from mpistage.settings import get

    return get("MPISTAGE_PIECE_SIZE")


def spans(length):
    """Return the (start, end) of each piece of *length* bytes."""
    size = step()
    return [(start, min(length, start + size)) for start in range(0, length, size)]


def complete(request):
    """Complete *request*, polling without sleeps for up to :data:`SPIN_FOR` s."""
    import time

    from mpistage.runtime.collective import wait

    deadline = time.monotonic() + SPIN_FOR
    while not request.Test():
        if time.monotonic() > deadline:
            return wait(request)  # a slow peer: wait without the CPU
    return None


def bcast(comm, view, root=0):
    """Broadcast the byte buffer *view* from *root*, piece by piece (collective)."""
    from mpi4py import MPI

    view = memoryview(view).cast("B")
    for start, end in spans(len(view)):
        complete(comm.Ibcast([view[start:end], MPI.BYTE], root=root))


def post(comm, blob, dest, tag):
    """Send *blob* to *dest* as pieces on *tag*; return the pending requests.

    Keep *blob* alive until they complete.
    """
    from mpi4py import MPI

    view, step = memoryview(blob).cast("B"), piece_size()
    if len(view) < step:
        return [comm.Isend([view, MPI.BYTE], dest, tag)]
    head = len(view).to_bytes(HEAD, "little") + view[: step - HEAD]
    sends = [comm.Isend([head, MPI.BYTE], dest, tag)]
    for start in range(step - HEAD, len(view), step):
        sends.append(comm.Isend([view[start : start + step], MPI.BYTE], dest, tag))
    return sends


def take(comm, message, status):
    """Receive the matched *message* and the pieces that follow; return the bytes.

    *status* is the one *message* was matched with: its source and tag
    name where the other pieces come from.
    """
    from mpi4py import MPI

    step, count = piece_size(), status.Get_count(MPI.BYTE)
    first = bytearray(count)
    message.Recv([first, MPI.BYTE])
    if count < step:
        return first
    data = bytearray(int.from_bytes(first[:HEAD], "little"))
    data[: step - HEAD] = first[HEAD:]
    with memoryview(data) as view:
        for start in range(step - HEAD, len(data), step):
            piece = view[start : start + step]
            comm.Recv([piece, MPI.BYTE], status.source, status.tag)
    return data


def piece_size():
    """:func:`step`, and room for a first piece's header at least."""
    return max(2 * HEAD, step())
