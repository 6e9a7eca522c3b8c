"""The files a bundle is made of, as the bundle writer sees them.

The writer (:mod:`~mpistage.bundle.writer`) and the recorder's builder
(:mod:`~mpistage.bundle.record`) ask a *view* for stats, listings and
content, never the ``os`` module:

- :class:`Files` is the file system itself (``pack``, ``record``);
- :class:`Known` answers from facts learned already and asks its *base*
  only for the rest. An ``--auto`` learning run builds its bundle from what
  the live reader learned while it served the program (every listing it
  read, the stat of every file it read or stat'ed and of every directory it
  listed, which entries are symlinks) and from node 0's copy of the files it
  sent, so the bundle costs the shared file system nothing for what the run
  read already: no second pass over it.

A view's primitives are :meth:`~Files.lstat`, :meth:`~Files.stat`,
:meth:`~Files.listing` (sorted entries, directories ending in ``/``, the
one form of :func:`mpistage.runtime.roots.listing`), :meth:`~Files.readlink`
and :meth:`~Files.chunks`; the questions (``exists``, ``isdir``...) are
answered from them.
"""

import os as _os
import stat as _stat

COPY_SIZE = 1 << 20


class Files:
    """The file system itself."""

    def lstat(self, path):
        """``os.lstat``."""
        return _os.lstat(path)

    def stat(self, path):
        """``os.stat``."""
        return _os.stat(path)

    def listing(self, path):
        """Return the sorted entries of the directory *path*, directories with ``/``."""
        from mpistage.runtime.roots import listing

        return listing(path)

    def readlink(self, path):
        """``os.readlink``."""
        return _os.readlink(path)

    def digest(self, path):
        """The digest of the directory's names and inodes (``roots.entries_digest``)."""
        from mpistage.runtime.roots import entries_digest

        return entries_digest(path)

    def chunks(self, path):
        """Yield the content of the file *path* in pieces."""
        return file_chunks(path)

    def walk(self, top):
        """Yield every path below the directory *top*; symlinks are not followed."""
        for folder, dirs, names in _os.walk(top):
            for name in dirs + names:
                yield _os.path.join(folder, name)

    # -- questions, answered from the primitives -------------------------------

    def listdir(self, path):
        """Return the names in the directory *path*."""
        return [entry.rstrip("/") for entry in self.listing(path)]

    def exists(self, path):
        """Whether *path* exists (following symlinks)."""
        return self.mode(path) is not None

    def isdir(self, path):
        """Whether *path* is a directory (following symlinks)."""
        mode = self.mode(path)
        return mode is not None and _stat.S_ISDIR(mode)

    def isfile(self, path):
        """Whether *path* is a regular file (following symlinks)."""
        mode = self.mode(path)
        return mode is not None and _stat.S_ISREG(mode)

    def islink(self, path):
        """Whether *path* is a symlink."""
        try:
            return _stat.S_ISLNK(self.lstat(path).st_mode)
        except (OSError, ValueError):
            return False

    def mode(self, path):
        """Return the mode of *path* (following symlinks), or ``None``."""
        try:
            return self.stat(path).st_mode
        except (OSError, ValueError):
            return None


class Known(Files):
    """Answers from learned facts; asks *base* (a view) only for the rest.

    *listings* maps directories to their sorted entries (``None``: no such
    directory, ``False``: not a directory); *stats* maps paths to the
    stat of what they lead to; *links* names the entries of the listed
    directories that are symlinks; *copies* maps files to a copy of their
    content; *digests* maps listed directories to their entries' digest.
    A path in a listed directory that its listing does not show does not
    exist: nothing is asked. A stat of a file that is no entry of
    a listed directory (bytecode in ``__pycache__``, metadata) counts as
    its ``lstat`` too: the reader read it through whatever it is.
    """

    def __init__(self, listings, stats, links=(), copies=None, base=None, digests=None):
        self.listings, self.stats = dict(listings), stats
        self.links, self.copies = set(links), copies or {}
        self.digests = digests or {}
        self.base = base if base is not None else Files()
        self.sets, self.answers = {}, {}

    def shown(self, path):
        """How the parent's listing shows *path*: ``dir``, ``file``, ``absent``.

        ``None`` when the parent was not listed.
        """
        folder, name = _os.path.split(path)
        entries = self.listings.get(folder, MISSING)
        if entries is MISSING:
            return None
        if not entries:
            return "absent"
        found = self.sets.get(folder)
        if found is None:
            found = self.sets[folder] = frozenset(entries)
        if name + "/" in found:
            return "dir"
        return "file" if name in found else "absent"

    def lstat(self, path):
        """The learned stat, unless *path* is a symlink; else the base's."""
        if path in self.stats and path not in self.links:
            return self.stats[path]
        return self.ask("lstat", path)

    def stat(self, path):
        """The learned stat; else the base's."""
        if path in self.stats:
            return self.stats[path]
        return self.ask("stat", path)

    def ask(self, question, path):
        """Return the base's answer (asked once); raise if a listing says no."""
        if self.shown(path) == "absent":
            raise FileNotFoundError(2, "not in its directory's listing", path)
        key = (question, path)
        if key not in self.answers:
            try:
                self.answers[key] = getattr(self.base, question)(path)
            except OSError as exc:
                self.answers[key] = exc
        found = self.answers[key]
        if isinstance(found, OSError):
            raise found
        return found

    def listing(self, path):
        """The learned listing; else the base's (then kept)."""
        entries = self.listings.get(path, MISSING)
        if entries is MISSING:
            entries = self.listings[path] = tuple(self.base.listing(path))
        if entries is None:
            raise FileNotFoundError(2, "no such directory", path)
        if entries is False:
            raise NotADirectoryError(20, "not a directory", path)
        return list(entries)

    def readlink(self, path):
        """The base's."""
        return self.base.readlink(path)

    def digest(self, path):
        """The learned digest of a listed directory; else the base's."""
        if path in self.digests:
            return self.digests[path]
        return self.ask("digest", path)

    def chunks(self, path):
        """The copy's content when there is one; else the base's."""
        copy = self.copies.get(path)
        return file_chunks(copy) if copy else self.base.chunks(path)

    def walk(self, top):
        """Yield every path below *top*, from the listings; no symlink followed."""
        todo = [top]
        while todo:
            folder = todo.pop()
            try:
                entries = self.listing(folder)
            except OSError:
                continue
            for entry in entries:
                path = _os.path.join(folder, entry.rstrip("/"))
                yield path
                if entry.endswith("/") and not self.islink(path):
                    todo.append(path)

    def exists(self, path):
        """From the parent's listing when it is known."""
        shown = self.shown(path)
        return shown != "absent" if shown else super().exists(path)

    def isdir(self, path):
        """From the parent's listing when it is known."""
        shown = self.shown(path)
        return shown == "dir" if shown else super().isdir(path)

    def islink(self, path):
        """From the parent's listing (entry types) when it is known."""
        if path in self.links:
            return True
        if self.shown(path) or path in self.stats:
            return False
        return super().islink(path)


MISSING = object()  # a listing not learned


def file_chunks(path):
    """Yield the content of the file at *path* in pieces."""
    with open(path, "rb") as src:
        while chunk := src.read(COPY_SIZE):
            yield chunk
