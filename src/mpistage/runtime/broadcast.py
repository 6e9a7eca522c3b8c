"""Step 3: rank 0 sends the bundle bytes to every node leader, as it reads them.

The bytes travel as raw ``MPI.BYTE`` buffers, never pickled, on the bulk
path (:mod:`mpistage.runtime.bulk`): pieces of
:func:`~mpistage.runtime.bulk.step` bytes (``MPISTAGE_PIECE_SIZE``), far
below the 2 GiB count limit of many MPI libraries whatever the bundle's
size.

:func:`stream` is the one pass over the bytes, from the bundle's file to
the node's copy: rank 0 reads piece k+1 (on a thread of its own), while
every leader receives piece k, and hashes and writes piece k-1 into its
node's copy (on threads too: reads, hashes and writes release the GIL, and
a nonblocking collective advances only inside the MPI calls of the main
thread). A rank holds :data:`DEPTH` pieces at most, never the whole
bundle. A failure on any leader (a read error, a full copy, a checksum)
stops every leader after the same piece: each piece's broadcast goes with
an ``Iallreduce`` of "all well so far", so no rank waits for a piece that
will not come.

While the pieces flow, the main thread waits for each with sleeping polls
(:func:`~mpistage.runtime.collective.wait`), not the spinning ones of
:func:`~mpistage.runtime.bulk.complete`: the threads that read, hash and
write need the CPU more than the transfer needs a poll every microsecond
(600 MB to 2 emulated nodes on 2 busy cores: 1.1 s with sleeping polls,
1.7 s spinning, on the MPICH wheel; Open MPI alike).

The size of a buffer (:func:`broadcast`) goes first, as a 64-bit integer,
on the control path (it sleeps while it waits), so a receiver can refuse a
size it has no memory for before anything else is sent. Python objects (a
checked manifest, a verdict) go the same way (:func:`share`): rank 0
pickles them first and every rank agrees on that, so rank 0 never fails
inside a broadcast the others are already in.
"""

import _thread

DEPTH = 4  # pieces a rank holds at once: read or received, sent, written


def __getattr__(name):
    """``CHUNK_SIZE``: the older name of :func:`~mpistage.runtime.bulk.step`.

    Read only, for the benchmark's model; the size has one home, in bulk.
    """
    if name == "CHUNK_SIZE":
        from mpistage.runtime.bulk import step

        return step()
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
    default). For small things: a bundle's bytes go by :func:`stream`.
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


# -- the one pass over the bytes ----------------------------------------------


def stream(comm, size, fill=None, take=(), place=None, root=0):
    """Move *size* bytes from *root* to every rank of *comm*, piece by piece.

    Collective over *comm* (``None``: this process alone, no MPI). Offsets
    run from 0 to *size*:

    - ``fill(start, view)``, on *root* only, puts the bytes from *start* on
      into *view* (reads them), on a thread;
    - each job of *take*, ``job(start, view)``, on any rank, takes every
      piece once it is there (hashes it, writes it into the node's copy),
      each job on a thread of its own;
    - ``place(start, end)``, if given, is where a piece lives for good (a
      node's copy in shared memory); else pieces go through :data:`DEPTH`
      buffers of :func:`~mpistage.runtime.bulk.step` bytes, reused.

    Returns whether every piece is through (``False``: every rank stopped
    after the same piece because one failed); raises this rank's own error
    instead, so that the caller's agreement names it. Every thread has
    ended by then.
    """
    from mpistage.runtime.bulk import spans

    pieces = spans(size)
    mine = comm is None or comm.rank == root
    flow = Flow(pieces, place, fill if mine else None, take)
    try:
        complete = flow.run(comm, root)
    finally:
        flow.close()
    flow.raise_error()
    return complete


