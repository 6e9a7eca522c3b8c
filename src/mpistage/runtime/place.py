"""Where a node's copy lives: safe staging directories, and their removal.

A staging root is ``<candidate>/mpistage-<uid>/job-<job>.n<node>``: per
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
redirect a file. :func:`remove` is the one way anything staged is deleted.
"""

import errno as _errno
import os as _os

from mpistage import StageError

DEFAULT_CANDIDATES = ("/dev/shm", "$TMPDIR", "/tmp")
OWNER_FILE = ".mpistage-owner"
DIR_FLAGS = _os.O_RDONLY | _os.O_DIRECTORY | _os.O_NOFOLLOW | _os.O_CLOEXEC
_TRUE = ("1", "yes", "on", "true")
_FALSE = ("0", "no", "off", "false")


def flag(name, default):
    """Read a yes/no environment variable; reject anything else clearly."""
    value = _os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise StageError(f"{name}={value!r} must be one of yes/no/on/off/1/0")


def candidates():
    """Return the staging candidates in order of preference."""
    found = _os.environ.get("MPISTAGE_STAGE_DIR", "").split(_os.pathsep)
    if flag("MPISTAGE_STAGE_FALLBACK", True):
        found += [_os.path.expandvars(p) for p in DEFAULT_CANDIDATES]
    return list(dict.fromkeys(p for p in found if p and not p.startswith("$")))


class Root:
    """A staging directory: its resolved path, and descriptors of it and its parent."""

    def __init__(self, path, fd, parent_fd):
        self.path, self.fd, self.parent_fd = path, fd, parent_fd
        self.name = _os.path.basename(path)

    def close(self):
        """Close the descriptors (the directory stays)."""
        for fd in (self.fd, self.parent_fd):
            if fd is not None:
                _os.close(fd)
        self.fd = self.parent_fd = None


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
    try:
        return _os.open(name, DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        reason = "is a symlink" if _os.path.islink(path) else exc.strerror.lower()
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
    try:
        fd = _os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        reason = "is a symlink" if exc.errno == _errno.ELOOP else exc.strerror.lower()
        raise StageError(f"cannot use {path!r}: {reason}") from None
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


def room(fd, path, need):
    """Refuse *path* unless its file system has *need* bytes free."""
    st = _os.fstatvfs(fd)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise StageError(f"{path!r} has {free} bytes free, {need} needed")


# -- per-job staging roots ------------------------------------------------------


def make_root(job, node, need, skip=()):
    """Create this node's staging root in the first usable candidate.

    Candidates in *skip* (resolved paths) are passed over. Returns a
    :class:`Root`. Raises :class:`StageError` naming every candidate and why
    it was refused when none can be used.
    """
    refused = []
    for candidate in candidates():
        try:
            return root_in(candidate, job, node, need, skip)
        except (StageError, OSError) as exc:
            refused.append(refusal(candidate, exc))
    raise StageError("no usable staging root: " + "; ".join(refused or ["none given"]))


def refusal(candidate, exc):
    """Say in a few words why *candidate* was refused."""
    if isinstance(exc, StageError):
        return str(exc)
    return f"{candidate!r}: {exc.strerror}"


def root_in(candidate, job, node, need, skip):
    """Make the job's root below *candidate*; return its :class:`Root`."""
    real, fd = open_safe(candidate)
    try:
        if real in skip:
            raise StageError(f"{real!r} ran out of space")
        room(fd, real, need)
        user = f"mpistage-{_os.getuid()}"
        user_fd = own_dir(fd, user, f"{real}/{user}")
    finally:
        _os.close(fd)
    name = f"job-{job}.n{node}"
    try:
        _os.mkdir(name, 0o700, dir_fd=user_fd)
        fd = _os.open(name, DIR_FLAGS, dir_fd=user_fd)
        root = Root(f"{real}/{user}/{name}", fd, user_fd)
    except BaseException:
        _os.close(user_fd)
        raise
    write_owner(root, job)
    return root


def write_owner(root, job, kind="job"):
    """Record who made *root*, so that ``mpistage clean`` can tell a dead job's."""
    lines = f"kind={kind}\nhost={_os.uname().nodename}\npid={_os.getpid()}\njob={job}\n"
    flags = _os.O_WRONLY | _os.O_CREAT | _os.O_TRUNC | _os.O_NOFOLLOW | _os.O_CLOEXEC
    fd = _os.open(OWNER_FILE, flags, 0o600, dir_fd=root.fd)
    try:
        _os.write(fd, lines.encode())
    finally:
        _os.close(fd)


def read_owner(fd):
    """Return the owner record in the directory open as *fd*, or ``None``."""
    try:
        ofd = _os.open(OWNER_FILE, _os.O_RDONLY | _os.O_NOFOLLOW, dir_fd=fd)
    except OSError:
        return None
    try:
        text = _os.read(ofd, 4096).decode(errors="replace")
    finally:
        _os.close(ofd)
    return dict(line.partition("=")[::2] for line in text.splitlines() if "=" in line)


def target_dir(path):
    """Open or create ``mpistage stage --to`` *path* under the safe-directory rule."""
    path = _os.path.abspath(path)
    parent, name = _os.path.split(path)
    if not name:
        raise StageError(f"{path!r} is not a directory one can stage into")
    real_parent, parent_fd = open_safe(parent, create=True)
    try:
        fd = own_dir(parent_fd, name, path, tighten=False)
        check_ancestor(_os.fstat(fd), path)
    except BaseException:
        _os.close(parent_fd)
        raise
    return Root(f"{real_parent.rstrip('/')}/{name}", fd, parent_fd)


def job_tag():
    """Return a name for this job, unique on the node: scheduler id, pid, time."""
    import time

    for name in ("SLURM_JOB_ID", "FLUX_JOB_ID", "PBS_JOBID", "LSB_JOBID"):
        if _os.environ.get(name):
            prefix = _os.environ[name].split(".")[0]
            break
    else:
        prefix = _os.uname().nodename.split(".")[0]
    return f"{prefix}-{_os.getpid()}-{time.time_ns() % 10**9:09d}"


# -- the one removal path -------------------------------------------------------


def remove(root):
    """Remove the staging directory *root* and everything below it."""
    if root is None or root.parent_fd is None:
        return
    remove_entry(root.parent_fd, root.name)
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
    """Remove *name* below *parent_fd*, recursively, following no symlink.

    Another process may be removing the same tree (two ranks of a failing
    node): what is already gone is not an error.
    """
    try:
        _os.unlink(name, dir_fd=parent_fd)
        return
    except FileNotFoundError:
        return
    except (IsADirectoryError, PermissionError):
        pass  # A directory: empty it first.
    for _attempt in range(3):
        try:
            fd = _os.open(name, DIR_FLAGS, dir_fd=parent_fd)
            try:
                empty(fd)
            finally:
                _os.close(fd)
            _os.rmdir(name, dir_fd=parent_fd)
            return
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            if exc.errno != _errno.ENOTEMPTY:
                raise
            # A rank still running wrote bytecode meanwhile: empty it again.
