"""The node's live copy: what the reader served, at the original paths.

With live imports there is no bundle: the node's copy fills up while the
job runs. The leader writes each item the reader pushes (a file, a
directory listing) and every rank of the node reads them:

- files go below ``<root>/files`` at their original absolute path, as in
  the node boot's copy (:data:`mpistage.node.imports.FILES`)
  (``/venv/lib/.../numpy/__init__.py`` →
  ``<root>/files/venv/lib/.../numpy/__init__.py``), so that an extension
  finds its ``$ORIGIN`` libraries at the same relative place and the copy of
  one path never depends on how another was reached. Each file is written
  to a temporary name and renamed into place: a file that exists is
  complete;
- listings go to an append-only log, ``<root>/.mpistage-listings``, one
  length-prefixed record each (path, entries, version), which ranks
  read from where they left off: a rank learns what its leader knows
  without asking it. So do the keys each push answered (a record
  ``(ANSWERED, key)``), once its files are written: a rank whose request
  the leader's thread cannot answer now (its program blocks in MPI
  holding the GIL) sees its answer here.

The leader creates everything relative to directory descriptors, without
following symlinks, like extraction does
(:class:`~mpistage.runtime.extract.Dirs`); the root itself is made, guarded
and removed like the runner's copy (:mod:`~mpistage.node.place`,
:mod:`~mpistage.node.cleanup`). The paths come from the reader, a rank of
the same job, and are still checked: absolute, no ``.`` or ``..``.

A file that cannot be mirrored (an odd path, a name too long, a path whose
kind changed since the copy took it: a file that is a directory now, or the
reverse, a full disk) is left out, and the ranks read its original,
as plain python would: one file never ends the job. So is a listing that
no longer fits in the log. An extension is left
out too when a library it needs from ``$ORIGIN`` is not in the copy.
"""

import os as _os

from mpistage import StageError
from mpistage.node.imports import FILES
from mpistage.node.place import WRITE_FLAGS

LOG = ".mpistage-listings"
ANSWERED = "answered"  # the mark of a log record that names an answered key
PROGRESS = ".mpistage-progress"  # bytes the leader has taken in so far
HEADER = 4  # bytes of a log record's length


def relative(path):
    """Return the absolute *path* as a path below the tree; refuse odd ones."""
    parts = path.split("/")
    if parts[0] != "" or any(p in ("", ".", "..") for p in parts[1:]):
        raise ValueError(f"not a plain absolute path: {path!r}")
    return "/".join(parts[1:])


def copy_path(root, path):
    """Return where the original *path* is in the copy at *root*."""
    return f"{root}/{FILES}{path}" if path != "/" else f"{root}/{FILES}"


