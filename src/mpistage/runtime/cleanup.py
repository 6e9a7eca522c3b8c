"""Every exit path removes the node's copy: the leader's guards.

A node's copy must not outlive its job, however the job ends. Each leader
guards its root from the moment it exists, before the first byte is written,
three ways:

- the normal path (success, a nonzero exit, an exception) removes it in
  :func:`release`, which needs no MPI, so it also works after the program
  called ``MPI.Finalize()`` itself;
- SIGTERM and SIGHUP, which a batch system sends at the time limit and
  ``mpiexec`` forwards, remove it in a signal handler and then end the
  process with the same signal (SIGINT raises ``KeyboardInterrupt``, which
  takes the normal path);
- a watchdog: a ``/bin/sh`` spawned in its own session waits on a pipe
  that only the leader holds, and removes the root when the pipe closes.
  The leader closing it is the normal path; the kernel closing it is the
  leader being killed (``MPI_Abort`` kills the other ranks with SIGKILL,
  as does the batch system after its grace time).

Only the process that made a guard ends it: a forked child that exits (or
gets a signal) leaves its parent's copy alone. Roots that survive even this
(a launcher that kills a whole step, watchdogs included; a node that
crashed) are removed by the next job of the same user on the node
(:func:`mpistage.runtime.place.reap`) or by ``mpistage clean``.
"""

import _signal
import os as _os

WATCHDOG = 'cd / && while read -r _; do :; done; exec rm -rf -- "$1"'
SIGNALS = ("SIGTERM", "SIGHUP")
_guarded = {}


class Guard:
    """The watchdog of one root: its pid and the pipe that keeps it waiting."""

    def __init__(self, root):
        self.root, self.pid, self.pipe = root, None, None
        self.owner = _os.getpid()
        try:
            self.pid, self.pipe = spawn_watchdog(root.path)
        except OSError:
            pass  # No /bin/sh: the signal handlers and `mpistage clean` remain.


def spawn_watchdog(path):
    """Start the watchdog of *path*; return (its pid, the pipe's write end)."""
    read_end, write_end = _os.pipe()
    try:
        pid = _os.posix_spawn(
            "/bin/sh",
            ["sh", "-c", WATCHDOG, "mpistage-watchdog", path],
            {"PATH": "/usr/bin:/bin"},
            file_actions=[(_os.POSIX_SPAWN_DUP2, read_end, 0)],
            setsid=True,
        )
    except BaseException:
        _os.close(write_end)
        raise
    finally:
        _os.close(read_end)
    return pid, write_end


def guard(root):
    """Protect the staging *root* on every exit path (leaders)."""
    _guarded[root.path] = Guard(root)
    for name in SIGNALS:
        sig = getattr(_signal, name)
        if _signal.getsignal(sig) in (_signal.SIG_DFL, None):
            _signal.signal(sig, on_signal)


def release(root):
    """Remove *root* and retire its watchdog (the normal path, no MPI needed)."""
    from mpistage.runtime.removal import remove

    if root is None or not mine(root):
        return
    remove(root)
    entry = _guarded.pop(root.path, None)
    if entry is not None and entry.pipe is not None:
        _os.close(entry.pipe)
        reap(entry.pid)


def disarm(root):
    """Stop guarding *root*, which stays (``--keep``): end its watchdog."""
    entry = _guarded.pop(root.path, None)
    if entry is None or entry.pipe is None:
        return
    _os.kill(entry.pid, _signal.SIGKILL)
    _os.close(entry.pipe)
    reap(entry.pid)


def mine(root):
    """Whether this process made the guard of *root* (not a forked child)."""
    entry = _guarded.get(root.path)
    return entry is None or entry.owner == _os.getpid()


def reap(pid):
    """Collect the watchdog's exit status if it ended within a moment."""
    import time

    for _ in range(50):
        try:
            done, _status = _os.waitpid(pid, _os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        time.sleep(0.002)


def release_all():
    """Remove every guarded root (a signal, or the last cleanup at exit)."""
    for entry in list(_guarded.values()):
        release(entry.root)


def on_signal(signum, frame):
    """Remove the copies, then end the process by the same signal."""
    release_all()
    _signal.signal(signum, _signal.SIG_DFL)
    _os.kill(_os.getpid(), signum)


# -- the program calls MPI.Finalize() itself -------------------------------------


def at_finalize(func, comm):
    """Run *func* inside ``MPI_Finalize`` if the program calls it first.

    MPI runs the delete callbacks of ``COMM_SELF``'s attributes at the start
    of ``MPI_Finalize``, while it can still communicate, so the end of a job
    (a report, a learned bundle, the copy's removal) can still be collective
    there. A failure in *func* is printed on rank 0 of *comm* and aborts the
    job: a callback must not raise. Returns a function that cancels the
    watch, for when the job ends by itself.
    """
    from mpi4py import MPI

    state = {"done": False}

    def on_finalize(self_comm, keyval, value):
        if state["done"]:
            return MPI.SUCCESS
        state["done"] = True
        try:
            func()
        except BaseException as exc:  # noqa: BLE001  (a callback must not raise)
            from mpistage.runtime.collective import describe

            if comm.rank == 0:
                import sys

                print(f"mpistage: error: {describe(exc)}", file=sys.stderr, flush=True)
            comm.Abort(1)
        return MPI.SUCCESS

    keyval = MPI.COMM_SELF.Create_keyval(delete_fn=on_finalize)
    MPI.COMM_SELF.Set_attr(keyval, None)

    def cancel():
        if not state["done"] and not MPI.Is_finalized():
            state["done"] = True
            MPI.COMM_SELF.Delete_attr(keyval)

    return cancel
