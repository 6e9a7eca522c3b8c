"""The live finder: ranks import from the node's copy as the reader fills it.

A path hook first in ``sys.path_hooks`` (:class:`LiveHook`) serves every
directory at or below the roots of the job (the ``sys.path`` entries when
it starts, and the target's directory) with a :class:`LiveFinder`. It
decides as ``FileFinder`` does (:func:`locate`), but from the listings the
reader sent (:mod:`~.mirror`), so a name that is not there is answered from
memory. A module that is not in the node's copy yet is asked for along the
request path (:mod:`~.request`): one message brings its listing and files.

Which ``__file__`` a module gets: source modules keep their original path
(tracebacks, ``inspect``, pytest and coverage see the files they expect,
and data read relative to ``__file__`` is read from the original, as with
plain python); their bytes come from the copy (:class:`LiveSourceLoader`).
Extensions are loaded from the copy, where the libraries they need from
``$ORIGIN`` are too.

``importlib.resources`` and ``importlib.metadata`` read through the copy
too: ``LivePath`` is a ``pathlib`` path of the original whose
reads, listings and type checks are served live, and :class:`LiveMetaFinder`
finds distributions in the listings. Whatever cannot be served (a file the
reader could not read, the session closed, a forked child) is read from the
original: correct, only slower.
"""

import os as _os
from importlib.machinery import FileFinder as _FileFinder
from importlib.machinery import SourceFileLoader as _SourceFileLoader

CURRENT = [None]  # the live session of this process, for LivePath
_MADE = {}  # classes made on first use: pathlib and importlib.resources load late
# Marks of listing entries that are no regular file or directory (no file
# name holds a NUL): a FIFO, socket or device; a link to nothing.
OTHER, DANGLING = "\0o", "\0x"


def entry_name(entry):
    """Return the name a listing *entry* stands for, without its mark."""
    return entry.partition("\0")[0].rstrip("/")


def entry_kind(entries, name):
    """Return ``dir``, ``file``, ``other``, ``dangling`` or ``absent``."""
    for mark, kind in (("/", "dir"), ("", "file"), (OTHER, "other")):
        if name + mark in entries:
            return kind
    return "dangling" if name + DANGLING in entries else "absent"


class Unknown(LookupError):
    """A listing the request path could not bring: use the regular finder."""


def loader_kinds():
    """Return (kind, suffixes) in the order ``FileFinder`` tries them."""
    from importlib.machinery import (
        BYTECODE_SUFFIXES,
        EXTENSION_SUFFIXES,
        SOURCE_SUFFIXES,
    )

    return (
        ("extension", EXTENSION_SUFFIXES),
        ("source", SOURCE_SUFFIXES),
        ("bytecode", BYTECODE_SUFFIXES),
    )


def locate(listing_of, folder, name):
    """Find the module *name* in *folder* as ``FileFinder`` would.

    *listing_of(path)* returns a directory's entries (directories end in
    ``/``), or ``None``/``False`` when there is none. Returns ``(kind,
    path, search)``: kind ``extension``, ``source``, ``bytecode`` or
    ``namespace``; *search* is the package's directory list, else ``None``.
    Returns ``None`` when *folder* holds no such module.
    """
    entries = listing_of(folder)
    if not entries:
        return None
    base, namespace = f"{folder}/{name}", False
    if name + "/" in entries:
        inside = listing_of(base) or ()
        for kind, suffixes in loader_kinds():
            for suffix in suffixes:
                if "__init__" + suffix in inside:
                    return kind, f"{base}/__init__{suffix}", [base]
        namespace = True
    for kind, suffixes in loader_kinds():
        for suffix in suffixes:
            if name + suffix in entries:
                return kind, f"{folder}/{name}{suffix}", None
    return ("namespace", base, [base]) if namespace else None


class LiveHook:
    """A path hook handing out a :class:`LiveFinder` for served directories."""

    mpistage_hook = True  # not a regular hook (finders.regular_finder)

    def __init__(self, live):
        self.live = live

    def __call__(self, path):
        """Return the finder of *path*; refuse what is not served (or a file)."""
        folder = _os.path.abspath(path or ".")
        live = self.live
        if not live.usable() or not live.serves(folder):
            raise ImportError("not served live", path=path)
        try:
            entries = live.listing(folder)
        except Unknown:
            raise ImportError("no listing", path=path) from None
        if entries is False:
            raise ImportError("not a directory", path=path)  # a zip: zipimport's
        return LiveFinder(folder, live)


class LiveFinder(_FileFinder):
    """The path entry finder of one served directory, from listings."""

    def __init__(self, path, live):
        super().__init__(path)
        self.live, self._regular = live, None

    def __repr__(self):
        return f"LiveFinder({self.path!r})"

    def regular(self):
        """The finder plain python would use here (for what cannot be served)."""
        if self._regular is None:
            from mpistage.runtime.finders import regular_finder

            self._regular = regular_finder(self.path)
        return self._regular

    def find_spec(self, fullname, target=None):
        """Find *fullname* here, from listings, loading from the node's copy."""
        live, name = self.live, fullname.rpartition(".")[2]
        if not live.usable():
            return self.regular().find_spec(fullname, target)
        try:
            found = self.located(name)
            if found is None and live.stale(self.path):
                live.refresh(self.path)  # created since it was listed?
                found = self.located(name)
        except Unknown:
            return self.regular().find_spec(fullname, target)
        if found is None:
            return None
        kind, path, search = found
        if kind == "namespace":
            from importlib.machinery import ModuleSpec

            spec = ModuleSpec(fullname, None)
            spec.submodule_search_locations = search
            return spec
        if not live.present(kind, path):
            live.need(live.module_key(self.path, name))
            if not live.present(kind, path):
                return self.regular().find_spec(fullname, target)
        return live_spec(fullname, kind, path, search, live)

    def located(self, name):
        """Locate *name*; a package's listing comes with its files, in one request."""
        live = self.live
        entries = live.listing(self.path)
        base = f"{self.path}/{name}"
        if entries and name + "/" in entries and not live.knows(base):
            live.need(live.module_key(self.path, name))
        return locate(live.listing, self.path, name)

    def iter_modules(self, prefix=""):
        """Yield ``(name, ispkg)`` as ``pkgutil`` does, from the listings."""
        from mpistage.runtime.finders import listed_modules

        try:
            entries = self.live.listing(self.path) or ()
        except Unknown:
            entries = ()
        names = [e if e.endswith("/") else entry_name(e) for e in entries]
        return listed_modules(names, self.is_package, prefix)

    def is_package(self, name):
        """Whether the directory *name* holds an ``__init__`` module."""
        from mpistage.runtime.finders import module_name

        try:
            entries = self.live.listing(f"{self.path}/{name}") or ()
        except Unknown:
            return False
        return any(module_name(e) == "__init__" for e in entries)

    def invalidate_caches(self):
        """Listings are the job's: nothing to drop."""
        if self._regular is not None:
            self._regular.invalidate_caches()