class CopyWriter:
    """The leader's side: writes pushed items into its node's copy."""

    def __init__(self, root):
        from mpistage.runtime.extract import Dirs

        self.root = root
        _os.mkdir(FILES, 0o700, dir_fd=root.fd)
        self.dirs = Dirs(open_dir(root.fd, FILES))
        flags = _os.O_WRONLY | _os.O_APPEND | _os.O_CREAT | _os.O_EXCL | _os.O_NOFOLLOW
        self.log = _os.open(LOG, flags | _os.O_CLOEXEC, 0o600, dir_fd=root.fd)
        flags = _os.O_WRONLY | _os.O_CREAT | _os.O_EXCL | _os.O_NOFOLLOW
        self.counter = _os.open(PROGRESS, flags | _os.O_CLOEXEC, 0o600, dir_fd=root.fd)
        self.full, self.written, self.logged, self.taken = False, 0, 0, 0
        self.progress(0)  # its block now, while the copy is empty

    def apply(self, items):
        """Write *items* (files, then listings) in order."""
        import marshal

        records = []
        for item in items:
            if item[0] == "f":
                self.write_file(*item[1:])
            else:
                records.append(marshal.dumps(item[1:]))
        if records:
            self.append(records)

    def answered(self, keys):
        """Log that *keys* are answered: their pushes are in the copy."""
        import marshal

        if keys:
            self.append([marshal.dumps((ANSWERED, key)) for key in keys])

    def append(self, records):
        """Append listing records to the log in one write.

        Records that do not fit are cut off again, so that the log holds
        whole records only, and no more files are written: the ranks find
        no listing of those directories and read the originals.
        """
        import errno

        blob = b"".join(len(r).to_bytes(HEADER, "little") + r for r in records)
        done = 0
        try:
            while done < len(blob):
                done += _os.write(self.log, blob[done:])
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            _os.ftruncate(self.log, self.logged)
            self.full = True
            return
        self.logged += done

    def write_file(self, path, data, mode, mtime_ns, needs=()):
        """Write one file below the tree atomically; skip what cannot be.

        *needs* are the files it must not be without (an extension's
        ``$ORIGIN`` libraries): it is skipped when one is not in the copy.
        """
        if data is None:
            return
        out = self.open_file(path, mode, mtime_ns, needs)
        if out is not None:
            self.write_piece(out, data)
            self.close_file(out)

    def open_file(self, path, mode, mtime_ns, needs=()):
        """Begin the file *path*, to be written in pieces; ``None``: skip it.

        The bytes go to a temporary name beside it (:meth:`write_piece`),
        renamed into place by :meth:`close_file`: a file that exists is
        complete. A file that cannot be written is left out, and the ranks
        read its original.
        """
        if self.full:
            return None
        try:
            rel = relative(path)
            if not all(self.holds(relative(p)) for p in needs):
                return None
            parent, _, leaf = rel.rpartition("/")
            fd = self.dirs.fd(parent)
        except (OSError, ValueError, StageError):
            # Not a path the copy can hold (StageError: the copy has a file
            # where the original now has a directory): the original is read.
            return None
        self.written += 1
        tmp = f".mpistage-{_os.getpid()}-{self.written}.tmp"  # short: any leaf fits
        try:
            out = _os.open(tmp, WRITE_FLAGS, (mode & 0o777) | 0o600, dir_fd=fd)
        except OSError as exc:
            self.give_up(fd, tmp, exc)
            return None
        return OpenFile(fd, tmp, leaf, out, mtime_ns)

    def write_piece(self, handle, view):
        """Append *view* to the file being written (a skipped one: nothing)."""
        if handle is None or handle.out is None:
            return
        try:
            done, view = 0, memoryview(view)
            while done < len(view):
                done += _os.write(handle.out, view[done:])
        except OSError as exc:
            handle.close()
            self.give_up(handle.dir_fd, handle.tmp, exc)

    def close_file(self, handle):
        """The file is whole: give it its time, put it in place."""
        if handle is None or handle.out is None:
            return
        try:
            if handle.mtime_ns is not None:
                _os.utime(handle.out, ns=(handle.mtime_ns, handle.mtime_ns))
            handle.close()
            fd = handle.dir_fd
            _os.rename(handle.tmp, handle.leaf, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError as exc:
            handle.close()
            self.give_up(handle.dir_fd, handle.tmp, exc)

    def reader(self, handle):
        """A descriptor reading the file being written, or ``None`` (skipped)."""
        if handle is None or handle.out is None:
            return None
        flags = _os.O_RDONLY | _os.O_NOFOLLOW | _os.O_CLOEXEC
        try:
            return _os.open(handle.tmp, flags, dir_fd=handle.dir_fd)
        except OSError:
            return None

    def drop_file(self, handle):
        """Leave out the file being written: the ranks read its original."""
        if handle is None or handle.out is None:
            return
        handle.close()
        try:
            _os.unlink(handle.tmp, dir_fd=handle.dir_fd)
        except OSError:
            pass

    def progress(self, nbytes):
        """Count *nbytes* more taken in, where the node's ranks can see it.

        The count is for the ranks' bound on progress only: a copy that
        has filled up before its first count was written (no block for it)
        goes on without it, as full.
        """
        import errno

        self.taken += nbytes
        try:
            _os.pwrite(self.counter, self.taken.to_bytes(8, "little"), 0)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self.full = True

    def holds(self, rel):
        """Whether the copy holds the regular file *rel* (no link followed)."""
        import stat

        parent, _, leaf = rel.rpartition("/")
        try:
            st = _os.stat(leaf, dir_fd=self.dirs.fd(parent), follow_symlinks=False)
        except (OSError, StageError):  # StageError: a file on the way, see write_file
            return False
        return stat.S_ISREG(st.st_mode)

    def give_up(self, fd, tmp, exc):
        """A file that cannot be written: the ranks read its original instead."""
        import errno

        try:
            _os.unlink(tmp, dir_fd=fd)
        except OSError:
            pass
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self.full = True  # Nothing more fits: later files come from originals.

    def close(self):
        """Close the descriptors (the files stay until the root is removed)."""
        self.dirs.close()
        _os.close(self.dirs.root_fd)
        _os.close(self.log)
        _os.close(self.counter)


class OpenFile:
    """A file of the copy being written: its directory, names and descriptor."""

    def __init__(self, dir_fd, tmp, leaf, out, mtime_ns):
        self.dir_fd, self.tmp, self.leaf = dir_fd, tmp, leaf
        self.out, self.mtime_ns = out, mtime_ns

    def close(self):
        """Close the descriptor (once)."""
        if self.out is not None:
            _os.close(self.out)
            self.out = None


def taken(root):
    """Return how many bytes the leader of the copy at *root* has taken in."""
    try:
        fd = _os.open(f"{root}/{PROGRESS}", _os.O_RDONLY | _os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        return int.from_bytes(_os.pread(fd, 8, 0), "little")
    finally:
        _os.close(fd)


def open_dir(parent_fd, name):
    """Open the directory *name* below *parent_fd*, refusing a symlink."""
    from mpistage.node.place import DIR_FLAGS

    return _os.open(name, DIR_FLAGS, dir_fd=parent_fd)


class Listings:
    """A rank's side: the listings its leader logged, read as they come.

    Each listing is ``None`` (no such directory), ``False`` (not a
    directory) or a tuple of entries, directories ending in ``/``, with its
    version (the reader lists a directory again when asked, see
    :mod:`~mpistage.runtime.live`): a newer record of a directory replaces an older one.
    """

    def __init__(self, root):
        import _thread

        self.path = f"{root}/{LOG}"
        self.fd, self.offset, self.known, self.keys = None, 0, {}, set()
        self.lock = _thread.allocate_lock()

    def get(self, path, fresh=False):
        """Return (entries, version) of *path*, or ``None``.

        New records are read first when the listing is unknown, or *fresh*.
        """
        found = self.known.get(path)
        if found is None or fresh:
            with self.lock:
                self.refresh()
            found = self.known.get(path)
        return found

    def answers(self, key):
        """Whether the leader logged *key* as answered (new records read first)."""
        if key not in self.keys:
            with self.lock:
                self.refresh()
        return key in self.keys

    def refresh(self):
        """Read the records appended since the last call; keep a partial one."""
        import marshal

        if self.fd is None:
            try:
                self.fd = _os.open(self.path, _os.O_RDONLY | _os.O_CLOEXEC)
            except FileNotFoundError:
                return
        blob = b""
        while True:
            chunk = _os.pread(self.fd, 1 << 20, self.offset + len(blob))
            if not chunk:
                break
            blob += chunk
        at = 0
        while at + HEADER <= len(blob):
            size = int.from_bytes(blob[at : at + HEADER], "little")
            if at + HEADER + size > len(blob):
                break  # Being written: read again next time.
            record = marshal.loads(blob[at + HEADER : at + HEADER + size])
            at += HEADER + size
            if record[0] == ANSWERED and len(record) == 2:
                self.keys.add(record[1])
                continue
            path, entries, version = record
            if version >= self.known.get(path, (None, -1))[1]:
                self.known[path] = (entries, version)
        self.offset += at

    def close(self):
        """Close the log."""
        if self.fd is not None:
            _os.close(self.fd)
            self.fd = None
