"""One staging of a bundle, from the first step to the removal of the copy.

:class:`Session` strings the steps together on every rank of a
communicator: topology → stage (read, check, broadcast and extract in one
pass) →
activate, and at the end deactivate → node barrier → removal. Both the
runner and the public :func:`staged` context manager are built on it.

Each step is agreed by all ranks, so an error raises the same
:class:`~mpistage.StageError` on every rank and the program may catch it.
If the program calls ``MPI.Finalize()`` itself while a session is open, the
session closes inside ``MPI_Finalize`` (a ``COMM_SELF`` attribute's delete
callback, which MPI runs while it can still communicate), so nothing is
left behind and nobody waits for a rank that has gone.

Only the process that made a session ends it: a child forked inside one
(``os.fork``, ``multiprocessing`` with fork) that leaves the block or exits
undoes the import hooks in itself and touches nothing else, neither MPI nor
the node's copy.
"""

import contextlib as _contextlib
import os as _os
import time as _time

from mpistage import StageError
from mpistage.node.cleanup import at_finalize
from mpistage.runtime.collective import attempt, barrier


class Session:
    """A bundle staged on one rank's node, and what it changed."""

    def __init__(self, comm, bundle, validate="default", keep=False, **how):
        """*how*: ``topology`` (found already), ``watch`` (default ``True``:
        close inside ``MPI_Finalize`` if the program calls it first; the
        runner ends the job itself)."""
        from mpistage.runtime.validate import MODES

        if validate not in MODES:
            raise ValueError(f"validate={validate!r}: use one of {', '.join(MODES)}")
        self.comm, self.bundle = comm, bundle
        self.validate, self.keep = validate, keep
        self.topology, self.watch = how.get("topology"), how.get("watch", True)
        self.staged = self.activation = self.cancel_watch = None
        self.seconds, self.closed = {}, False
        self.pid = _os.getpid()

    @property
    def forked(self):
        """Whether this is a child forked after the session began."""
        return _os.getpid() != self.pid

    def timed(self, step, func, *args):
        """Run *func* as *step*, recording this rank's seconds."""
        start = _time.perf_counter()
        try:
            return func(*args)
        finally:
            self.seconds[step] = _time.perf_counter() - start

    def discover(self):
        """Find the nodes (collective); return the topology."""
        from mpistage.runtime.topology import discover

        if self.topology is None:
            self.topology = self.timed(
                "topology", attempt, self.comm, discover, self.comm
            )
        return self.topology

    def start(self):
        """Stage the bundle and serve its imports (collective)."""
        from mpistage.runtime import stage

        self.discover()
        bundle, verdict = self.timed(
            "read", stage.read, self.comm, self.bundle, "packages", self.staleness
        )
        if verdict:
            raise StageError(verdict)
        self.spread(bundle)
        return self

    def staleness(self, manifest):
        """Rank 0: the staleness verdict of the bundle, or ``None``."""
        from mpistage.runtime.validate import changed, stale_message

        start = _time.perf_counter()
        found = changed(manifest, self.validate)
        self.seconds["validate"] = _time.perf_counter() - start
        return stale_message(self.bundle, found) if found else None

    def spread(self, bundle):
        """Bring the bundle rank 0 opened and checked to every node; activate.

        The report's ``broadcast`` step is the bytes' one pass (read, sent
        and written at once), ``stage`` the places made and marked done.
        """
        from mpistage.node.place import job_tag
        from mpistage.runtime import stage
        from mpistage.runtime.activate import activate

        topo = self.topology
        tag = self.comm.bcast(job_tag() if self.comm.rank == 0 else None, root=0)
        place = stage.JobPlace(tag, topo.index, self.keep)
        clock = {"broadcast": 0.0, "stage": 0.0}
        try:
            self.staged = stage.distribute(topo, bundle, place, self.bundle, clock)
        finally:
            self.seconds.update(clock)
        if self.watch:
            self.cancel_watch = at_finalize(self.close, self.comm)
        self.activation = self.timed(
            "activate", attempt, self.comm, activate, self.staged
        )

    def close(self):
        """Undo activation; between two node barriers, the leader removes the copy."""
        from mpi4py import MPI

        if self.closed:
            return
        self.closed = True
        if self.forked:
            self.deactivate()
            return
        if self.cancel_watch is not None:
            self.cancel_watch()
        self.deactivate()
        alive = self.topology is not None and not MPI.Is_finalized()
        if alive:
            barrier(self.topology.node)
        self.remove()
        if alive:  # every rank leaves once its node's copy is gone
            barrier(self.topology.node)

    def deactivate(self):
        """Undo activation in this process."""
        from mpistage.runtime.activate import deactivate

        if self.activation is not None:
            deactivate(self.activation)
            self.activation = None

    def remove(self):
        """The leader removes its node's copy (unless kept); no MPI needed."""
        from mpistage.node.cleanup import release

        root = self.staged.root if self.staged else None
        if root is not None and not self.keep:
            release(root)

    def leave(self):
        """Mark the session ended without undoing anything: the job is aborting.

        Each leader's watchdog removes its node's copy once the job is gone.
        """
        self.closed = True

    def abandon(self):
        """Remove this node's copy now, from any rank: the job is ending badly.

        Best effort: what cannot be removed now, the leader's watchdog removes
        when the job is gone.
        """
        from mpistage.node.cleanup import release, remove_path

        self.closed = True
        if self.staged is None or self.keep or self.forked:
            return
        try:
            if self.staged.root is not None:
                release(self.staged.root)
            else:
                remove_path(self.staged.path)
        except (OSError, StageError):
            pass


@_contextlib.contextmanager
def staged(bundle, comm, validate="default", keep=False):
    """Stage *bundle* on every node of *comm* and serve its imports (collective).

    Inside the block, modules of the bundle are imported from this node's
    copy. On exit the import hooks are removed, ``sys.path_hooks`` is as
    before, and the node's copy is removed (unless *keep*). Errors raise
    :class:`~mpistage.StageError` on every rank of *comm*.
    """
    session = Session(comm, bundle, validate, keep)
    try:
        session.start()
    except StageError:
        session.close()
        raise
    try:
        yield session
    finally:
        session.close()
