"""Step 4 of the runner: each node leader writes the bundle to a private root.

The staging root is ``<candidate>/mpistage-<uid>/job-<job>.n<node>``:
per user, per job and per (emulated) node, mode 0700. The candidates are the
entries of ``MPISTAGE_STAGE_DIR`` (``os.pathsep``-separated), then /dev/shm,
``$TMPDIR`` and /tmp unless ``MPISTAGE_STAGE_FALLBACK=no``. The first
candidate that is a directory with room for the bundle, and whose user
directory is safe, is used; a refused candidate is reported with its reason.

Safety: the user directory is created with mode 0700 and opened with
``O_NOFOLLOW``; a symlink, a directory owned by someone else, or one that
others can write to is refused. The job directory is created fresh inside
it, so no file of the job can be redirected by another user.
"""

import hashlib as _hashlib
import os as _os

from mpistage.errors import StageError

DEFAULT_CANDIDATES = ("/dev/shm", "$TMPDIR", "/tmp")
OWNER_FILE = ".mpistage-owner"
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
    found = [p for p in _os.environ.get("MPISTAGE_STAGE_DIR", "").split(_os.pathsep)]
    if flag("MPISTAGE_STAGE_FALLBACK", True):
        found += [_os.path.expandvars(p) for p in DEFAULT_CANDIDATES]
    unique = []
    for path in found:
        if path and not path.startswith("$") and path not in unique:
            unique.append(path)
    return unique


def user_dir(candidate):
    """Return ``<candidate>/mpistage-<uid>``, created 0700 and checked safe."""
    path = _os.path.join(candidate, f"mpistage-{_os.getuid()}")
    try:
        _os.mkdir(path, 0o700)
    except FileExistsError:
        pass  # Probably an earlier job of the same user; checked below.
    try:
        fd = _os.open(path, _os.O_RDONLY | _os.O_DIRECTORY | _os.O_NOFOLLOW)
    except OSError as exc:
        reason = "is a symlink" if _os.path.islink(path) else exc.strerror
        raise StageError(f"{path!r} {reason}") from None
    try:
        st = _os.fstat(fd)
        check_owned(st, path)
        if st.st_mode & 0o077:
            _os.fchmod(fd, 0o700)  # Ours, but readable by others: tighten.
    finally:
        _os.close(fd)
    return path


def check_owned(st, path):
    """Refuse a directory that is not ours alone."""
    if st.st_uid != _os.getuid():
        raise StageError(f"{path!r} is owned by uid {st.st_uid}, not {_os.getuid()}")
    if st.st_mode & 0o022:
        raise StageError(
            f"{path!r} is writable by others (mode {st.st_mode & 0o777:o}); "
            "remove it or chmod 700 it"
        )


def room(path, need):
    """Refuse *path* unless its file system has *need* bytes free."""
    st = _os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise StageError(f"{path!r} has {free} bytes free, {need} needed")


def make_root(job, node, need):
    """Create this node's staging root in the first usable candidate.

    Returns the root's path. Raises :class:`StageError` naming every
    candidate and why it was refused when none can be used.
    """
    refused = []
    for candidate in candidates():
        try:
            if not _os.path.isdir(candidate):
                raise StageError(f"{candidate!r} is not a directory")
            room(candidate, need)
            return job_dir(user_dir(candidate), job, node)
        except (StageError, OSError) as exc:
            refused.append(
                str(exc)
                if isinstance(exc, StageError)
                else f"{candidate!r}: {exc.strerror}"
            )
    raise StageError("no usable staging root: " + "; ".join(refused or ["none given"]))


def job_dir(parent, job, node):
    """Create the fresh 0700 job directory and record who owns it."""
    import json
    import socket

    path = _os.path.join(parent, f"job-{job}.n{node}")
    _os.mkdir(path, 0o700)
    owner = {"host": socket.gethostname(), "pid": _os.getpid(), "job": job}
    with open(_os.path.join(path, OWNER_FILE), "x") as f:
        json.dump(owner, f)
    return path


def destinations(manifest):
    """Return, per bundled root, its directory below the staging root.

    Runner bundles keep root *i* in ``r<i>``; environment bundles say where
    each root goes (``dest``), so that several roots merge into one prefix.
    """
    return [root.get("dest", f"r{i}") for i, root in enumerate(manifest["roots"])]


def write_tree(root, buf, manifest, name):
    """Verify and write every member of the bundle *buf* below *root*."""
    view, dests = memoryview(buf), destinations(manifest)
    for dest in dict.fromkeys(dests):
        _os.makedirs(_os.path.join(root, dest), mode=0o700, exist_ok=True)
    for member in manifest["members"]:
        write_member(staged_path(root, dests, member), view, member, name)
    for member in reversed(manifest["members"]):
        if member["type"] == "dir":
            path = staged_path(root, dests, member)
            _os.utime(path, ns=(member["mtime_ns"], member["mtime_ns"]))


def staged_path(root, dests, member):
    """Return where *member* lands below the staging *root*."""
    rel = _os.path.normpath(_os.path.join(dests[member["root"]], member["rel"]))
    if rel.startswith(("..", "/")):
        raise StageError(f"bundle member {member['rel']!r} escapes its root")
    return _os.path.join(root, rel)


def write_member(path, view, member, name):
    """Write one file, directory or symlink, checking a file's checksum."""
    _os.makedirs(_os.path.dirname(path), mode=0o755, exist_ok=True)
    kind, mode = member["type"], member["mode"] & 0o777
    if kind == "dir":
        _os.makedirs(path, mode=mode | 0o700, exist_ok=True)
    elif kind == "link":
        _os.symlink(member["target"], path)
    else:
        data = view[member["offset"] : member["offset"] + member["size"]]
        if _hashlib.sha256(data).hexdigest() != member["sha256"]:
            raise StageError(
                f"bundle {name!r} is corrupt: checksum mismatch in {member['rel']!r}"
            )
        write_file(path, data, mode | 0o400, member["mtime_ns"])


def write_file(path, data, mode, mtime_ns):
    """Create *path* (never following a symlink) with *data*, *mode*, mtime."""
    flags = _os.O_WRONLY | _os.O_CREAT | _os.O_EXCL | _os.O_NOFOLLOW
    fd = _os.open(path, flags, mode)
    try:
        done = 0
        while done < len(data):
            done += _os.write(fd, data[done:])
        _os.utime(fd, ns=(mtime_ns, mtime_ns))
    finally:
        _os.close(fd)


def remove_root(root):
    """Remove a staging root and everything below it."""
    import shutil

    if root and _os.path.isdir(root):
        shutil.rmtree(root, ignore_errors=True)
