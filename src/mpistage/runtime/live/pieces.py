"""A push's big files, in pieces: the reader's outbox and a leader's intake.

A file of :data:`RAW_FROM` bytes or more travels down the tree of leaders
as raw pieces of at most :func:`~mpistage.runtime.bulk.step` bytes, after
its push's header, and then one byte: :data:`GOOD` when the pieces are the
original's bytes, :data:`BAD` when reading the original failed halfway (it
shrank while the job ran: the rest is sent as zeros), and every leader then
drops the file, so its ranks read the original as plain python would.

World rank 0 copies each big file from the original into its node's copy,
piece by piece (:func:`copy_file`), and its own node has the answer as soon
as the copy does: what its ranks wait for never waits for another node.
The pieces leave for its children as they are copied:

- from the very buffer the piece was read into, when one of the
  :data:`DEPTH` slots is free and everything before it has been posted
  (:meth:`Outbox.slot_for`), so the bytes are read once;
- otherwise later, read again into a slot as one frees, from the node's
  copy (or from the original, where the copy could not take the file)
  (:meth:`Outbox.advance`, run by the relay's thread while it polls).

So the reader holds at most :data:`DEPTH` pieces and one more, never a
file, and a child that cannot take its bytes now (its program blocked in
MPI holding the GIL, so its relay thread cannot run) holds back only what
is sent to it. Pieces go out in the order of the files, each file's
trailer after its last piece, all under one lock, so a leader takes them
in order on one tag.

A leader (:func:`take_file`) receives each piece into one of :data:`DEPTH`
buffers, with the next receive posted before it writes, passes it on to
its children and writes it into its copy: it never holds a file either.
"""

import _thread
import os as _os
from collections import deque

RAW_FROM = 1 << 20  # bytes from which a file of a push travels as raw pieces
DEPTH = 4  # pieces a process holds at once while passing a file on
GOOD, BAD = b"\x01", b"\x00"  # the trailer of a file


class Job:
    """One big file on its way: where its bytes are read from, and how far."""

    def __init__(self, fd, size, ready):
        self.fd, self.size = fd, size
        self.ready = ready  # bytes that can be read from *fd* now
        self.next = 0  # the first byte not yet posted
        self.good = True
        self.owned = [fd]  # descriptors closed once the file has left


class Slot:
    """A buffer of one piece and the sends of it still in flight."""

    def __init__(self):
        self.buf, self.sends = None, []

    def free(self):
        """Whether every send of the piece has completed (tested, not waited)."""
        self.sends = [request for request in self.sends if not request.Test()]
        return not self.sends

    def view(self, size):
        """The first *size* bytes of the buffer, made on first use."""
        if self.buf is None or len(self.buf) < size:
            self.buf = bytearray(size)
        return memoryview(self.buf)[:size]


class Outbox:
    """Rank 0's big sends to its children in the tree, in order, bounded.

    *wake* is called once pieces are posted (the relay polls them then).
    """

    def __init__(self, comm, children, tag, wake):
        self.comm, self.children, self.tag, self.wake = comm, children, tag, wake
        self.jobs, self.trailers = deque(), []
        self.slots = [Slot() for _ in range(DEPTH)]
        self.lock = _thread.allocate_lock()

    def add(self, fd, size, ready):
        """Queue a file of *size* bytes read from *fd*; return its :class:`Job`."""
        job = Job(fd, size, ready)
        with self.lock:
            self.jobs.append(job)
        return job

    def busy(self):
        """Whether anything is still to be posted or still in flight."""
        with self.lock:
            return bool(self.jobs or self.trailers) or not all(
                s.free() for s in self.slots
            )

    def slot_for(self, job, start):
        """A free slot to read the piece at *start* into and send it from, or None.

        Only when every byte before it has been posted: pieces leave in order.
        """
        with self.lock:
            if self.jobs and self.jobs[0] is job and job.next == start:
                for slot in self.slots:
                    if slot.free():
                        return slot
        return None

    def copied(self, job, end, slot=None):
        """The bytes of *job* up to *end* are readable; *slot* holds the last piece."""
        with self.lock:
            job.ready = max(job.ready, end)
            if slot is not None:
                self.post(slot, job, job.next, end)
        self.wake()

    def switch(self, job, fd):
        """Read what is still to be sent of *job* from *fd* (whole) instead."""
        with self.lock:
            job.fd, job.ready = fd, job.size
            job.owned.append(fd)
        self.wake()

    def finish(self, job, good):
        """No more bytes will be copied for *job*; *good*: they are the original's."""
        with self.lock:
            job.good, job.ready = good, job.size
        self.wake()

    def advance(self):
        """Post what can be posted now; return whether anything moved."""
        from mpi4py import MPI

        moved = False
        with self.lock:
            self.trailers = [r for r in self.trailers if not r.Test()]
            while self.jobs:
                job = self.jobs[0]
                if job.next >= job.size:
                    self.end(job, MPI)
                    moved = True
                    continue
                if job.next >= job.ready:
                    break
                slot = next((s for s in self.slots if s.free()), None)
                if slot is None:
                    break
                end = min(job.size, job.next + piece_size())
                fill(job.fd, slot.view(end - job.next), job.next)
                self.post(slot, job, job.next, end)
                moved = True
        return moved

    def post(self, slot, job, start, end):
        """Send the piece [*start*, *end*) of *job*, held by *slot* (lock held)."""
        from mpi4py import MPI

        piece = [slot.view(end - start), MPI.BYTE]
        slot.sends = [self.comm.Isend(piece, c, self.tag) for c in self.children]
        job.next = end

    def end(self, job, MPI):
        """Every piece of *job* is posted: post its trailer, close what it owns."""
        mark = GOOD if job.good else BAD
        for child in self.children:
            self.trailers.append(self.comm.Isend([mark, MPI.BYTE], child, self.tag))
        for fd in job.owned:
            _os.close(fd)
        self.jobs.popleft()


