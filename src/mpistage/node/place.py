"""Where a node's copy lives: safe staging directories, per user and per job.

A node's place is ``<candidate>/mpistage-<uid>/job-<job>.n<node>``: per
user, per job and per (emulated) node, mode 0700. The candidates are the
entries of ``MPISTAGE_STAGE_DIR`` (``os.pathsep``-separated), then /dev/shm,
``$TMPDIR`` and /tmp unless ``MPISTAGE_STAGE_FALLBACK=no``. ``mpistage stage
--to DIR`` uses the same rules for ``DIR``.

The one rule for a safe directory, as ssh's StrictModes has it: the path is
resolved once, then opened component by component from ``/`` relative to
the parent's descriptor, never following a symlink, and every component
must belong to root or to us and must not be writable by others unless it
is sticky. Below it, everything is created relative to directory
descriptors opened once: another user can neither swap a component nor
redirect a file. Deleting is :mod:`~mpistage.node.cleanup`'s.

Squatting never stops one user's jobs: when ``mpistage-<uid>`` in a shared
candidate belongs to somebody else (or is unsafe), the job uses a private
directory with a random name in the same candidate,
``mpistage-<uid>-<random>``, created 0700 and checked, and removed with the
job's root. Roots are deleted, and roots of dead jobs reaped, by
:mod:`~mpistage.node.cleanup`.
"""

import os as _os

from mpistage import StageError

RAM_DISK = "/dev/shm"  # node-local memory: the first default candidate
DEFAULT_CANDIDATES = (RAM_DISK, "$TMPDIR", "/tmp")
OWNER_FILE = ".mpistage-owner"
RECORD_SIZE = 4096  # bytes of a key=value record read at most
PRIVATE_TRIES = 16  # random names tried for a private directory
DIR_FLAGS = _os.O_RDONLY | _os.O_DIRECTORY | _os.O_NOFOLLOW | _os.O_CLOEXEC


def candidates():
    """Return the staging candidates in order of preference."""
    from mpistage.settings import get

    found = list(get("MPISTAGE_STAGE_DIR"))
    if get("MPISTAGE_STAGE_FALLBACK"):
        found += [expand(p) for p in DEFAULT_CANDIDATES]
    return list(dict.fromkeys(p for p in found if p and not p.startswith("$")))


def expand(candidate):
    """Return a default candidate with its variable (``$TMPDIR``) put in, if set.

    Not ``os.path.expandvars``: that imports ``re``, which the node boot
    must not read from the shared file system before MPI.
    """
    if candidate.startswith("$"):
        return _os.environ.get(candidate[1:]) or candidate
    return candidate


class NodePlace:
    """A staging directory: its resolved path, and descriptors of it and its parent.

    *holder* is ``(descriptor, name)`` of a private per-user directory made
    for this root alone (see squatting), removed with it. *reused*: it held
    the bundle already (``mpistage stage`` into a complete stage of it).
    """

    def __init__(self, path, fd, parent_fd, holder=None, reused=False):
        self.path, self.fd, self.parent_fd = path, fd, parent_fd
        self.name = _os.path.basename(path or "")
        self.holder, self.reused = holder, reused
        self.made = False  # ``mpistage stage --to``: this process made the directory
        self.marks = {}  # and the stage marker's fields of who made it

    def close(self):
        """Close the descriptors (the directory stays)."""
        for fd in (self.fd, self.parent_fd, self.holder and self.holder[0]):
            if fd is not None:
                _os.close(fd)
        self.fd = self.parent_fd = self.holder = None


# -- the one rule for safe directories ------------------------------------------


def open_safe(path, create=False):
    """Open the directory *path* safely; return (resolved path, fd).

    Both the path as given and the path it resolves to must pass
    :func:`check_ancestor`; a symlink on the way must be ours or root's.
    With *create*, missing components are created, mode 0700.
    """
    path = _os.path.abspath(path)
    check_given(path)
    real = _os.path.realpath(path)
    fd = _os.open("/", DIR_FLAGS)
    try:
        check_ancestor(_os.fstat(fd), "/")
        done = ""
        for part in real.split("/")[1:]:
            done += "/" + part
            fd, old = step_into(fd, part, done, create), fd
            _os.close(old)
            check_ancestor(_os.fstat(fd), done)
    except BaseException:
        _os.close(fd)
        raise
    return real, fd


def step_into(fd, name, path, create=False):
    """Open (or with *create*, make) the directory *name* below *fd*, no symlink."""
    if create:
        try:
            _os.mkdir(name, 0o700, dir_fd=fd)
        except FileExistsError:
            pass
    return open_dir(fd, name, path)


def open_dir(parent_fd, name, path):
    """Open the directory *name* below *parent_fd*; refuse a symlink by name."""
    import stat

    try:
        return _os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        try:
            link = stat.S_ISLNK(_os.lstat(name, dir_fd=parent_fd).st_mode)
        except OSError:
            link = False
        reason = "is a symlink" if link else exc.strerror.lower()
        raise StageError(f"cannot use {path!r}: {reason}") from None


