"""The request path of live imports: a rank asks its leader, never everyone.

Nothing is collective per import. A rank that needs a listing or a module
that is not in its node's copy yet sends one request to its node leader
and waits for the answer; the leader answers from its copy or asks the
reader (:mod:`~.relay`). So a rank that imports what no other rank
imports gets it, a rank that imports nothing blocks nobody, and an import
that fails fails on its own rank only.

Three kinds of process ask three ways, behind one :meth:`need`:

- the reader (world rank 0) answers itself, in the asking thread;
- a leader hands the key to its own relay thread and waits on a lock;
- any other rank sends a message on the job's request communicator and
  polls for the answer on the reply communicator, with a tag of its own
  per request, so that threads of one rank can ask at the same time.

Requests and answers, like the relay's pushes, go in pieces
(:mod:`~mpistage.runtime.bulk`): no message exceeds
:func:`~mpistage.runtime.bulk.step` bytes, whatever its size.

Every request ends, and within a bound: with the answer, with ``"closed"``
once the live session has ended, or with ``"late"`` when nothing moved
for :data:`WAIT` seconds (``MPISTAGE_LIVE_WAIT``). The bound is on
progress, not on the whole answer: while the node's leader takes in bytes
(the node's copy counts them, :func:`~.mirror.taken`), a request waits on,
so the gigabytes of a GPU library that keep arriving are never abandoned.
The caller then imports the plain way, from the originals: correct, only
slower. A late answer is not waited for: the answering thread (the
leader's relay, the reader on rank 0) runs only when its rank's main
thread lets go of the GIL, and a program or C extension may block in MPI
holding it (mpi4py's first lowercase reduction on a new communicator
does), until this very rank reaches the same call. After one late request
the rank asks nothing more until that answer has come (it imports the
plain way meanwhile), so a stalled reader costs a rank one wait, not one
per import.
"""

import _thread

from mpistage import Backoff
from mpistage.settings import SETTINGS

REQUEST, FORWARD, PUSH, BODY, BYE, END = range(1, 7)
FIRST_REPLY = 16  # reply tags are FIRST_REPLY .. MPI_TAG_UB
CLOSED = "closed"
LATE = "late"
WAIT = SETTINGS["MPISTAGE_LIVE_WAIT"].default  # seconds a rank waits for an answer
POLL_MIN, POLL_MAX = 0.00002, 0.001  # seconds between polls for an answer
PROGRESS_LOOK = 1.0  # seconds between looks at the node's progress while waiting
LOGGED = "logged"  # an answer read in the node's log, not received


def dumps(value):
    """Pickle *value* for a message."""
    import pickle

    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def receive(comm, message, status):
    """Receive the matched *message* (pickled bytes, in pieces); return them."""
    from mpistage.runtime.bulk import take

    return take(comm, message, status)


class ReaderClient:
    """World rank 0: its own relay resolves the key, in this thread."""

    def __init__(self, relay, wait=WAIT):
        self.relay, self.wait = relay, wait

    def need(self, key):
        """Return ``None`` once the node's copy answers *key*, or ``"closed"``.

        Before the program goes on, the push leaves for the other nodes
        (:meth:`~.relay.Relay.drain`).
        """
        result = self.relay.resolve(key)
        self.relay.drain(self.wait)
        return result

    def close(self):
        """Nothing to close: the relay ends itself."""


class LeaderClient:
    """A node leader: its relay thread takes the key; this thread waits, bounded."""

    def __init__(self, relay, wait=WAIT):
        self.relay, self.wait, self.overdue = relay, wait, []
        self.lock = _thread.allocate_lock()

    def need(self, key):
        """Return ``None`` once the node's copy answers *key*; or why not."""
        if not self.caught_up():
            return LATE
        waiter = self.relay.submit(key)
        if not moving(lambda t: waiter.done.acquire(timeout=t), self.taken, self.wait):
            with self.lock:
                self.overdue.append(waiter)
            return LATE
        self.relay.drain(self.wait)  # what this leader passes on leaves first
        return waiter.result

    def taken(self):
        """The bytes this node's copy has taken in so far."""
        return self.relay.writer.taken

    def caught_up(self):
        """Whether every late request has had its answer by now."""
        with self.lock:
            self.overdue = [w for w in self.overdue if not w.done.acquire(False)]
            return not self.overdue

    def close(self):
        """Nothing to close: the relay answers what is left."""