def copy_file(writer, outbox, item):
    """Reader: copy one big file into this node's copy; queue it for the children.

    Each piece is read into a free slot of the *outbox* when there is one
    (and sent from it at once), else into a buffer of its own (sent later,
    read again from this node's copy). Where the copy cannot take the file,
    the outbox reads the original. A file whose original cannot be read
    whole is dropped everywhere. *outbox* is ``None`` without children.
    """
    from mpistage.runtime.bulk import spans

    _f, path, big, mode, mtime_ns, needs = item
    out = writer.open_file(path, mode, mtime_ns, needs)
    job, own, good = queue(writer, outbox, big, out), None, True
    for start, end in spans(len(big) if out is not None else 0):
        slot = outbox.slot_for(job, start) if job else None
        if slot is None:
            own = own or bytearray(end - start)
        view = slot.view(end - start) if slot else memoryview(own)[: end - start]
        good = fill(big.fd, view, start)
        writer.write_piece(out, view)
        writer.progress(end - start)
        if not good or out.out is None:  # unreadable, or the copy gave up
            break
        if job is not None:
            outbox.copied(job, end, slot)
    if job is not None and good and out is not None and out.out is None:
        outbox.switch(job, big.take())
    elif job is not None:
        outbox.finish(job, good)
    writer.close_file(out) if good else writer.drop_file(out)
    big.close()


def queue(writer, outbox, big, out):
    """Queue *big* on *outbox*: read from the copy being written, or the original.

    Return its :class:`Job`, or ``None`` (no outbox).
    """
    if outbox is None:
        return None
    fd = writer.reader(out)
    if fd is None:
        return outbox.add(big.take(), len(big), len(big))
    return outbox.add(fd, len(big), 0)


def take_file(comm, parent, children, writer, item, tag):
    """Leader: take one big file's bytes from *parent*; pass each piece on, write it.

    At most :data:`DEPTH` pieces are held: a buffer is used again once the
    children have it; the next piece's receive is posted before a piece is
    written. The byte after the pieces says whether they are the
    original's; if not, the file is dropped. Return the bytes taken.
    """
    from mpi4py import MPI

    from mpistage.runtime.bulk import complete, spans

    _f, path, size, mode, mtime_ns, needs = item
    out = writer.open_file(path, mode, mtime_ns, needs)
    pieces, slots, posted = spans(size), [Slot() for _ in range(DEPTH)], deque()

    def receive(index):
        slot = slots[index % DEPTH]
        for request in slot.sends:
            complete(request)
        start, end = pieces[index]
        view = slot.view(end - start)
        posted.append((slot, view, comm.Irecv([view, MPI.BYTE], parent, tag)))

    for index in range(min(2, len(pieces))):
        receive(index)
    try:
        for index in range(len(pieces)):
            slot, view, request = posted.popleft()
            complete(request)
            if index + 2 < len(pieces):
                receive(index + 2)
            slot.sends = [comm.Isend([view, MPI.BYTE], c, tag) for c in children]
            writer.write_piece(out, view)
            writer.progress(len(view))
        mark = bytearray(1)
        complete(comm.Irecv([mark, MPI.BYTE], parent, tag))
        for child in children:
            complete(comm.Isend([mark, MPI.BYTE], child, tag))
    finally:
        for slot in slots:
            for request in slot.sends:
                complete(request)
    writer.close_file(out) if mark == GOOD else writer.drop_file(out)
    return size


def piece_size():
    """Bytes in one piece (:func:`mpistage.runtime.bulk.step`)."""
    from mpistage.runtime.bulk import step

    return step()


def fill(fd, view, offset):
    """Read *view*'s bytes of *fd* from *offset*; zeros past what is there.

    Return whether every byte was read.
    """
    done = 0
    try:
        while done < len(view):
            n = _os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                break
            done += n
    except OSError:
        pass
    if done < len(view):
        view[done:] = bytes(len(view) - done)
    return done == len(view)
