"""The live reader: rank 0 reads the originals, each once per job.

Without a bundle, one process reads the shared file system for the whole
job. It answers *keys*, and returns the *items* to push to every node's copy
(:mod:`~.mirror`), each item at most once:

- ``("d", dir)``: the directory's listing;
- ``("r", dir, rank, generation)``: the listing read again, for a rank that
  called ``importlib.invalidate_caches()`` and then missed a name there
  (see :mod:`~mpistage.runtime.live`); each listing read has a version, counted per
  directory;
- ``("m", dir, name, version)``: a module or package, as plain python would read it
  next: the package's listing and its ``__init__``, or the module's file.
  For source, that is the bytecode in ``__pycache__`` when it is valid for
  the source (the source itself is stat'ed, not read: a rank needs it only
  for a traceback or ``inspect``, and fetches it then); otherwise the
  source. For an extension, also the libraries it needs from ``$ORIGIN``
  directories (:func:`origin_dirs`);
- ``("f", path)``: one file: metadata, a resource, a source on demand.

In an ``--auto`` learning run (*sources*), the source of a module whose
bytecode is valid is wanted for the bundle only: it is named, not read,
while the program imports (its reads would sit on every rank's critical
path), and the bundle's builder reads it at the end, relative to the
reader's open directories; it goes to the nodes only if a rank asks for it.

Everything is reached relative to directory descriptors opened once
(``O_PATH`` where nothing is listed), so a file costs its own lookup and
open, not a walk of its whole path: this is what keeps rank 0 below plain
python's operations although it reads for every node.

With *sources* (an ``--auto`` learning run) the reader also keeps what it
learned on the way, for the bundle built at the end (:meth:`Reader.facts`):
the stat of every file it read or stat'ed (from the ``fstat`` of the open
file, no extra lookup), of every directory it listed (one ``fstat`` of the
descriptor it listed, so that the identity matches the listing), and which
entries of a listing are symlinks (from the entry's type, no stat).

Items are ``("d", dir, entries, version)`` and ``("f", path, data, mode,
mtime_ns, needs)``; ``entries`` is ``None`` (no such directory), ``False``
(not a directory) or the sorted entries, directories ending in ``/``
(others marked, see :func:`~mpistage.runtime.listings.listed_entry`);
``data`` is ``None`` when the file cannot be read; ``needs`` names the
``$ORIGIN`` libraries an extension cannot be loaded from the copy without.
"""

import os as _os

from mpistage import pyc_header, read_fd
from mpistage.node.elf import elf_dynamic, expand_origin
from mpistage.runtime.live.pieces import RAW_FROM

MAX_OPEN = 256  # directory descriptors kept open
MAX_FILE = 1 << 30  # larger files are left to the ranks to read themselves
PATH_FLAGS = _os.O_PATH | _os.O_DIRECTORY | _os.O_CLOEXEC
LIST_FLAGS = _os.O_RDONLY | _os.O_DIRECTORY | _os.O_CLOEXEC
FILE_FLAGS = _os.O_RDONLY | _os.O_NONBLOCK | _os.O_CLOEXEC