def moving(done, taken, wait):
    """Wait until ``done(timeout)`` says so; ``False`` once nothing moved for *wait* s.

    *taken* returns a count that grows while the answer is on its way (the
    bytes the node's copy has taken in).
    """
    import time

    seen, since = taken(), time.monotonic()
    while True:
        left = since + wait - time.monotonic()
        if left <= 0:
            now = taken()
            if now == seen:
                return False
            seen, since, left = now, time.monotonic(), wait
        if done(min(left, PROGRESS_LOOK)):
            return True


class RankClient:
    """Any other rank: one message to the leader, the answer polled."""

    def __init__(self, serve, reply, leader, wait=WAIT, copy=None):
        from mpi4py import MPI

        self.serve, self.reply, self.leader = serve, reply, leader
        self.lock, self.tag, self.closed = _thread.allocate_lock(), FIRST_REPLY, False
        self.span = serve.Get_attr(MPI.TAG_UB) - FIRST_REPLY
        self.wait, self.overdue = wait, {}  # tag: sends of a late request
        self.stray = {}  # tag: sends of a request answered by the node's log
        self.copy = copy  # the node's copy: what it has taken in, and answered

    def next_tag(self):
        """Return a reply tag no other request of this rank is using."""
        with self.lock:
            tag = self.tag
            self.tag = FIRST_REPLY + (tag - FIRST_REPLY + 1) % self.span
        return tag

    def need(self, key):
        """Return ``None`` once the node's copy answers *key*; or why not."""
        import pickle

        from mpi4py import MPI

        from mpistage.runtime.bulk import post

        if self.closed:
            return CLOSED
        if not self.caught_up():
            return LATE
        tag = self.next_tag()
        with self.lock:  # pieces of two threads' requests must not interleave
            sent = post(self.serve, dumps((tag, key)), self.leader, REQUEST)
        status, got = MPI.Status(), []

        def answered(timeout):
            message = self.poll(tag, key, status, timeout)
            if message is LOGGED:
                got.append(LOGGED)
            elif message is not None:
                got.append(pickle.loads(receive(self.reply, message, status)))
            return bool(got) or self.closed

        if not moving(answered, self.copy.taken, self.wait):
            with self.lock:
                self.overdue[tag] = sent
            return LATE
        if not got:
            return CLOSED  # The leader may be gone: no answer will come.
        if got[0] is LOGGED:
            with self.lock:  # the leader's answer comes later: taken then
                self.stray[tag] = sent
            return None
        MPI.Request.Waitall(sent)
        return got[0]

    def poll(self, tag, key, status, timeout):
        """Look for the answer on *tag* (or in the node's log) for up to *timeout* s.

        Returns the message, :data:`LOGGED` (the leader logged *key* as
        answered: its thread may not run now, the copy holds the answer),
        or ``None``.
        """
        import time

        pauses = Backoff(POLL_MIN, POLL_MAX)
        deadline = time.monotonic() + timeout
        while True:
            message = self.reply.Improbe(self.leader, tag, status)
            if message is not None or self.closed:
                return message
            if self.copy.answers(key):
                return LOGGED
            if time.monotonic() > deadline:
                return None
            pauses.sleep()

    def caught_up(self):
        """Take the late answers that have come; whether none is missing now.

        Answers to requests the node's log answered first are taken too,
        but none is waited for.
        """
        from mpi4py import MPI

        status = MPI.Status()
        with self.lock:  # threads of this rank may ask at the same time
            for waiting in (self.overdue, self.stray):
                for tag in list(waiting):
                    message = self.reply.Improbe(self.leader, tag, status)
                    if message is not None:
                        receive(self.reply, message, status)
                        MPI.Request.Waitall(waiting.pop(tag))
            return not self.overdue

    def close(self):
        """Stop asking: later requests, and those still waiting, get ``"closed"``.

        The answers still due for requests the node's log answered first
        are taken before MPI finalizes (for up to the wait): the leader
        sends each right after logging it, and an MPI finalizing with a
        message it never received may say so (UCX: "unexpected
        tag-receive descriptor ... was not matched").
        """
        import time

        self.closed = True
        self.caught_up()
        pauses, deadline = Backoff(POLL_MIN, POLL_MAX), time.monotonic() + self.wait
        while self.stray and time.monotonic() < deadline:
            pauses.sleep()
            self.caught_up()