class Flow:
    """One :func:`stream` on one rank: its pieces, buffers and threads."""

    def __init__(self, pieces, place, fill, take):
        self.pieces, self.place = pieces, place
        self.buffers, self.reads, self.taken = {}, {}, {}
        self.reader = Worker(fill) if fill else None
        self.takers = [Worker(job) for job in take]

    def view(self, k):
        """The memory of piece *k*: its place, or a reused buffer."""
        start, end = self.pieces[k]
        if self.place is not None:
            return self.place(start, end)
        slot = k % DEPTH
        if slot not in self.buffers:
            self.buffers[slot] = bytearray(self.pieces[0][1] - self.pieces[0][0])
        return memoryview(self.buffers[slot])[: end - start]

    def free(self, k):
        """Wait until piece *k*'s memory can take another piece."""
        if self.place is None:
            for ticket in self.taken.pop(k - DEPTH, ()):
                wait_ticket(ticket)

    def read(self, k):
        """Start reading piece *k* (the root), once its memory is free."""
        if self.reader is not None and k < len(self.pieces):
            self.free(k)
            self.reads[k] = self.reader.submit(self.pieces[k][0], self.view(k))

    def run(self, comm, root):
        """Read ahead, then send (or receive) each piece and hand it on."""
        ahead = DEPTH - 2 if self.place is None else len(self.pieces)
        for k in range(min(ahead, len(self.pieces))):
            self.read(k)
        for k in range(len(self.pieces)):
            if self.reader is None:
                self.free(k)
            wait_ticket(self.reads.pop(k, None))
            if not self.move(comm, root, k):
                return False
            view, start = self.view(k), self.pieces[k][0]
            self.taken[k] = [w.submit(start, view) for w in self.takers]
            self.read(k + ahead)
        for worker in self.takers:
            worker.drain()
        return True

    def move(self, comm, root, k):
        """Broadcast piece *k* with the verdict "all well so far"; return it."""
        if comm is None:
            return self.well()
        from mpi4py import MPI

        from mpistage.runtime.collective import wait

        well = memoryview(bytearray(4)).cast("i")
        well[0] = self.well()
        agreed = memoryview(bytearray(4)).cast("i")
        sent = comm.Ibcast([self.view(k), MPI.BYTE], root=root)
        told = comm.Iallreduce([well, MPI.INT], [agreed, MPI.INT], op=MPI.MIN)
        wait(sent)
        wait(told)
        return bool(agreed[0])

    def workers(self):
        """The threads of this flow: the reader (root), then the takers."""
        return ([self.reader] if self.reader else []) + self.takers

    def well(self):
        """Whether nothing failed on this rank so far."""
        return all(w.error is None for w in self.workers())

    def close(self):
        """End the threads: the queued pieces are dropped, the current one done."""
        for worker in self.workers():
            worker.stop()

    def raise_error(self):
        """Raise this rank's first error (the reader's, else a taker's)."""
        for worker in self.workers():
            if worker.error is not None:
                raise worker.error


def wait_ticket(ticket):
    """Wait until the job of *ticket* is done (``None``: nothing to wait for)."""
    if ticket is not None:
        ticket.acquire()


class Worker:
    """A thread that runs one job on pieces, in the order given.

    After a job fails, the later ones are skipped (their tickets still
    released): :attr:`error` says why. :meth:`stop` drops what is queued and
    returns once the thread has ended, so nothing writes on after it.
    """

    def __init__(self, job):
        self.job, self.error, self.queue = job, None, []
        self.lock = _thread.allocate_lock()
        self.bell = _thread.allocate_lock()
        self.bell.acquire()
        self.ended = _thread.allocate_lock()
        self.ended.acquire()
        self.stopping = False
        _thread.start_new_thread(self.run, ())

    def submit(self, start, view):
        """Queue ``job(start, view)``; return a ticket, released once it is done."""
        ticket = _thread.allocate_lock()
        ticket.acquire()
        with self.lock:
            self.queue.append((start, view, ticket))
        self.ring()
        return ticket

    def ring(self):
        """Wake the thread."""
        try:
            self.bell.release()
        except RuntimeError:
            pass  # Rung already.

    def run(self):
        """Run the queued jobs until stopped."""
        try:
            while True:
                self.bell.acquire()
                while True:
                    with self.lock:
                        if self.stopping or not self.queue:
                            break
                        start, view, ticket = self.queue.pop(0)
                    if view is not None:  # None: drain's mark
                        self.one(start, view)
                    ticket.release()
                if self.stopping:
                    return
        finally:
            with self.lock:
                for _start, _view, ticket in self.queue:
                    ticket.release()
                self.queue = []
            self.ended.release()

    def one(self, start, view):
        """Run one job, unless one failed before; keep its error."""
        if self.error is not None:
            return
        try:
            self.job(start, view)
        except BaseException as exc:  # noqa: BLE001  (raised in the main thread)
            self.error = exc

    def drain(self):
        """Wait until every queued job is done."""
        ticket = _thread.allocate_lock()
        ticket.acquire()
        with self.lock:
            self.queue.append((None, None, ticket))
        self.ring()
        ticket.acquire()

    def stop(self):
        """Drop the queued jobs; return once the thread has ended."""
        with self.lock:
            self.stopping = True
        self.ring()
        self.ended.acquire()