class Reader:
    """The reader's view of the originals: listings, files sent, descriptors.

    With *sources*, a module's source is read with its valid bytecode and
    kept on node 0 (an ``--auto`` learning run bundles both), and the facts
    it learns are kept.
    """

    def __init__(self, sources=False):
        self.listings, self.sent, self.fds = {}, set(), {}
        self.unread = set()  # files sent as unreadable: the ranks read originals
        self.kept = set()  # sources named for the bundle, not read (--auto)
        self.sources = sources
        self.stats, self.links = {}, set()  # kept when learning (sources)
        self.digests = {}  # listed directory: its entries' digest (learning)
        self.counts = {"listings": 0, "files": 0, "bytes": 0}

    def items(self, key):
        """Return the new items that answer *key*."""
        out = []
        if key[0] in ("d", "r"):
            self.listing(key[1], out, key[0] == "r")
        elif key[0] == "m":
            self.module(key[1], key[2], out)
        elif key[0] == "f":
            self.file(key[1], out)
        return out

    # -- modules -------------------------------------------------------------

    def module(self, folder, name, out):
        """Add the files plain python would read to import *name* from *folder*."""
        from mpistage.runtime.listings import locate

        found = locate(lambda path: self.listing(path, out), folder, name)
        if found is None:
            return
        kind, path, _search = found
        if kind == "source":
            self.source(path, out)
        elif kind == "extension":
            self.extension(path, out)
        elif kind == "bytecode":
            self.file(path, out)

    def source(self, path, out):
        """Add the valid bytecode of the source *path*, else the source."""
        from mpistage.runtime.finders import cache_from_source

        cached = cache_from_source(path)
        if path in self.sent or cached in self.sent:
            return
        folder, name = _os.path.split(path)
        st = self.stat(folder, name)
        if st is None:
            return
        head, tail = _os.path.split(cached)
        got = None
        if self.listed_dir(_os.path.dirname(head), _os.path.basename(head)):
            got = self.read(head, tail)
        verdict = bytecode_verdict(got and got[0], st)
        if verdict != "stale":
            self.add_file(cached, got, out)
        if verdict != "valid":
            self.file(path, out)
        elif self.sources:  # for the bundle only: read when it is built
            self.kept.add(path)
            self.sent.add(path)

    def extension(self, path, out):
        """Add an extension, after the libraries it needs from ``$ORIGIN``."""
        if path in self.sent:
            return
        folder, name = _os.path.split(path)
        got = self.read(folder, name)
        if got is None:
            return self.add_file(path, None, out)
        todo, seen, needs = [(got[0], folder, [])], {path}, []
        while todo:
            data, where, inherited = todo.pop()
            names, dirs = origin_dirs(data, where)
            dirs = dirs + inherited  # the loader also searches its loaders' paths
            for needed in names:
                lib = self.library(needed, dirs, out, needs)
                if lib is not None and lib[0] not in seen:
                    seen.add(lib[0])
                    todo.append((lib[1], _os.path.dirname(lib[0]), dirs))
        if self.unread.intersection(needs):
            got = None  # loaded from the copy, it would miss a library
        self.add_file(path, got, out, tuple(needs))

    def library(self, name, dirs, out, needs):
        """Find *name* in the ``$ORIGIN`` *dirs*; add it; return (path, data).

        Its path goes to *needs* wherever it was found, sent now or before.
        """
        for folder in dirs:
            entries = self.listing(folder, out)
            if entries and name in entries:
                path = f"{folder}/{name}"
                needs.append(path)
                if path in self.sent:
                    return None
                got = self.read(folder, name)
                self.add_file(path, got, out)
                return (path, got[0]) if got else None
        return None

    # -- files and listings --------------------------------------------------

    def file(self, path, out):
        """Add the file *path* (once; a source named for the bundle is read now)."""
        if path not in self.sent or path in self.kept:
            self.kept.discard(path)
            folder, name = _os.path.split(path)
            self.add_file(path, self.read(folder, name), out)

    def add_file(self, path, got, out, needs=()):
        """Add a read file (or ``None``: unreadable) as an item."""
        self.sent.add(path)
        if not got:
            self.unread.add(path)
        data, mode, mtime = got if got else (None, 0, None)
        out.append(("f", path, data, mode, mtime, needs))

    def listing(self, path, out, again=False):
        """Return the listing of *path*; add it as an item when (re)read.

        It is read once, and *again* when a rank asks for a fresh one (after
        ``importlib.invalidate_caches()``): then the path is looked up anew
        from ``/``, so a symlink on the way swapped since is followed as
        plain python follows it.
        """
        known = self.listings.get(path)
        if again:
            self.forget(path)
        if known is None or again:
            entries = self.list_dir(path)
            version = known[1] + 1 if known else 0
            self.listings[path] = known = (entries, version)
            self.counts["listings"] += 1
            out.append(("d", path, entries, version))
        entries = known[0]
        return frozenset(entries) if entries else entries

    def listed_dir(self, folder, name):
        """Whether *folder*'s listing (if read) shows a directory *name*."""
        known = self.listings.get(folder)
        return known is None or bool(known[0] and name + "/" in known[0])

    def list_dir(self, path):
        """Read the entries of *path*: ``None`` if absent, ``False`` if no dir."""
        import errno

        from mpistage.runtime.listings import listed_entry

        try:
            fd = self.dir_fd(path, LIST_FLAGS)
            with _os.scandir(fd) as found:
                found = list(found)
                entries = sorted(listed_entry(e) for e in found)
            if self.sources:
                self.learn(path, _os.fstat(fd), found)
            return tuple(entries)
        except OSError as exc:
            return False if exc.errno == errno.ENOTDIR else None

    def learn(self, path, st, entries=None):
        """Keep the stat of *path* (and of a directory, what its *entries* say).

        For ``--auto``: which entries are symlinks and the digest of names
        and inodes come from the entries' types and inodes, no stat.
        """
        from mpistage.runtime.roots import digest_of

        self.stats[path] = st
        if entries is None:
            return
        self.digests[path] = digest_of(entries)
        for entry in entries:
            if entry.is_symlink():
                self.links.add(f"{path}/{entry.name}")

    def facts(self):
        """Return what the reader learned: listings, stats, symlinks, digests.

        Listings are in the one form of :func:`~mpistage.runtime.roots.listing`
        (directories end in ``/``; the marks of other entries taken off).
        """
        from mpistage.runtime.listings import plain

        listings = {path: plain(known[0]) for path, known in self.listings.items()}
        return listings, self.stats, self.links, self.digests

    def stat(self, folder, name):
        """Return the stat of *name* in *folder*, or ``None``."""
        try:
            st = _os.stat(name, dir_fd=self.dir_fd(folder))
        except OSError:
            return None
        if self.sources:
            self.learn(f"{folder}/{name}", st)
        return st

    def read(self, folder, name):
        """Return (bytes, mode, mtime_ns) of the regular file *name*, or ``None``.

        A file of :data:`~.pieces.RAW_FROM` bytes or more is not read
        here: its bytes are a :class:`Big`, read as they are sent.
        """
        import stat

        try:
            fd = _os.open(name, FILE_FLAGS, dir_fd=self.dir_fd(folder))
        except OSError:
            return None
        try:
            st = _os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE:
                return None
            if st.st_size >= RAW_FROM:
                data, fd = Big(fd, st.st_size), None  # the Big closes it
            else:
                data = read_fd(fd, st.st_size)
        except OSError:
            return None
        finally:
            if fd is not None:
                _os.close(fd)
        self.counts["files"] += 1
        self.counts["bytes"] += len(data)
        if self.sources:
            self.learn(f"{folder}/{name}", st)
        return data, st.st_mode, st.st_mtime_ns

    def dir_fd(self, path, flags=PATH_FLAGS):
        """Return a descriptor of the directory *path*, opened from its parent's.

        Directories are opened once each, relative to the nearest one
        already open (a loop, not recursion); listing needs a real open.
        """
        held = self.fds.get(path)
        if held is not None and (flags == PATH_FLAGS or held[1] == LIST_FLAGS):
            self.fds[path] = self.fds.pop(path)  # most recently used last
            return held[0]
        todo = [path]
        while todo[-1] != "/" and _os.path.dirname(todo[-1]) not in self.fds:
            todo.append(_os.path.dirname(todo[-1]))
        top, fd = todo[-1], None
        if top != "/":
            parent = _os.path.dirname(top)
            self.fds[parent] = self.fds.pop(parent)  # not the one to close next
            fd = self.fds[parent][0]
        for index, step in enumerate(reversed(todo)):
            want = flags if index == len(todo) - 1 else PATH_FLAGS
            name = _os.path.basename(step) if fd is not None else step
            fd = _os.open(name, want, dir_fd=fd)
            self.keep(step, fd, want)
        return fd

    def forget(self, path):
        """Close the descriptors of *path* and its ancestors: look them up anew."""
        while True:
            held = self.fds.pop(path, None)
            if held is not None:
                _os.close(held[0])
            if path == "/":
                return
            path = _os.path.dirname(path)

    def keep(self, path, fd, flags):
        """Remember a directory descriptor; close the least recently used."""
        old = self.fds.pop(path, None)
        if old is not None:
            _os.close(old[0])
        self.fds[path] = (fd, flags)
        while len(self.fds) > MAX_OPEN:
            _path, (first, _flags) = next(iter(self.fds.items()))
            del self.fds[_path]
            _os.close(first)

    def close(self):
        """Close every descriptor."""
        for fd, _flags in self.fds.values():
            _os.close(fd)
        self.fds = {}


