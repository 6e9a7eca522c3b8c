"""The node leader's relay: one thread per leader that serves live imports.

Each node leader runs one thread (world rank 0's also holds the reader):

- it answers its node's requests (:mod:`~.request`) from its copy, or
  forwards the key to the reader, once per key however many ranks ask;
- the reader answers every key it resolves (its own rank's and those
  forwarded to it) with a *push* that names the keys it answers and
  carries what it read, to every leader along a binary tree of leaders:
  each leader passes a push on to its children first, then writes it into
  its copy (:class:`~.mirror.CopyWriter`), so every file travels once to
  every node and the reader sends each push to two leaders, not to all;
- a key is answered once the push that names it has been written here, so
  an answer never overtakes the bytes it stands for, and a key the reader
  resolved for one node is known on every node without asking again.

A push is a small header (the keys, the listings and the small files,
pickled) and then the bytes of each big file (:data:`~.pieces.RAW_FROM`
bytes or more) as raw pieces on their own tag (:mod:`~.pieces`): the
reader copies such a file into its node's copy piece by piece and sends
the pieces as it goes, and a leader passes each piece on to its children
and writes it into its copy, so no process holds a big file. Every other
message goes in pieces too
(:func:`~mpistage.runtime.bulk.post`), so no message exceeds the count
limit of an MPI without large counts.

The thread polls its communicator with growing sleeps (20 µs to 2 ms)
instead of blocking inside MPI, so that an idle leader leaves the CPU to
the program, and it wakes at once when a thread of its own process asks.
While its sends are in flight it polls without sleeping, for up to
:data:`~mpistage.runtime.bulk.SPIN_FOR` seconds after anything last
happened: a push advances only inside MPI calls.

A rank's program may block in MPI holding the GIL (mpi4py's first
lowercase collective on a communicator duplicates it so), and then this
thread cannot run until every rank reaches that call. So the thread that
asked for a key on a leader returns to the program only once the big
pushes this relay sends have left (:meth:`Relay.drain`, bounded by
progress): the bytes that another node waits for never wait for this
node's program; and what a push answers needs no thread at all where it
arrives (it names its keys, in the node's log too).

The thread never imports: Python runs every finder with its global import
lock held, so a rank's import may be waiting, lock in hand, for this very
thread; a first import here would wait for that lock for ever. Everything
the thread (and the reader it runs) uses is imported before it starts
(:data:`NEEDS`).

The end belongs to the main thread. After the program, the main thread
takes the relay over (:meth:`Relay.take_over`): the thread leaves at its
next step, and from then on this process calls MPI from one thread only,
as ``MPI_Finalize`` requires of the threads it finds (MPI-4.1 §11.2.2:
only after every thread has completed its MPI calls). That matters when
the program calls ``MPI_Finalize`` itself: MPICH stops locking before it
runs the callbacks that end the job, so a thread still polling there races
the main thread's own calls (a message handle found invalid, a crash, a
mutex left locked at the very end). The main thread then serves on until
every rank has finished the program, and ends in two steps: each leader
stops forwarding, waits for its outstanding keys, and says ``BYE`` to the
reader; when all have, the reader sends ``END`` down the tree after its
last push. A relay ends once ``END`` has reached it and its sends are
complete, so MPI finalizes with no message in flight. An unexpected error
in a relay ends the job (``MPI_Abort``).
"""

import _thread

from mpistage import Backoff
from mpistage.runtime.live.pieces import RAW_FROM
from mpistage.runtime.live.request import (
    BODY,
    BYE,
    CLOSED,
    END,
    FORWARD,
    PUSH,
    REQUEST,
)

POLL_MIN, POLL_MAX, POLL_IDLE = 0.00002, 0.002, 0.02  # seconds between polls
IDLE_AFTER = 2.0  # seconds without traffic before polling slows to POLL_IDLE
FANOUT = 2
NEEDS = (  # imported before the thread starts (see above)
    "errno",
    "marshal",
    "pickle",
    "stat",
    "struct",
    "time",
    "mpistage.settings",
    "mpistage.runtime.finders",
    "mpistage.runtime.listings",
    "mpistage.node.elf",
    "mpistage.runtime.bulk",
    "mpistage.runtime.bundlefile",
    "mpistage.runtime.collective",
    "mpistage.runtime.extract",
    "mpistage.runtime.live.mirror",
    "mpistage.runtime.live.pieces",
    "mpistage.runtime.live.reader",
    "mpistage.runtime.live.request",
    "mpistage.node.place",
    "mpistage.runtime.roots",
)


