"""The live finder: ranks import from the node's copy as the reader fills it.

A path hook first in ``sys.path_hooks`` (:class:`LiveHook`) serves every
directory at or below the roots of the job (the ``sys.path`` entries when
it starts, and the target's directory) with a :class:`LiveFinder`. Both are
thin subclasses of :mod:`~mpistage.runtime.finders`', the one way imports
are served (bundled imports stand on it too); what is live about them is
where listings and files come from: the listings the reader sent
(:mod:`~.mirror`), so a name that is not there is answered from memory, and
a module that is not in the node's copy yet is asked for along the request
path (:mod:`~.request`): one message brings its listing and files.

Which ``__file__`` a module gets: every module keeps its original path
(tracebacks, ``inspect``, pytest and coverage see the files they expect,
and a listing of, or data read relative to, ``__file__`` is the
original's, as with plain python: the copy holds only what was asked
for). Their bytes come from the copy (:class:`LiveSourceLoader`); an
extension is loaded from the copy, where the libraries it needs from
``$ORIGIN`` are too (:class:`~mpistage.runtime.finders.CopyExtensionLoader`).
Packages search their original directories, which this hook serves.

``importlib.resources`` and ``importlib.metadata`` read through the copy
too: ``LivePath`` is a ``pathlib`` path of the original whose
reads, listings and type checks are served live, and :class:`LiveMetaFinder`
finds distributions in the listings. Whatever cannot be served (a file the
reader could not read, the session closed, a forked child) is read from the
original: correct, only slower.
"""

import os as _os
from importlib.machinery import BYTECODE_SUFFIXES

from mpistage.runtime import finders as _finders
from mpistage.runtime.finders import Unknown
from mpistage.runtime.listings import entry_kind, entry_name

CURRENT = [None]  # the live session of this process, for LivePath
_MADE = {}  # classes made on first use: pathlib and importlib.resources load late


class LiveHook(_finders.ServingHook):
    """A path hook handing out a :class:`LiveFinder` for served directories."""

    def __init__(self, live):
        self.live = live

    def finder(self, folder):
        """Return the finder of *folder*; none for what is not served (or a file)."""
        try:
            entries = self.live.served_listing(folder)
        except Unknown:
            return None
        if entries is False:
            return None  # not a directory: a zip is zipimport's
        return LiveFinder(folder, self.live)


class LiveFinder(_finders.ServingFinder):
    """The path entry finder of one served directory, from the reader's listings."""

    def __init__(self, path, live):
        super().__init__(path)
        self.live = live

    def __repr__(self):
        return f"LiveFinder({self.path!r})"

    def usable(self):
        """Whether imports are served live in this process now."""
        return self.live.usable()

    def listing(self, folder):
        """The reader's listing of *folder*, asked for once (or ``Unknown``)."""
        return self.live.listing(folder)

    def copy(self, path):
        """Return where the original *path* is in the node's copy."""
        return self.live.copy(path)

    def located(self, name):
        """Locate *name*; a package's listing comes with its files, in one request.

        A name missing from a listing read before the rank's last
        ``importlib.invalidate_caches()`` is looked for in a fresh one.
        """
        live = self.live
        entries = live.listing(self.path)
        if entries and name + "/" in entries and not live.knows(f"{self.path}/{name}"):
            live.need(live.module_key(self.path, name))
        found = super().located(name)
        if found is None and live.stale(self.path):
            live.refresh(self.path)  # created since it was listed?
            found = super().located(name)
        return found

    def holds(self, name, kind, path):
        """Whether the copy holds the module's file(s), once asked for them."""
        live = self.live
        if not live.present(kind, path):
            live.need(live.module_key(self.path, name))
            return live.present(kind, path)
        return True

    def keeps_original(self, path):
        """Every module shows its original ``__file__``, extensions too.

        The copy holds only what was asked for: beside a module there, a
        program would find less than plain python finds.
        """
        return True

    def source_loader(self, fullname, path):
        """The loader of a source module: bytes from the copy."""
        return LiveSourceLoader(fullname, path, self.live)

    def package_dir(self, folder):
        """Packages search their original directory: the hook serves it as it fills."""
        return folder


class LiveSourceLoader(_finders.CopyLoader):
    """Load a source module from the node's copy under its original path.

    The copy holds the bytecode the reader found valid for the source, and
    the source only when there was none: :meth:`path_stats` then answers
    from the bytecode's own stamp, and the source is fetched if something
    asks for it.
    """

    def __init__(self, fullname, path, live):
        super().__init__(fullname, path)
        self.live = live

    def staged_path(self, path):
        """Return where the original *path* is in the node's copy."""
        return self.live.copy(path)

    def get_data(self, path):
        """Read *path* from the copy (fetched when needed), else from the original.

        What the copy cannot hold (a file the user cannot read, a link that
        loops) is read from the original, so that ``pkgutil.get_data`` and
        the source meet plain python's error, with the original's path.
        Bytecode the copy lacks is only missing: the source is compiled.
        """
        try:
            return super().get_data(path)
        except FileNotFoundError:
            if path.endswith(tuple(BYTECODE_SUFFIXES)):
                raise
        if self.live.fetch(path):
            return super().get_data(path)
        return _finders._SourceFileLoader.get_data(self, path)

    def path_stats(self, path):
        """The source's stamp: the valid bytecode's, else the copied source's."""
        stamp = bytecode_stamp(self.live.copy(_finders.cache_from_source(path)))
        if stamp is not None:
            return stamp
        if not _os.path.exists(self.live.copy(path)):
            self.live.fetch(path)
        return super().path_stats(path)

    def get_resource_reader(self, name):
        """Serve ``importlib.resources`` of the package through the copy."""
        return resource_reader(_os.path.dirname(self.path))