class Big:
    """A big file, open and not read: its bytes are read as they are sent.

    The relay copies it into the node's copy and sends it down the tree
    piece by piece (:mod:`~.pieces`), so no process holds the file. What
    the reader itself looks at (an ELF object's headers and strings, a
    bytecode header) is read here in windows of :data:`WINDOW` bytes, on
    demand: slices and :meth:`index`, as of bytes. A window that cannot be
    read reads as empty (the object then looks malformed, and needs
    nothing).
    """

    WINDOW = 1 << 16

    def __init__(self, fd, size):
        self.fd, self.size, self.windows = fd, size, {}

    def __len__(self):
        return self.size

    def __getitem__(self, key):
        start, stop, _step = key.indices(self.size)
        parts = []
        while start < stop:
            number, at = divmod(start, self.WINDOW)
            part = self.window(number)[at : at + stop - start]
            if not part:
                break
            parts.append(part)
            start += len(part)
        return b"".join(parts)

    def index(self, byte, start):
        """The offset of the first *byte* (one byte) at *start* or after."""
        number, at = divmod(start, self.WINDOW)
        while number * self.WINDOW < self.size:
            found = self.window(number).find(byte, at)
            if found >= 0:
                return number * self.WINDOW + found
            number, at = number + 1, 0
        raise ValueError("not found")

    def window(self, number):
        """The bytes of window *number* (kept)."""
        if number not in self.windows:
            try:
                got = _os.pread(self.fd, self.WINDOW, number * self.WINDOW)
            except OSError:
                got = b""
            self.windows[number] = got
        return self.windows[number]

    def chunks(self):
        """Yield the bytes in pieces, then close the file (a bundle's builder)."""
        from mpistage.runtime.bulk import step

        try:
            at, size = 0, step()
            while at < self.size:
                got = _os.pread(self.fd, min(size, self.size - at), at)
                if not got:
                    return
                yield got
                at += len(got)
        finally:
            self.close()

    def take(self):
        """Hand the descriptor over (to the outbox, which closes it)."""
        fd, self.fd = self.fd, None
        return fd

    def close(self):
        """Close the file (once); the relay does after sending it."""
        if self.fd is not None:
            _os.close(self.fd)
            self.fd = None

    __del__ = close  # a big file the reader dropped (a stale bytecode)


