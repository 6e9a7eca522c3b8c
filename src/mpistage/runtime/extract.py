"""Step 4: each node leader writes the bundle's members below its root.

This is the one extraction (:class:`Writer`), used by the runner, by
:func:`mpistage.staged`, by ``mpistage stage`` and by ``mpistage-env``: it
takes the bundle's bytes piece by piece as they arrive and puts each
straight into its place in the node's copy. A bundle is untrusted
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


class Writer:
    """Writes a bundle's members below a root as their bytes arrive.

    The one extraction, fed pieces of the bundle in order (:meth:`write`,
    from the broadcast's writer thread): members are made in manifest
    order, each file created when its first byte arrives and written in
    place with ``pwritev``, never gathered in a buffer of its own; a
    directory or link is made when the bytes reach it. :meth:`finish`
    makes what follows the last byte, writes a staged venv's
    ``pyvenv.cfg`` and sets the directories' times. *path* is where
    *root_fd* is: a staged venv's ``pyvenv.cfg`` names it.
    """

    def __init__(self, root_fd, manifest, name, path=None):
        from mpistage.runtime.roots import destinations

        self.root_fd, self.manifest, self.name, self.path = (
            root_fd,
            manifest,
            name,
            path,
        )
        self.members, self.dests = manifest["members"], destinations(manifest)
        self.dirs, self.next, self.out = Dirs(root_fd), 0, None

    def write(self, start, view):
        """Write the piece *view*, the bundle's bytes from *start* on."""
        try:
            self.advance(start, view)
        except OSError as exc:
            raise os_error(exc, self.name) from None

    def advance(self, start, view):
        """Make the members the piece reaches; write its bytes into their files."""
        end = start + len(view)
        while self.next < len(self.members):
            member = self.members[self.next]
            if member["type"] != "file":
                self.make(member)
                continue
            offset, stop = member["offset"], member["offset"] + member["size"]
            if offset > end or (offset == end and stop > end):
                return
            if self.out is None:
                self.out = self.create(member)
            lo, hi = max(offset, start), min(stop, end)
            if hi > lo:
                write_at(self.out, view[lo - start : hi - start], lo - offset)
            if stop > end:
                return
            self.close_file(member)

    def place(self, member):
        """Return (directory fd, leaf, rel) of *member* below the root."""
        rel = join(self.dests[member["root"]], member["rel"])
        parent, _, leaf = rel.rpartition("/")
        return self.dirs.fd(parent), leaf, rel

    def make(self, member):
        """Make the directory or link *member*."""
        parent_fd, leaf, rel = self.place(member)
        try:
            if member["type"] == "dir":
                write_dir(parent_fd, leaf, rel, member["mode"] & 0o777)
            else:
                _os.symlink(member["target"], leaf, dir_fd=parent_fd)
        except FileExistsError:
            raise StageError(f"bundle {self.name!r} has member {rel!r} twice") from None
        self.next += 1

    def create(self, member):
        """Create the file *member* (never following a symlink); return its fd."""
        from mpistage.node.place import WRITE_FLAGS

        parent_fd, leaf, rel = self.place(member)
        mode = (member["mode"] & 0o777) | 0o400
        try:
            return _os.open(leaf, WRITE_FLAGS, mode, dir_fd=parent_fd)
        except FileExistsError:
            raise StageError(f"bundle {self.name!r} has member {rel!r} twice") from None

    def close_file(self, member):
        """The file's last byte is written: give it its time, close it."""
        out, self.out = self.out, None
        try:
            _os.utime(out, ns=(member["mtime_ns"], member["mtime_ns"]))
        finally:
            _os.close(out)
        self.next += 1

    def finish(self, end):
        """After the last piece (the data ended at *end*): make the rest, stamp."""
        try:
            self.advance(end, b"")
            if self.next != len(self.members):
                raise StageError(f"bundle {self.name!r} shrank while being read")
            write_venv(self.root_fd, self.path, self.manifest, self.name)
            for member in reversed(self.members):
                if member["type"] == "dir":
                    parent_fd, leaf, _rel = self.place(member)
                    stamp = (member["mtime_ns"], member["mtime_ns"])
                    _os.utime(leaf, ns=stamp, dir_fd=parent_fd, follow_symlinks=False)
        except OSError as exc:
            raise os_error(exc, self.name) from None

    def close(self):
        """Close what is open (the files stay)."""
        if self.out is not None:
            _os.close(self.out)
            self.out = None
        self.dirs.close()


def write_at(fd, view, offset):
    """Write all of *view* at *offset* of the file *fd*."""
    done = 0
    while done < len(view):
        done += _os.pwritev(fd, [view[done:]], offset + done)


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


def write_dir(parent_fd, leaf, rel, mode):
    """Create the directory *leaf*, or accept one made earlier, never a link."""
    try:
        _os.mkdir(leaf, mode | 0o700, dir_fd=parent_fd)
    except FileExistsError:
        st = _os.stat(leaf, dir_fd=parent_fd, follow_symlinks=False)
        if (st.st_mode & 0o170000) != 0o040000:
            raise StageError(f"bundle member {rel!r} is not a directory") from None


def os_error(exc, name):
    """Turn an OSError of extraction into one clear error (NoSpace when full)."""
    if exc.errno in (_errno.ENOSPC, _errno.EDQUOT):
        return NoSpace(f"no space left while staging {name!r}")
    return StageError(f"cannot stage {name!r}: {exc.strerror}")