def tree(index, size):
    """Return (parent, children) of leader *index* in the binary tree of *size*."""
    parent = (index - 1) // FANOUT if index else None
    first = index * FANOUT + 1
    return parent, list(range(first, min(first + FANOUT, size)))


class Waiter:
    """A thread of this process waiting for a key."""

    def __init__(self):
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.result = None


class Relay:
    """One leader's server: its node's requests, the tree, and (rank 0) the reader."""

    def __init__(self, serve, reply, leaders, index, writer, reader=None):
        self.serve, self.reply, self.writer, self.reader = serve, reply, writer, reader
        parent, children = tree(index, len(leaders))
        self.parent = None if parent is None else leaders[parent]
        self.children = [leaders[c] for c in children]
        self.others = len(leaders) - 1  # BYEs the reader waits for
        self.lock = _thread.allocate_lock()
        self.sending = _thread.allocate_lock()  # over sends: progress runs apart
        self.bell = _thread.allocate_lock()
        self.bell.acquire()
        self.parked = _thread.allocate_lock()  # held while the thread serves
        self.parked.acquire()
        self.seq = self.applied = 0
        self.moved = 0.0  # when a send last began or ended (time.monotonic)
        self.known, self.pending = {}, {}
        self.local, self.sends = [], []
        self.closing = self.said_bye = self.ended = self.stopped = False
        self.handing = False  # the main thread takes over (:meth:`take_over`)
        self.byes = 0
        self.counts = {"requests": 0, "forwarded": 0, "pushes": 0, "bytes": 0}
        self.outbox = None  # the reader's big sends (:mod:`~.pieces`)
        if reader is not None and self.children:
            from mpistage.runtime.live.pieces import Outbox

            self.outbox = Outbox(serve, self.children, BODY, self.sent_now)

    # -- the thread ----------------------------------------------------------

    def start(self):
        """Start serving in a thread of its own, all it needs imported first."""
        import importlib

        for name in NEEDS:
            importlib.import_module(name)
        _thread.start_new_thread(self.run, ())

    def run(self):
        """Serve in the thread until the main thread takes the relay over."""
        try:
            self.serve_until(lambda: self.handing)
        except BaseException as exc:  # noqa: BLE001  (a server must not die quietly)
            self.crash(exc)
        finally:
            self.parked.release()

    def serve_until(self, done):
        """Serve until ``done()`` says so, polling with growing sleeps between."""
        import time

        pauses, quiet = Backoff(POLL_MIN, POLL_MAX), time.monotonic()
        while not done():
            if self.step():
                pauses.reset()
                quiet = time.monotonic()
                continue
            if self.in_flight():
                continue
            idle = time.monotonic() - quiet > IDLE_AFTER
            self.bell.acquire(timeout=POLL_IDLE if idle else pauses.next())

    def in_flight(self):
        """Whether bytes are on their way: poll again now, as :mod:`~.bulk` does.

        Only for :data:`~mpistage.runtime.bulk.SPIN_FOR` seconds since a
        send last began or ended: a receiver that takes nothing gets the
        sleeping polls.
        """
        import time

        from mpistage.runtime.bulk import SPIN_FOR

        busy = bool(self.sends) or self.posting()
        return busy and time.monotonic() - self.moved < SPIN_FOR

    def posting(self):
        """Whether the reader's outbox has bytes to post or in flight."""
        return self.outbox is not None and self.outbox.busy()

    def step(self):
        """Do what can be done now; return whether anything was."""
        import time

        busy = self.receive()
        busy = self.take_local() or busy
        busy = self.progress() or busy
        if self.outbox is not None and self.outbox.advance():
            self.moved = time.monotonic()
            busy = True
        if self.closing:
            busy = self.wind_down() or busy
        return busy

    def ring(self):
        """Wake the thread now."""
        try:
            self.bell.release()
        except RuntimeError:
            pass  # Rung already.

    def crash(self, exc):
        """Say what went wrong and end the job: ranks may be waiting on us."""
        import sys

        from mpistage.runtime.collective import describe

        rank = self.serve.Get_rank()
        print(
            f"mpistage: error: live imports on rank {rank}: {describe(exc)}",
            file=sys.stderr,
            flush=True,
        )
        self.serve.Abort(1)

    def stop(self):
        """The relay ends: answer whoever still waits."""
        with self.lock:
            self.stopped = True
            waiters = [w for _key, w in self.local]
            self.local = []
        for waiter in waiters:
            self.answer(waiter, CLOSED)

    # -- messages ------------------------------------------------------------

    def receive(self):
        """Take one message, if one came; return whether one did."""
        import pickle

        from mpi4py import MPI

        from mpistage.runtime.live.request import receive

        status = MPI.Status()
        message = self.serve.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
        if message is None:
            return False
        raw, source, tag = (
            receive(self.serve, message, status),
            status.source,
            status.tag,
        )
        if tag == PUSH:
            self.pushed(raw, source)
        elif tag == END:
            self.send_down(raw, END)
            self.ended = True
        elif tag == BYE:
            self.byes += 1
        else:
            value = pickle.loads(raw)
            if tag == REQUEST:
                self.request(value[1], (source, value[0]))
            elif tag == FORWARD:
                self.resolve(value)
        return True

    def send(self, blob, dest, tag, comm=None):
        """Send *blob* in pieces without waiting; it is kept until they complete."""
        import time

        from mpistage.runtime.bulk import post

        comm = comm or self.serve
        pieces = post(comm, blob, dest, tag)
        with self.sending:
            self.sends.extend((piece, blob) for piece in pieces)
        self.moved = time.monotonic()
        self.ring()  # sent by another thread (the reader's pushes): poll it now

    def send_down(self, blob, tag):
        """Pass *blob* on to this leader's children in the tree."""
        for child in self.children:
            self.send(blob, child, tag)

    def progress(self):
        """Let outstanding sends complete; forget those that did."""
        import time

        if not self.sends:
            return False
        with self.sending:
            left = [(r, b) for r, b in self.sends if not r.Test()]
            done = len(left) < len(self.sends)
            self.sends = left
        if done:
            self.moved = time.monotonic()
        return done

    # -- requests ------------------------------------------------------------

    def submit(self, key):
        """A thread of this process asks for *key*; return its :class:`Waiter`."""
        waiter = Waiter()
        with self.lock:
            if not self.stopped:
                self.local.append((key, waiter))
                self.ring()
                return waiter
        waiter.result = CLOSED
        waiter.done.release()
        return waiter

    def take_local(self):
        """Serve what threads of this process asked for."""
        with self.lock:
            local, self.local = self.local, []
        for key, waiter in local:
            self.request(key, waiter)
        return bool(local)

    def request(self, key, waiter):
        """A rank of this node needs *key*."""
        self.counts["requests"] += 1
        if self.reader is not None:
            return self.answer(waiter, self.resolve(key))
        if key in self.known:
            return self.answer(waiter)
        if key in self.pending:
            return self.pending[key].append(waiter)
        if self.closing:
            return self.answer(waiter, CLOSED)
        self.pending[key] = [waiter]
        self.counts["forwarded"] += 1
        from mpistage.runtime.live.request import dumps

        self.send(dumps(key), 0, FORWARD)

    def answer(self, waiter, result=None):
        """Tell a waiting rank or thread that its key is answered (or not)."""
        if isinstance(waiter, Waiter):
            waiter.result = result
            waiter.done.release()
        else:
            from mpistage.runtime.live.request import dumps

            rank, tag = waiter
            self.send(dumps(result), rank, tag, self.reply)

    def pushed(self, raw, parent):
        """A push came down the tree: pass it on, write it, answer who waited.

        The big files' bytes follow the header as raw pieces, taken here one
        by one (:func:`~.pieces.take_file`), in the order of the header's items.
        """
        import pickle

        self.send_down(raw, PUSH)
        seq, keys, items = pickle.loads(raw)
        self.counts["bytes"] += len(raw)
        for item in items:  # files in order (an extension after its libraries)
            if item[0] == "f" and isinstance(item[2], int):
                from mpistage.runtime.live.pieces import take_file

                args = (self.serve, parent, self.children, self.writer, item, BODY)
                self.counts["bytes"] += take_file(*args)
            elif item[0] == "f":
                self.writer.write_file(*item[1:])
        self.writer.apply([item for item in items if item[0] != "f"])
        self.writer.answered(keys)
        self.writer.progress(len(raw))
        self.applied = seq
        self.counts["pushes"] += 1
        for key in keys:
            self.known[key] = seq
            for waiter in self.pending.pop(key, []):
                self.answer(waiter)

    # -- the reader (world rank 0) -------------------------------------------

    def resolve(self, key):
        """Reader: read what answers *key* (once), push it; ``None`` or ``"closed"``.

        Every key resolved is named in a push, even one that brings nothing
        new: then every leader knows it is answered, and none asks again.
        A key forwarded after that needs nothing: the push that names it
        is on its way to the leader that asked, or there already.
        """
        with self.lock:
            if self.ended:
                return CLOSED
            if key not in self.known:
                self.push([key], self.reader.items(key))
                self.known[key] = self.seq
        return None

    def push(self, keys, items):
        """Reader: send *items* (answering *keys*) down the tree; write them here.

        The header goes first; each big file is copied here piece by piece
        and its pieces follow through the outbox
        (:func:`~.pieces.copy_file`; :func:`~.pieces.take_file` at the
        other end).
        """
        from mpistage.runtime.live.request import dumps

        self.seq += 1
        if self.children:
            head = [shrunk(item) for item in items]
            blob = dumps((self.seq, keys, head))
            self.send_down(blob, PUSH)
            self.counts["bytes"] += len(blob) * len(self.children)
        for item in items:  # files in order (an extension after its libraries)
            if item[0] == "f" and raw(item):
                from mpistage.runtime.live.pieces import copy_file

                copy_file(self.writer, self.outbox, item)
                self.counts["bytes"] += len(item[2]) * len(self.children)
            elif item[0] == "f":
                self.writer.write_file(*item[1:])
        self.writer.apply([item for item in items if item[0] != "f"])
        self.writer.answered(keys)
        self.applied = self.seq
        self.counts["pushes"] += 1

    def sent_now(self):
        """Something was posted: poll it now, spinning (:meth:`in_flight`)."""
        import time

        self.moved = time.monotonic()
        self.ring()

    def drain(self, wait):
        """Return once this relay's big sends have left, or nothing moved for *wait* s.

        The thread that asked waits here, GIL released, so that this relay
        can pass a push's raw pieces on before the program may block in
        MPI: those need this rank's progress; a small message leaves as it
        is posted (eager). Answers need no thread of this rank: the push
        names them, and the node's log too.
        """
        import time

        pauses, since = Backoff(POLL_MIN, POLL_MAX), time.monotonic()
        while self.heavy() and not self.stopped:
            if time.monotonic() - max(self.moved, since) > wait:
                return False
            self.ring()
            pauses.sleep()
        return True

    def heavy(self):
        """Whether a send of :data:`~.pieces.RAW_FROM` bytes or more is still due."""
        if self.posting():
            return True
        return any(len(blob) >= RAW_FROM for _request, blob in list(self.sends))

    # -- the end -------------------------------------------------------------

    def take_over(self):
        """The main thread serves from now on: return once the thread has left.

        Called after the program; before it, this thread makes no MPI call
        (see the module docstring).
        """
        self.handing = True
        self.ring()
        self.parked.acquire()

    def close(self, everyone):
        """End the relay in the main thread, once *everyone* (a request) completes.

        *everyone* completes when every rank has finished the program (an
        ``Ibarrier``); until then this node's requests are still served.
        """
        try:
            self.serve_until(everyone.Test)
            self.closing = True
            self.ring()
            self.serve_until(self.over)
        except BaseException as exc:  # noqa: BLE001  (ranks may be waiting on us)
            self.crash(exc)
        finally:
            self.stop()

    def over(self):
        """Whether ``END`` has come (or gone, on the reader) and every send left."""
        return self.ended and not self.sends and not self.posting()

    def wind_down(self):
        """Take the next step of the end; return whether one was taken."""
        if self.reader is None:
            if not self.said_bye and not self.pending:
                from mpistage.runtime.live.request import dumps

                self.said_bye = True
                self.send(dumps(None), 0, BYE)
                return True
            return False
        if not self.ended and self.byes == self.others and not self.posting():
            with self.lock:
                self.ended = True
                self.send_down(b"", END)
            return True
        return False


def raw(item):
    """Whether the item is a file whose bytes travel as raw pieces."""
    return item[0] == "f" and item[2] is not None and len(item[2]) >= RAW_FROM


def shrunk(item):
    """The item as the header carries it: a raw file's bytes become their size."""
    return (*item[:2], len(item[2]), *item[3:]) if raw(item) else item