def bytecode_verdict(data, st):
    """Say whether bytecode *data* is ``valid`` for the source *st*.

    ``hash``: hash-based (the ranks need the source to check it, or not:
    both are sent); ``stale``: missing or not for this source.
    """
    from mpistage.runtime.finders import MAGIC_NUMBER

    if not data or len(data) < 16 or data[:4] != MAGIC_NUMBER:
        return "stale"
    if int.from_bytes(data[4:8], "little") & 1:
        return "hash"
    return "valid" if data[:16] == pyc_header(st) else "stale"


def origin_dirs(data, folder):
    """Return (needed names, ``$ORIGIN`` directories) of the ELF *data* in *folder*.

    A wheel's extension finds the libraries auditwheel grafted beside it
    (``numpy.libs/``) through a run path such as ``$ORIGIN/../numpy.libs``;
    they must be in the node's copy at the same relative place. The run path
    is ``DT_RUNPATH``, or ``DT_RPATH`` when there is none (the loader ignores
    ``DT_RPATH`` then); other directories are searched in a rank as in plain
    python. Anything that is not a 64-bit little-endian ELF object needs
    nothing.
    """
    found = elf_dynamic(data)
    if found is None:
        return [], []
    needed, runpath, rpath, _soname = found
    entries = (runpath or rpath or "").split(":")
    dirs = [expand_origin(e, folder) for e in entries if e]
    return [n for n in needed if "/" not in n], [d for d in dirs if d]