def check_given(path):
    """Check each component of *path* as given, symlinks included."""
    import stat

    done = ""
    for part in path.split("/")[1:]:
        done += "/" + part
        try:
            st = _os.lstat(done)
        except OSError:
            return  # Refused with its reason when it is opened.
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (0, _os.getuid()):
                raise StageError(
                    f"{done!r} is a symlink of uid {st.st_uid}, not yours or root's"
                )
        elif stat.S_ISDIR(st.st_mode):
            check_ancestor(st, done)


def check_ancestor(st, path):
    """Refuse a directory of another user, or one others may write unless sticky."""
    if st.st_uid not in (0, _os.getuid()):
        raise StageError(f"{path!r} is owned by uid {st.st_uid}, not by you or root")
    if st.st_mode & 0o022 and not st.st_mode & 0o1000:
        raise StageError(
            f"{path!r} is writable by others and not sticky "
            f"(mode {st.st_mode & 0o7777:o}); use another directory"
        )


def own_dir(parent_fd, name, path, tighten=True):
    """Create (0700) or open our directory *name* below *parent_fd*; return its fd."""
    try:
        _os.mkdir(name, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        pass  # Probably an earlier job of the same user; checked below.
    fd = open_dir(parent_fd, name, path)
    try:
        check_own(_os.fstat(fd), path, tighten)
    except BaseException:
        _os.close(fd)
        raise
    if tighten:
        _os.fchmod(fd, 0o700)  # Ours, perhaps readable by others: tighten.
    return fd


def check_own(st, path, strict):
    """Refuse a directory that is not ours, or (*strict*) that others may write."""
    if st.st_uid != _os.getuid():
        raise StageError(f"{path!r} is owned by uid {st.st_uid}, not {_os.getuid()}")
    if strict and st.st_mode & 0o022:
        raise StageError(
            f"{path!r} is writable by others (mode {st.st_mode & 0o777:o}); "
            "remove it or chmod 700 it"
        )


def room(fd, path, footprint):
    """Refuse *path* unless its file system has room for *footprint*.

    *footprint* (:class:`~mpistage.runtime.extract.Footprint`) counts the
    blocks the files will really take, and the inodes; its ``what`` (if
    any) names them in a refusal.
    """
    what = getattr(footprint, "what", "the bundle")
    st = _os.fstatvfs(fd)
    free, need = st.f_bavail * st.f_frsize, footprint.bytes(st.f_frsize)
    if free < need:
        raise StageError(
            f"no space left for {what} in {path!r}: {free} bytes free, {need} needed"
        )
    if st.f_files and st.f_favail < footprint.inodes:
        raise StageError(
            f"no inodes left for {what} in {path!r}: {st.f_favail} free, "
            f"{footprint.inodes} needed"
        )


# -- per-job places ------------------------------------------------------


def make_root(job, node, footprint, skip=(), reap=None):
    """Create this node's place in the first usable candidate.

    Candidates in *skip* (resolved paths) are passed over; *reap*, if given,
    is first called with each candidate's descriptor (to remove this user's
    roots of dead jobs there, :func:`mpistage.node.cleanup.reap_dead_roots`).
    Returns a
    :class:`NodePlace`, without its owner record (:func:`write_owner`). Raises
    :class:`StageError` naming every candidate and why it was refused when
    none can be used.
    """
    refused = []
    for candidate in candidates():
        try:
            return root_in(candidate, job, node, footprint, skip, reap)
        except (StageError, OSError) as exc:
            refused.append(refusal(candidate, exc))
    why = "; ".join(refused or ["none given"])
    raise StageError(f"no usable place for the node's copy: {why}")


def refusal(candidate, exc):
    """Say in a few words why *candidate* was refused."""
    if isinstance(exc, StageError):
        return str(exc)
    return f"{candidate!r}: {exc.strerror}"


def root_in(candidate, job, node, footprint, skip, reap=None):
    """Make the job's root below *candidate*; return its :class:`NodePlace`."""
    real, fd = open_safe(candidate)
    try:
        if real in skip:
            raise StageError(f"{real!r} ran out of space")
        if reap is not None:
            reap(fd)
        room(fd, real, footprint)
        user, user_fd, holder = user_dir(fd, real)
    except BaseException:
        _os.close(fd)
        raise
    if holder is None:
        _os.close(fd)  # The candidate is needed later only to remove a private dir.
    name = f"job-{job}.n{node}"
    try:
        _os.mkdir(name, 0o700, dir_fd=user_fd)
        root_fd = _os.open(name, DIR_FLAGS, dir_fd=user_fd)
    except BaseException:
        NodePlace(None, None, user_fd, holder).close()
        raise
    return NodePlace(f"{real}/{user}/{name}", root_fd, user_fd, holder)


def user_dir(fd, real):
    """Open this user's directory in the candidate *fd*; return (name, fd, holder).

    That is ``mpistage-<uid>``; if somebody else squats it, a new private
    ``mpistage-<uid>-<random>``, whose *holder* (the candidate's descriptor
    and its name) lets it be removed with the root.
    """
    user = f"mpistage-{_os.getuid()}"
    try:
        return user, own_dir(fd, user, f"{real}/{user}"), None
    except StageError as squatted:
        try:
            name, private = private_dir(fd, real)
        except (StageError, OSError) as exc:
            raise StageError(f"{squatted}; no private one either: {exc}") from None
        return name, private, (fd, name)


def private_dir(fd, real):
    """Create a new, randomly named per-user directory in *fd*; return (name, fd)."""
    for _attempt in range(PRIVATE_TRIES):
        name = f"mpistage-{_os.getuid()}-{_os.urandom(6).hex()}"
        try:
            _os.mkdir(name, 0o700, dir_fd=fd)
        except FileExistsError:
            continue
        return name, own_dir(fd, name, f"{real}/{name}")
    raise StageError(f"cannot make a private directory in {real!r}")


def write_owner(root, job, kind="job"):
    """Record who made *root*, so that ``mpistage clean`` can tell a dead job's."""
    from mpistage.node.cleanup import started

    host, pid = _os.uname().nodename, _os.getpid()
    fields = {"kind": kind, "host": host, "pid": pid, "start": started(), "job": job}
    write_fields(root.fd, OWNER_FILE, fields, _os.O_CREAT | _os.O_EXCL)


def mark_kept(root):
    """Note in *root*'s owner record that it outlives its job (``--keep``)."""
    write_fields(root.fd, OWNER_FILE, {"keep": "yes"}, _os.O_APPEND)


def read_owner(fd):
    """Return the owner record in the directory open as *fd*, or ``None``."""
    return read_fields(fd, OWNER_FILE) or None


# -- key=value records: the owner record, the stage marker ---------------------


def write_fields(fd, name, fields, how):
    """Write *fields* as ``key=value`` lines to *name* below *fd*, no symlink.

    *how* adds ``O_CREAT | O_EXCL`` (a new file) or ``O_APPEND`` flags.
    """
    flags = _os.O_WRONLY | _os.O_NOFOLLOW | _os.O_CLOEXEC | how
    out = _os.open(name, flags, 0o600, dir_fd=fd)
    try:
        _os.write(out, "".join(f"{k}={v}\n" for k, v in fields.items()).encode())
    finally:
        _os.close(out)


def read_fields(fd, name):
    """Return the ``key=value`` lines of *name* below *fd* (``{}`` if none).

    Only a regular file of this user counts: a record another user planted
    (in a directory of ours that others could write) is none.
    """
    import stat

    try:
        got = _os.open(name, _os.O_RDONLY | _os.O_NOFOLLOW | _os.O_CLOEXEC, dir_fd=fd)
    except OSError:
        return {}
    try:
        st = _os.fstat(got)
        if st.st_uid != _os.getuid() or not stat.S_ISREG(st.st_mode):
            return {}  # Not written by this user: it says nothing.
        text = _os.read(got, RECORD_SIZE).decode(errors="replace")
    finally:
        _os.close(got)
    return dict(line.partition("=")[::2] for line in text.splitlines() if "=" in line)


def target_dir(path):
    """Open or create ``mpistage stage --to`` *path* under the safe-directory rule."""
    path = _os.path.abspath(path)
    parent, name = _os.path.split(path)
    if not name:
        raise StageError(f"{path!r} is not a directory one can stage into")
    real_parent, parent_fd = open_safe(parent, create=True)
    try:
        try:
            _os.mkdir(name, 0o700, dir_fd=parent_fd)
            made = True
        except FileExistsError:
            made = False  # Checked below; never removed as ours, only emptied.
        fd = own_dir(parent_fd, name, path, tighten=False)
        check_ancestor(_os.fstat(fd), path)
    except BaseException:
        _os.close(parent_fd)
        raise
    found = NodePlace(f"{real_parent.rstrip('/')}/{name}", fd, parent_fd)
    found.made = made
    return found


def job_tag():
    """Return a name for this job, unique on the node: scheduler id, pid, time."""
    import time

    from mpistage.node.launch import job_id

    prefix = job_id() or _os.uname().nodename.split(".")[0]
    return f"{prefix}-{_os.getpid()}-{time.time_ns() % 10**9:09d}"


# -- the one writer of a file into a node's copy --------------------------------

WRITE_FLAGS = _os.O_WRONLY | _os.O_CREAT | _os.O_EXCL | _os.O_NOFOLLOW | _os.O_CLOEXEC


def write_new(fd, name, data, mode, mtime_ns=None):
    """Create the file *name* below the directory *fd* holding *data*.

    Never an existing name and never through a symlink (``O_EXCL |
    O_NOFOLLOW``): a name another process put there first is an error, not
    a file to write into. With *mtime_ns*, the file keeps its original's
    time (bytecode checks compare it). A file cut short by an error is
    removed again. The one writer of extraction, the live imports' mirror
    and the node boot's copy.
    """
    out = _os.open(name, WRITE_FLAGS, mode, dir_fd=fd)
    try:
        view, done = memoryview(data), 0
        while done < len(view):
            done += _os.write(out, view[done:])
        if mtime_ns is not None:
            _os.utime(out, ns=(mtime_ns, mtime_ns))
    except BaseException:
        _os.unlink(name, dir_fd=fd)
        raise
    finally:
        _os.close(out)
