"""Step 4: each node leader writes the bundle's members below its root.

This is the one extraction function, used by the runner, by
:func:`mpistage.staged` and by ``mpistage stage``. A bundle is untrusted
input, so nothing it says may create, write or touch anything outside the
root: every directory is opened relative to its parent's descriptor with
``O_NOFOLLOW``, files are created with ``O_EXCL | O_NOFOLLOW``, and times
are set on descriptors or without following links. A symlink member is
created as it is, but no later member can be written through it, and a
member that tries is an error. Member paths and root destinations were
checked by :func:`mpistage.runtime.bundlefile.check` (relative, no ``..``).
"""

import errno as _errno
import os as _os

from mpistage import StageError
from mpistage.node.place import write_new

MAX_OPEN = 256


class NoSpace(StageError):
    """The node's place's file system filled up while writing."""


class Footprint:
    """What extracting a bundle really takes: blocks of its files, inodes.

    A file takes whole blocks, however small; a directory is counted as one
    block too. Bundle data ranges are disjoint (checked), so the files' sizes
    add up to no more than the bundle.
    """

    def __init__(self, manifest):
        members = manifest["members"]
        self.sizes = [m["size"] for m in members if m["type"] == "file"]
        self.dirs = sum(1 for m in members if m["type"] == "dir")
        self.inodes = len(members)

    def bytes(self, block):
        """Return the bytes the members take on a file system of *block* bytes."""
        block = max(1, block)
        return block * (sum(-(-size // block) for size in self.sizes) + self.dirs)


class Dirs:
    """Directories below a root, opened once each relative to their parent."""

    def __init__(self, root_fd):
        self.root_fd, self.fds = root_fd, {}

    def fd(self, rel):
        """Return a descriptor of the directory *rel* (``""``: the root), made 0700.

        Each missing directory on the way is opened from its parent, one
        component at a time (a loop: bundles choose the depth).
        """
        if not rel:
            return self.root_fd
        if rel not in self.fds:
            if len(self.fds) + rel.count("/") >= MAX_OPEN:
                self.close()
            parent, done = self.root_fd, ""
            for name in rel.split("/"):
                done = f"{done}/{name}" if done else name
                if done not in self.fds:
                    self.fds[done] = self.open(parent, name, done)
                parent = self.fds[done]
        return self.fds[rel]

    def open(self, parent_fd, name, rel):
        """Create (if needed) and open one directory, refusing a symlink."""
        from mpistage.node.place import DIR_FLAGS

        try:
            _os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass  # Made for an earlier member below it; opened as usual.
        try:
            return _os.open(name, DIR_FLAGS, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno in (_errno.ELOOP, _errno.ENOTDIR):
                raise StageError(f"bundle member {rel!r} is not a directory") from None
            raise

    def close(self):
        """Close every descriptor but the root's."""
        for fd in self.fds.values():
            _os.close(fd)
        self.fds = {}


def extract(root_fd, buf, manifest, name, path=None):
    """Write every member of the bundle *buf* below the directory *root_fd*.

    *path* is where *root_fd* is: a staged venv's ``pyvenv.cfg`` names it.
    """
    from mpistage.runtime.roots import destinations

    view, dests, dirs = memoryview(buf), destinations(manifest), Dirs(root_fd)
    try:
        for member in manifest["members"]:
            rel = join(dests[member["root"]], member["rel"])
            parent, _, leaf = rel.rpartition("/")
            write_member(dirs.fd(parent), leaf, rel, view, member, name)
        write_venv(root_fd, path, manifest, name)
        for member in reversed(manifest["members"]):
            if member["type"] == "dir":
                rel = join(dests[member["root"]], member["rel"])
                parent, _, leaf = rel.rpartition("/")
                stamp = (member["mtime_ns"], member["mtime_ns"])
                _os.utime(leaf, ns=stamp, dir_fd=dirs.fd(parent), follow_symlinks=False)
    except OSError as exc:
        raise os_error(exc, name) from None
    finally:
        dirs.close()


def write_venv(root_fd, path, manifest, name):
    """Write a staged venv's ``pyvenv.cfg``, its base interpreter below *path*.

    The interpreter takes ``home`` as an absolute path, so it is written
    where the copy lands, not when packed (``pack --env``'s ``venv_field``):
    without it, a distribution's Python (Debian's) is no venv's and looks
    for packages in ``dist-packages``, not the venv's ``site-packages``.
    """
    env = manifest.get("env")
    venv = env.get("venv") if isinstance(env, dict) else None
    if not venv:
        return
    if not isinstance(venv, dict):
        raise StageError(f"bundle {name!r} has a bad venv field: pack it again")
    if path is None:
        raise StageError(f"{name!r}: a staged venv needs the path it is staged to")
    lines = venv_lines(_os.path.abspath(path), venv, name)
    write_new(root_fd, "pyvenv.cfg", "".join(lines).encode(), 0o644)


def venv_lines(path, venv, name):
    """Return the lines of ``pyvenv.cfg`` for the manifest's *venv* at *path*."""
    from mpistage.runtime.bundlefile import safe_rel

    if "\n" in path:
        raise StageError(f"a venv cannot be staged to {path!r}: it holds a newline")
    cfg, placed = venv.get("cfg"), ("home", "executable")
    ok = isinstance(cfg, dict) and all(safe_rel(venv.get(k)) for k in placed)
    fields = {k: f"{path}/{venv.get(k)}" for k in placed}
    if ok and all(one_line(k, v) and k.lower() not in placed for k, v in cfg.items()):
        return [f"{k} = {v}\n" for k, v in {**cfg, **fields}.items()]
    raise StageError(f"bundle {name!r} has a bad venv field: pack it again")


def one_line(key, value):
    """Whether *key* = *value* is one ``pyvenv.cfg`` line, read back as it is."""
    if not (isinstance(key, str) and isinstance(value, str)) or "=" in key:
        return False
    return key.strip() == key != "" and not any(c in key + value for c in "\r\n")


def join(dest, rel):
    """Return *rel* below the root's destination *dest*."""
    return f"{dest}/{rel}" if dest else rel


def write_member(parent_fd, leaf, rel, view, member, name):
    """Write one file, directory or symlink *leaf* below *parent_fd*."""
    kind, mode = member["type"], member["mode"] & 0o777
    try:
        if kind == "dir":
            write_dir(parent_fd, leaf, rel, mode)
        elif kind == "link":
            _os.symlink(member["target"], leaf, dir_fd=parent_fd)
        else:
            data = view[member["offset"] : member["offset"] + member["size"]]
            write_file(parent_fd, leaf, data, mode | 0o400, member["mtime_ns"])
    except FileExistsError:
        raise StageError(f"bundle {name!r} has member {rel!r} twice") from None


def write_dir(parent_fd, leaf, rel, mode):
    """Create the directory *leaf*, or accept one made earlier, never a link."""
    try:
        _os.mkdir(leaf, mode | 0o700, dir_fd=parent_fd)
    except FileExistsError:
        st = _os.stat(leaf, dir_fd=parent_fd, follow_symlinks=False)
        if (st.st_mode & 0o170000) != 0o040000:
            raise StageError(f"bundle member {rel!r} is not a directory") from None


def write_file(parent_fd, leaf, data, mode, mtime_ns):
    """Create *leaf* (never following a symlink) with *data*, *mode* and mtime."""
    write_new(parent_fd, leaf, data, mode, mtime_ns)


def os_error(exc, name):
    """Turn an OSError of extraction into one clear error (NoSpace when full)."""
    if exc.errno in (_errno.ENOSPC, _errno.EDQUOT):
        return NoSpace(f"no space left while staging {name!r}")
    return StageError(f"cannot stage {name!r}: {exc.strerror}")
