"""One pass over the bytes: read piece k+1, send piece k, write piece k-1.

A staged directory's files travel as one stream (:class:`~mpistage.data.
trees.Tree`), never one transfer per file and never whole in any process:
a checkpoint of 10-150 GB is tens of shards. :func:`carry` moves the
stream from leader 0 to every node leader in pieces of at most
:data:`mpistage.runtime.bulk.PIECE_SIZE` bytes. On leader 0 a thread reads
ahead into a few piece buffers (``preadv`` releases the GIL); on every
leader a thread writes behind (``pwritev`` straight into the files of the
node's copy); the main thread drives the broadcasts. So a process holds
:data:`BUFFERS` pieces at most, whatever the tree's size.

Each piece is two broadcasts. First its word, on the control path (8
bytes; the receivers sleep while they wait, :func:`mpistage.runtime.
collective.wait`): 0 once leader 0 has read the piece, or :data:`FAILED`
when it could not (a file unreadable, changed or gone). Then its bytes, on
the bulk path, polled without sleeps (:func:`complete`). So a leader takes
the CPU only while bytes flow, never while leader 0's read of a slow
shared file system is under way: the cores stay with the reader, the
writers and, on one machine, the file system's server. After a
:data:`FAILED` word all leaders stop at that same piece, and the caller's
agreement raises leader 0's reason on every rank. A leader that cannot
write (its node's place full) keeps receiving, so that nobody waits on it,
and says so at the end.

:func:`carry` is the one function the rest of :mod:`mpistage.data` calls
for a stream, so that it can share the bundle's byte path.
"""

import os as _os
import threading as _threading

from mpistage import StageError

BUFFERS = 3  # piece buffers per process: one read or written, one sent, one spare
FAILED = 1  # the word of a piece leader 0 could not read


def carry(leaders, size, fill=None, drain=None):
    """Move *size* bytes of a stream from leader 0 to every leader (collective).

    On leader 0, ``fill(start, view)`` puts the stream's bytes ``[start,
    start + len(view))`` into *view*; on every leader (leader 0 too),
    ``drain(start, view)`` writes them into its node's copy. Raises this
    leader's failure (a reader's, a writer's) once the stream has ended;
    a leader that stopped because leader 0 failed raises a placeholder
    (leader 0's own reason, agreed by the caller, comes first).
    """
    from mpistage.runtime.bulk import piece_size

    step = piece_size()
    spans = [(start, min(size, start + step)) for start in range(0, size, step)]
    if not spans:
        return
    root = leaders.rank == 0
    pieces = Pieces(min(BUFFERS, len(spans) + 1), min(step, size))
    writer = Worker("writer", drain, pieces, spans)
    reader = Worker("reader", fill, pieces, spans) if root else None
    try:
        stopped = send_all(leaders, spans, pieces, reader, writer)
    finally:
        if reader is not None:
            reader.finish()
        writer.finish()
    for worker in (reader, writer):
        if worker is not None and worker.error is not None:
            raise worker.error
    if stopped:
        raise StageError("node leader 0 stopped the stream")


def send_all(leaders, spans, pieces, reader, writer):
    """Broadcast every piece in order; return whether leader 0 stopped it."""
    from mpi4py import MPI

    from mpistage.runtime.collective import wait

    word = memoryview(bytearray(8)).cast("q")
    for index, (start, end) in enumerate(spans):
        if reader is not None:
            buf, word[0] = reader.take(index)
        else:
            buf = pieces.free()
        wait(leaders.Ibcast([word, MPI.INT64_T], root=0))  # sleeps: no bytes yet
        if word[0] == FAILED:
            pieces.give(buf)
            return True
        with memoryview(buf) as view:
            complete(leaders.Ibcast([view[: end - start], MPI.BYTE], root=0))
        writer.put(index, buf)
    return False