def live_spec(fullname, kind, path, search, live):
    """Return the spec that loads *path* (an original) from the node's copy."""
    from importlib.machinery import ExtensionFileLoader, SourcelessFileLoader

    from mpistage.runtime.finders import spec_from_file_location

    if kind == "source":
        loader = LiveSourceLoader(fullname, path, live)
        origin = path
    else:
        origin = live.copy(path)
        cls = ExtensionFileLoader if kind == "extension" else SourcelessFileLoader
        loader = cls(fullname, origin)
    return spec_from_file_location(
        fullname, origin, loader=loader, submodule_search_locations=search
    )


class LiveSourceLoader(_SourceFileLoader):
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
        """Read *path* from the copy (the source is fetched when needed)."""
        copy = self.live.copy(path)
        try:
            return super().get_data(copy)
        except FileNotFoundError:
            if path != self.path or not self.live.fetch(path):
                raise
        return super().get_data(copy)

    def path_stats(self, path):
        """The source's stamp: the valid bytecode's, else the copied source's."""
        from mpistage.runtime.finders import cache_from_source

        stamp = bytecode_stamp(self.live.copy(cache_from_source(path)))
        if stamp is not None:
            return stamp
        copy = self.live.copy(path)
        if not _os.path.exists(copy):
            self.live.fetch(path)
        return super().path_stats(copy)

    def set_data(self, path, data, *, _mode=0o666):
        """Write bytecode into the copy, never next to the original."""
        return super().set_data(self.live.copy(path), data, _mode=_mode)

    def get_resource_reader(self, name):
        """Serve ``importlib.resources`` of the package through the copy."""
        return resource_reader(_os.path.dirname(self.path))


def bytecode_stamp(path):
    """Return the source stamp a timestamp ``.pyc`` at *path* holds, or ``None``."""
    from mpistage.runtime.finders import MAGIC_NUMBER

    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        return None
    if len(head) < 16 or head[:4] != MAGIC_NUMBER or head[4:8] != bytes(4):
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
            parent = _os.path.dirname(str(self))
            if live is None or not live.serves(parent):
                return None
            try:
                entries = live.listing(parent)
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
                if kind in ("absent", "dangling"):
                    raise FileNotFoundError(2, "No such file or directory", str(self))
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


def register_pkgutil(pkgutil):
    """Let ``pkgutil.iter_modules`` list served directories from their listings."""

    @pkgutil.iter_importer_modules.register(LiveFinder)
    def _iter_live(importer, prefix=""):
        return importer.iter_modules(prefix)


class PkgutilLoader:
    """Loads ``pkgutil`` as its own loader does, then registers live finders."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def create_module(self, spec):
        """Create the module as the real loader does."""
        return self.loader.create_module(spec)

    def exec_module(self, module):
        """Run ``pkgutil``, then teach it the live finders."""
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        register_pkgutil(module)


class LiveMetaFinder:
    """Stands in for ``PathFinder`` in ``sys.meta_path``: distributions from listings.

    Finding modules is left to ``PathFinder`` (and so to :class:`LiveHook`);
    ``importlib.metadata`` finds distributions in served directories from
    their listings, as ``importlib.metadata.Lookup`` does, and reads their
    files through :class:`LivePath`.
    """

    def __init__(self, base, live):
        self.base, self.live = base, live

    def __getattr__(self, name):
        return getattr(self.base, name)

    def find_spec(self, fullname, path=None, target=None):
        """Find a module as ``PathFinder`` does; tell ``pkgutil`` of live finders."""
        spec = self.base.find_spec(fullname, path, target)
        if fullname == "pkgutil" and spec is not None and spec.loader is not None:
            spec.loader = PkgutilLoader(spec.loader)
        return spec

    def find_distributions(self, context=None):
        """Find distributions: served directories from listings, others as usual."""
        from importlib.metadata import DistributionFinder, Prepared

        context = context or DistributionFinder.Context()
        prepared = Prepared(context.name)
        for entry in context.path:
            folder = _os.path.abspath(entry or ".")
            found = self.served_distributions(folder, prepared)
            if found is None:
                one = DistributionFinder.Context(name=context.name, path=[entry])
                found = self.base.find_distributions(one)
            yield from found

    def served_distributions(self, folder, prepared):
        """Return the distributions in a served *folder*, or ``None`` if not served."""
        from importlib.metadata import PathDistribution, Prepared

        live = self.live
        if not live.usable() or not live.serves(folder):
            return None
        try:
            entries = live.listing(folder)
        except Unknown:
            return None
        if not entries:
            return []
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
