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
(:func:`reap_dead_roots`, crash-only cleanup: the rules of ``mpistage
clean``, same host, leader gone or a zombie, not kept with ``--keep``) or by
``mpistage clean``.

:func:`remove` is the one way anything staged is deleted. Its walk is a
loop, not a recursion, and holds two descriptors at most, however deep the
tree (a bundle, or the program, chooses the depth); it never follows a
symlink, and it checks that ``..`` leads back to the directory it came from.
"""

import _signal
import errno as _errno
import os as _os

from mpistage import StageError
from mpistage.node.place import DIR_FLAGS, check_own, open_safe, read_owner

# The watchdog renames the root before it removes it: a removal cut short
# (the node's processes killed, the job's end) leaves a name that says so,
# and the next job, or `mpistage clean`, finishes it (:func:`stale_root`).
REMOVING = ".removing-"
WATCHDOG = (
    "cd / && while read -r _; do :; done; "
    f't="$1{REMOVING}$$"; mv -- "$1" "$t" 2>/dev/null || t="$1"; exec rm -rf -- "$t"'
)
SIGNALS = ("SIGTERM", "SIGHUP")
COLLECT_TRIES, COLLECT_PAUSE = 50, 0.002  # a watchdog gets 0.1 s to end
_guarded = {}
_forks = []  # whether forked children are told to drop the handlers


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
    if not _forks:
        _forks.append(_os.register_at_fork(after_in_child=default_signals))
    _guarded[root.path] = Guard(root)
    for name in SIGNALS:
        sig = getattr(_signal, name)
        if _signal.getsignal(sig) in (_signal.SIG_DFL, None):
            _signal.signal(sig, on_signal)


def default_signals():
    """In a forked child: the signals end it as they would without mpistage.

    The copies are the parent's; and a ``multiprocessing`` worker blocked on
    its queue's lock may never run a Python handler, so ``Pool.terminate``
    would wait for it for ever.
    """
    for name in SIGNALS:
        sig = getattr(_signal, name)
        if _signal.getsignal(sig) is on_signal:
            _signal.signal(sig, _signal.SIG_DFL)


def release(root):
    """Remove *root* and retire its watchdog (the normal path, no MPI needed)."""
    if root is None or not mine(root):
        return
    remove(root)
    entry = _guarded.pop(root.path, None)
    if entry is not None and entry.pipe is not None:
        _os.close(entry.pipe)
        collect(entry.pid)


def disarm(root):
    """Stop guarding *root*, which stays (``--keep``): end its watchdog."""
    entry = _guarded.pop(root.path, None)
    if entry is None or entry.pipe is None:
        return
    _os.kill(entry.pid, _signal.SIGKILL)
    _os.close(entry.pipe)
    collect(entry.pid)


def mine(root):
    """Whether this process made the guard of *root* (not a forked child)."""
    entry = _guarded.get(root.path)
    return entry is None or entry.owner == _os.getpid()


def collect(pid):
    """Collect the watchdog's exit status if it ended within a moment."""
    import time

    for _ in range(COLLECT_TRIES):
        try:
            done, _status = _os.waitpid(pid, _os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        time.sleep(COLLECT_PAUSE)


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
    """Run *func* before MPI finalizes, if the program finalizes it first.

    A program's ``MPI.Finalize()`` runs *func* first, then mpi4py's own:
    while *func* runs MPI is whole, and a thread of ours may end its MPI
    calls before ``MPI_Finalize`` begins, as the standard requires (MPICH
    stops locking before its first callback). A ``MPI_Finalize`` from C
    runs *func* in the delete callback of an attribute of ``COMM_SELF``,
    at its start, where MPI can still communicate: the end of a job (a
    report, a learned bundle, the copy's removal) stays collective either
    way. A failure in *func* is printed on rank 0 of *comm* and aborts the
    job. Returns a function that cancels the watch, for when the job ends
    by itself.
    """
    from mpi4py import MPI

    state = {"done": False}

    def once():
        if state["done"]:
            return
        state["done"] = True
        try:
            func()
        except BaseException as exc:  # noqa: BLE001  (a callback must not raise)
            say_failure(comm, exc)
            comm.Abort(1)

    def on_finalize(self_comm, keyval, value):
        once()
        return MPI.SUCCESS

    keyval = MPI.COMM_SELF.Create_keyval(delete_fn=on_finalize)
    MPI.COMM_SELF.Set_attr(keyval, None)
    ends_first(MPI)
    ENDS.append(once)

    def cancel():
        if once in ENDS:
            ENDS.remove(once)
        if not state["done"] and not MPI.Is_finalized():
            state["done"] = True
            MPI.COMM_SELF.Delete_attr(keyval)

    return cancel


ENDS = []  # what ``MPI.Finalize()`` runs first, the latest first


def ends_first(MPI):
    """Make ``MPI.Finalize`` run :data:`ENDS` first (once per process).

    One wrapper, whatever the number of watches (a ``staged()`` block each),
    under mpi4py's name.
    """
    finalize = MPI.Finalize
    if getattr(finalize, "mpistage_ends", None) is ENDS:
        return

    def wrapper():
        while ENDS:
            ENDS.pop()()
        finalize()

    for name in ("__name__", "__qualname__", "__doc__", "__module__"):
        setattr(wrapper, name, getattr(finalize, name, None))
    wrapper.__wrapped__, wrapper.mpistage_ends = finalize, ENDS
    MPI.Finalize = wrapper


# -- roots of dead jobs (crash-only cleanup) --------------------------------------


def reap_dead_roots(candidate_fd):
    """Remove this user's roots of dead jobs in a candidate (crash-only cleanup).

    Anything that is not plainly ours is left alone: somebody else's
    directory, a root without an owner record, or one of a live leader.
    """
    for name in user_dirs(candidate_fd):
        try:
            fd = _os.open(name, DIR_FLAGS, dir_fd=candidate_fd)
        except OSError:
            continue
        try:
            check_own(_os.fstat(fd), name, True)
            for name in sorted(_os.listdir(fd)):
                remove_if_stale(fd, name)
        except (StageError, OSError):
            continue  # Not ours, or changing under us: `mpistage clean` remains.
        finally:
            _os.close(fd)


def user_dirs(fd):
    """Return this user's directories in the candidate *fd*, private ones too."""
    user = f"mpistage-{_os.getuid()}"
    with _os.scandir(fd) as entries:
        return sorted(
            e.name for e in entries if e.name == user or e.name.startswith(user + "-")
        )


def stale_roots(fd, kept_too=False):
    """Yield the roots in this user's directory *fd* whose job is dead here.

    Kept roots (``--keep``) count only with *kept_too* (``mpistage clean``).
    """
    for name in sorted(_os.listdir(fd)):
        if stale_root(fd, name, kept_too) is not None:
            yield name


def stale_root(fd, name, kept_too=False):
    """Return the inode of the root *name* below *fd* if its job is dead here."""
    try:
        root_fd = _os.open(name, DIR_FLAGS, dir_fd=fd)
    except OSError:
        return None
    try:
        ino, owner = _os.fstat(root_fd).st_ino, read_owner(root_fd)
    finally:
        _os.close(root_fd)
    if REMOVING in name:  # a removal cut short: finish it (two at once do no harm)
        return ino
    if not owner or owner.get("host") != _os.uname().nodename:
        return None
    if alive(owner.get("pid"), owner.get("start")):
        return None
    if not kept_too and owner.get("keep") == "yes":
        return None
    return ino


def remove_if_stale(fd, name):
    """Remove the root *name* if its job is dead, and it is still the one judged.

    Ranks of one node reap at the same time: the name of a dead root one
    of them removed may already be a new root of a live job, made since;
    what is renamed to be removed is judged again (:func:`doom`).
    """
    ino = stale_root(fd, name)
    if ino is None or inode(fd, name) != ino:
        return
    doom(fd, name, lambda doomed: not dead_root(fd, doomed, ino))


def dead_root(fd, name, ino):
    """Whether *name* below *fd* is the root of inode *ino*, its owner gone.

    An inode number is reused as soon as it is free, so the owner record is
    read again too: a new root has a live owner, or none written yet.
    """
    try:
        root_fd = _os.open(name, DIR_FLAGS, dir_fd=fd)
    except OSError:
        return False
    try:
        same, owner = _os.fstat(root_fd).st_ino == ino, read_owner(root_fd)
    finally:
        _os.close(root_fd)
    return same and bool(owner) and not alive(owner.get("pid"), owner.get("start"))


def doom(fd, name, keep=None):
    """Remove *name* below *fd*, renamed first to a name that says it is going.

    Crash-only: a removal cut short at any point leaves either the whole
    entry, still judged by its owner record, or a ``NAME.removing-PID``
    that the next reaper removes without judging (nobody else makes one).
    With *keep*, what was renamed is judged again by ``keep(new name)``:
    if it is to be kept (a sibling removed the judged entry and made a new
    one of that name between the judging and the rename), it is put back,
    and nothing is removed.
    """
    if REMOVING in name:
        return remove_entry(fd, name)
    doomed = f"{name}{REMOVING}{_os.getpid()}"
    try:
        _os.rename(name, doomed, src_dir_fd=fd, dst_dir_fd=fd)
    except FileNotFoundError:
        return None  # Another rank of the node is removing it.
    except OSError:
        doomed = name  # A doomed name of ours left by a remover we replace.
    if keep is not None and doomed != name and keep(doomed):
        try:
            _os.rename(doomed, name, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError:
            pass
        return None
    return remove_entry(fd, doomed)


def inode(fd, name):
    """The inode of *name* below *fd* (no link followed), or ``None``."""
    try:
        return _os.stat(name, dir_fd=fd, follow_symlinks=False).st_ino
    except OSError:
        return None


# -- which processes still run ------------------------------------------------------
# Judged by what no other user can forge. A bare pid decides nothing:
# another user can fork until they hold it (``pid_max`` is often 32768),
# and ``kill -0`` answers ``EPERM`` for another user's process (Slurm's
# ``slurmstepd`` is root's), which is no proof that it is gone. So a
# process is named by its pid *and* its start time (``/proc/PID/stat``,
# clock ticks after boot): a later process given the same pid started
# later. ``/proc`` says both of any process, whoever owns it;
# ``bin/mpistage-env`` reads the same field the same way in ``sh``.


def alive(pid, start=None):
    """Whether the process *pid* (started at *start*, if given) runs on this host.

    A zombie does not. *start* is the process's start time from
    :func:`started` (clock ticks after boot): with it, another process that
    has since been given the same pid, by chance or by another user's
    forking, is not taken for the one recorded. ``/proc`` says this of any
    process, whoever owns it (``kill -0`` cannot: another user's process
    answers ``EPERM``).
    """
    found = stat_fields(pid)
    if found is None or found[0] in ("Z", "X"):
        return False
    return start in (None, "") or str(start) == found[19]


def started(pid=None):
    """The start time of the process *pid* (this one by default), as text."""
    found = stat_fields(_os.getpid() if pid is None else pid)
    return "" if found is None else found[19]


def stat_fields(pid):
    """The fields of ``/proc/PID/stat`` after the command's name, or ``None``."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except (OSError, ValueError, TypeError):
        return None
    return fields if len(fields) > 19 else None


def owner_alive(owner):
    """Whether the owner ``HOST:PID[:START]`` is a process that runs on this host."""
    host, _, rest = owner.partition(":")
    pid, _, start = rest.partition(":")
    return host == _os.uname().nodename and pid.isdigit() and alive(pid, start)


# -- the one removal path ---------------------------------------------------------


def remove(root):
    """Remove the staging directory *root* and everything below it."""
    if root is None or root.parent_fd is None:
        return
    remove_entry(root.parent_fd, root.name)
    if root.holder is not None:
        try:
            _os.rmdir(root.holder[1], dir_fd=root.holder[0])
        except OSError:
            pass  # Not empty any more: another root was made there meanwhile.
    root.close()


def remove_path(path):
    """Remove the staging directory at *path* (found again from its safe parent)."""
    parent, name = _os.path.split(path)
    real, fd = open_safe(parent)
    try:
        remove_entry(fd, name)
    finally:
        _os.close(fd)


def empty(fd):
    """Remove everything inside the directory open as *fd*."""
    with _os.scandir(fd) as entries:
        names = [entry.name for entry in entries]
    for name in names:
        remove_entry(fd, name)


def remove_entry(parent_fd, name):
    """Remove *name* below *parent_fd*, with everything below it.

    A loop, not a recursion, holding two descriptors at most: it goes down
    into the first non-empty directory, and back up through ``..`` once a
    directory is empty, checking that ``..`` is the directory it came from.
    No symlink is followed. Another process may be removing the same tree
    (two ranks of a failing node): what is already gone is not an error.
    """
    if unlink_or_rmdir(parent_fd, name):
        return
    try:
        fd = _os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except (FileNotFoundError, NotADirectoryError):
        return
    trail = [_os.fstat(fd)]
    try:
        while True:
            child = first_nonempty(fd)
            if child is not None:
                fd = descend(fd, child, trail)
            elif len(trail) > 1:
                fd = ascend(fd, trail)
            else:
                break
    finally:
        _os.close(fd)
    for _attempt in range(3):
        if unlink_or_rmdir(parent_fd, name):
            return
        # A rank still running wrote bytecode meanwhile: empty it again.
        fd = _os.open(name, DIR_FLAGS, dir_fd=parent_fd)
        try:
            if _os.fstat(fd).st_ino != trail[0].st_ino:
                return  # a new directory of that name, made since: not ours to empty
            empty(fd)
        finally:
            _os.close(fd)


def unlink_or_rmdir(fd, name):
    """Remove a file, link or empty directory; ``False`` if it is a full directory."""
    try:
        _os.unlink(name, dir_fd=fd)
        return True
    except FileNotFoundError:
        return True
    except (IsADirectoryError, PermissionError):
        pass
    try:
        _os.rmdir(name, dir_fd=fd)
        return True
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno in (_errno.ENOTEMPTY, _errno.EEXIST):
            return False
        raise


def first_nonempty(fd):
    """Remove what can go at once below *fd*; return a full subdirectory, or None."""
    with _os.scandir(fd) as entries:
        names = [entry.name for entry in entries]
    for name in names:
        if not unlink_or_rmdir(fd, name):
            return name
    return None


def descend(fd, name, trail):
    """Go down from *fd* into its directory *name*; return the new descriptor."""
    child = _os.open(name, DIR_FLAGS, dir_fd=fd)
    _os.close(fd)
    trail.append(_os.fstat(child))
    return child


def ascend(fd, trail):
    """Go up from *fd* to its parent, which must be the one we came from."""
    parent = _os.open("..", DIR_FLAGS, dir_fd=fd)
    _os.close(fd)
    trail.pop()
    st, want = _os.fstat(parent), trail[-1]
    if (st.st_dev, st.st_ino) != (want.st_dev, want.st_ino):
        _os.close(parent)
        raise StageError("a directory being removed was moved away")
    return parent


def say_failure(comm, exc):
    """Print one line for a failure that ends the job from inside ``MPI_Finalize``.

    An agreed error (:class:`~mpistage.StageError`) is the same on every
    rank: rank 0 says it. Any other failure is this rank's own: it says it,
    with its rank, so that the job never ends without a word.
    """
    import sys

    from mpistage import StageError, describe

    if isinstance(exc, StageError):
        if comm.rank == 0:
            print(f"mpistage: error: {describe(exc)}", file=sys.stderr, flush=True)
        return
    line = f"mpistage: error: rank {comm.rank}: {describe(exc)}"
    print(line, file=sys.stderr, flush=True)