def bytecode_stamp(path):
    """Return the source stamp a timestamp ``.pyc`` at *path* holds, or ``None``."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        return None
    if len(head) < 16 or head[:4] != _finders.MAGIC_NUMBER or head[4:8] != bytes(4):
        return None
    mtime = int.from_bytes(head[8:12], "little")
    return {"mtime": mtime, "size": int.from_bytes(head[12:16], "little")}


def live_path(*parts):
    """Return a :class:`LivePath` of *parts* (the class is made on first use)."""
    if "path" not in _MADE:
        _MADE["path"] = make_live_path()
    return _MADE["path"](*parts)


def resource_reader(folder):
    """Return an ``importlib.resources`` reader of the package in *folder*."""
    if "resources" not in _MADE:
        try:
            from importlib.resources.abc import TraversableResources
        except ImportError:  # Python 3.10
            from importlib.abc import TraversableResources

        class LiveResources(TraversableResources):
            """``importlib.resources`` of a package served live."""

            def __init__(self, folder):
                self.folder = folder

            def files(self):
                """The package's directory, as a :class:`LivePath`."""
                return live_path(self.folder)

        _MADE["resources"] = LiveResources
    return _MADE["resources"](folder)


def make_live_path():
    """Make the :class:`LivePath` class (``pathlib`` is imported only now)."""
    import pathlib

    class LivePath(type(pathlib.Path())):
        """A path of an original whose reads and listings are served live.

        It is the original path (``str()``, ``stat``, ``glob``, ``as_file``
        see the original), but ``open`` for reading, ``read_*``,
        ``iterdir``, ``is_dir``, ``is_file`` and ``exists`` go through the
        node's copy and the listings; derived paths (``/``, ``parent``) too.
        With no live session they are plain paths.
        """

        def served(self):
            """Return the live session if it serves this path, else ``None``."""
            live = CURRENT[0]
            return live if live is not None and live.usable() else None

        def entry(self):
            """Return what :func:`entry_kind` says of this path, or ``None``."""
            live = self.served()
            if live is None:
                return None
            try:
                entries = live.served_listing(_os.path.dirname(str(self)))
            except Unknown:
                return None
            return entry_kind(entries, self.name) if entries else "absent"

        def open(
            self, mode="r", buffering=-1, encoding=None, errors=None, newline=None
        ):
            """Open for reading from the copy; anything else as a plain path."""
            live = self.served()
            if live is not None and set(mode) <= set("rbt"):
                kind = self.entry()
                if kind == "absent":
                    raise FileNotFoundError(2, "No such file or directory", str(self))
                # A link that leads nowhere (dangling, a loop, through a
                # directory the user cannot search) fails on the original, as
                # plain python's open does: ENOENT, ELOOP or EACCES.
                copy = live.fetch(str(self)) if kind == "file" else None
                if copy:
                    return open(copy, mode, buffering, encoding, errors, newline)
            return super().open(mode, buffering, encoding, errors, newline)

        def read_bytes(self):
            """Read the whole file (from the copy)."""
            with self.open("rb") as f:
                return f.read()

        def read_text(self, encoding=None, errors=None):
            """Read the whole file as text (from the copy)."""
            with self.open("r", encoding=encoding, errors=errors) as f:
                return f.read()

        def iterdir(self):
            """List the directory from its listing."""
            live = self.served()
            entries = Ellipsis
            if live is not None and live.serves(str(self)):
                try:
                    entries = live.listing(str(self))
                except Unknown:
                    pass
            if entries is None or entries is False:
                raise FileNotFoundError(2, "No such directory", str(self))
            if entries is Ellipsis:
                return super().iterdir()
            return iter([self / entry_name(e) for e in entries])

        def is_dir(self):
            """Whether the listing shows a directory."""
            kind = self.entry()
            return kind == "dir" if kind else super().is_dir()

        def is_file(self):
            """Whether the listing shows a file."""
            kind = self.entry()
            return kind == "file" if kind else super().is_file()

        def exists(self):
            """Whether the listing shows this entry."""
            kind = self.entry()
            return kind in ("dir", "file", "other") if kind else super().exists()

    return LivePath


class LiveMetaFinder(_finders.ServingMetaFinder):
    """Stands in for ``PathFinder``: distributions of served directories from listings.

    ``importlib.metadata`` finds distributions in served directories from
    their listings, as ``importlib.metadata.Lookup`` does, and reads their
    files through :class:`LivePath`.
    """

    def __init__(self, base, live):
        super().__init__(base)
        self.live = live

    def distributions(self, folder, name):
        """Return the distributions in a served *folder*, or ``None`` if not served."""
        from importlib.metadata import PathDistribution, Prepared

        try:
            entries = self.live.served_listing(folder)
        except Unknown:
            return None
        if not entries:
            return []
        prepared = Prepared(name)
        egg = _os.path.basename(folder).lower().endswith(".egg")
        found = []
        for child in (entry_name(e) for e in entries):
            low = child.lower()
            if low.endswith((".dist-info", ".egg-info")):
                name = Prepared.normalize(low.rpartition(".")[0].partition("-")[0])
                match = not prepared or name == prepared.normalized
            elif egg and low == "egg-info":
                stem = _os.path.basename(folder).lower().rpartition(".")[0]
                name = Prepared.legacy_normalize(stem.partition("-")[0])
                match = not prepared or name == prepared.legacy_normalized
            else:
                continue
            if match:
                found.append(PathDistribution(live_path(folder, child)))
        return found

    def invalidate_caches(self):
        """Drop ``PathFinder``'s caches; listings read so far become stale."""
        self.live.invalidate()
        self.base.invalidate_caches()