def complete(request):
    """Complete *request*: poll without sleeping, but let this process's threads run.

    As :func:`mpistage.runtime.bulk.complete`, a piece is polled without
    sleeps for up to :data:`~mpistage.runtime.bulk.SPIN_FOR` seconds, then
    the sleeping way. Between two polls the GIL is let go
    (``time.sleep(0)``): the reader and writer threads need it the moment
    their ``preadv`` or ``pwritev`` returns, and a plain spin would keep it
    for up to the interpreter's switch interval each time.
    """
    import time

    from mpistage.runtime import bulk
    from mpistage.runtime.collective import wait

    deadline = time.monotonic() + bulk.SPIN_FOR
    while not request.Test():
        if time.monotonic() > deadline:
            return wait(request)
        time.sleep(0)
    return None


class Pieces:
    """The piece buffers of one process, handed between its threads."""

    def __init__(self, count, step):
        import mmap
        import queue

        self.queue = queue.Queue()
        for _ in range(count):  # anonymous maps: no pass to zero them first
            self.queue.put(mmap.mmap(-1, step))

    def free(self):
        """Take a free buffer (wait for one the writer gave back)."""
        return self.queue.get()

    def give(self, buf):
        """Give *buf* back."""
        self.queue.put(buf)


class Worker:
    """A thread that reads pieces ahead (leader 0) or writes them behind.

    The reader takes free buffers, fills them in order and hands them, with
    their word, to the main thread; the writer takes sent pieces, writes
    them, and gives the buffers back. After a failure the writer only gives
    buffers back, and the reader hands its piece over as :data:`FAILED`
    and stops.
    """

    def __init__(self, kind, work, pieces, spans):
        import queue

        self.kind, self.work, self.pieces, self.spans = kind, work, pieces, spans
        self.inbox, self.error = queue.Queue(), None
        self.stop = _threading.Event()
        self.thread = _threading.Thread(
            target=self.read if kind == "reader" else self.write,
            name=f"mpistage-data-{kind}",
            daemon=True,
        )
        self.thread.start()

    def read(self):
        """Fill buffers with the stream's pieces, in order, until one fails."""
        for start, end in self.spans:
            buf = self.pieces.free()
            if buf is None or self.stop.is_set():
                return
            try:
                with memoryview(buf) as view:
                    self.work(start, view[: end - start])
            except BaseException as exc:  # noqa: BLE001  (told to all, then raised)
                self.error = as_stage_error(exc)
                self.inbox.put((buf, FAILED))
                return
            self.inbox.put((buf, 0))

    def take(self, index):
        """The main thread: the buffer of piece *index* and its word, once read."""
        return self.inbox.get()

    def put(self, index, buf):
        """The main thread: piece *index* was sent; write it."""
        self.inbox.put((index, buf))

    def write(self):
        """Write each sent piece into the node's copy; give its buffer back."""
        while True:
            index, buf = self.inbox.get()
            if buf is None:
                return
            if self.error is None:
                start, end = self.spans[index]
                try:
                    with memoryview(buf) as view:
                        self.work(start, view[: end - start])
                except BaseException as exc:  # noqa: BLE001  (raised after the stream)
                    self.error = as_stage_error(exc)
            self.pieces.give(buf)

    def finish(self):
        """Wait for the thread to end (the writer: after the pieces queued)."""
        if self.kind == "writer":
            self.inbox.put((None, None))
        else:
            self.stop.set()
            self.pieces.give(None)  # a reader waiting for a buffer ends
        self.thread.join()


def as_stage_error(exc):
    """One line for a failure of a reader or a writer thread."""
    from mpistage import describe

    if isinstance(exc, StageError):
        return exc
    if isinstance(exc, OSError) and exc.errno is not None:
        import errno

        if exc.errno == errno.ENOSPC:
            return StageError(f"no space left for the copy: {exc.strerror}")
    return StageError(describe(exc))


def read_into(fd, view, offset):
    """Fill *view* from the open file *fd* at *offset*; ``False`` if it ended early."""
    done = 0
    while done < len(view):
        n = _os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            return False
        done += n
    return True


def write_from(fd, view, offset):
    """Write all of *view* to the open file *fd* at *offset*."""
    done = 0
    while done < len(view):
        done += _os.pwritev(fd, [view[done:]], offset + done)
