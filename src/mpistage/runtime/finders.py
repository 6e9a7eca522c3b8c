"""One way to serve imports: what bundled and live imports both stand on.

A rank imports from its node's *copy* of the originals: the staged copy of a
bundle (:mod:`~mpistage.runtime.activate`) or the live copy the reader fills
as the job runs (:mod:`~mpistage.runtime.live.finder`). Both are served by
the same machinery, and differ only in where listings and files come from:

- *listings* (:mod:`~mpistage.runtime.listings`): a directory's entries,
  what is no regular file or directory marked; ``locate`` decides from
  them what ``FileFinder`` would find, so a name that is not there is
  answered without the file system;
- :class:`ServingFinder` is the path entry finder of one served directory:
  it locates, loads what it found from the copy (a module keeps its
  original ``__file__`` where the subclass says so: :class:`CopyLoader`,
  :class:`CopyBytecodeLoader`, :class:`CopyExtensionLoader`), and asks
  the regular finder (:func:`regular_finder`, never one of
  mpistage's) for what the copy cannot serve; it lists modules for
  ``pkgutil.iter_modules`` (:func:`register_pkgutil`);
- :class:`ServingMetaFinder` stands in for ``PathFinder``: it finds
  distributions for ``importlib.metadata`` and tells modules such as
  ``pkgutil`` of the finders when they are imported;
- :func:`repoint` points what was loaded from a copy back at the originals
  before the copy is removed.

What serving needs is imported before any finder is installed
(:data:`SERVING`).
"""

import _imp
import os as _os
import sys as _sys

# The import system's helpers, from its frozen core rather than
# ``importlib.util``: not every Python has that loaded at start-up (an mpi4py
# built from source does not import it), and importing it would pass through
# these very finders while they need it.
from _frozen_importlib_external import (  # noqa: F401  (one home, see SERVING)
    MAGIC_NUMBER,
    cache_from_source,
    spec_from_file_location,
)
from importlib.machinery import ExtensionFileLoader as _ExtensionFileLoader
from importlib.machinery import FileFinder as _FileFinder
from importlib.machinery import ModuleSpec as _ModuleSpec
from importlib.machinery import PathFinder as _PathFinder
from importlib.machinery import SourceFileLoader as _SourceFileLoader
from importlib.machinery import SourcelessFileLoader as _SourcelessFileLoader

from mpistage.runtime.listings import listed_modules, locate, module_name, plain

# What mpistage's finders (bundled and live), the live request path and the
# runner use while they serve imports. It is imported before any of them is
# installed: an import of theirs that passed through the finders themselves
# would find a module they need half-initialized (``cannot import name ...
# from partially initialized module``). tests/test_live_rules.py parses the
# serving modules to keep the list whole.
SERVING = (
    "pickle",
    "stat",
    "time",
    "types",
    "mpistage.runtime.roots",
    "mpistage.runtime.listings",
    "mpistage.runtime.finders",
)

# The loader of each kind of module file :func:`locate` finds.
LOADERS = {
    "extension": _ExtensionFileLoader,
    "source": _SourceFileLoader,
    "bytecode": _SourcelessFileLoader,
}


def import_serving(names=SERVING):
    """Import what serving imports needs, before any finder is installed."""
    import importlib

    for name in names:
        importlib.import_module(name)


class Unknown(LookupError):
    """A listing that cannot be had: the regular finder looks instead."""


# -- the regular finder: what reads the originals --------------------------------------


def regular_finder(path):
    """Return the finder the standard path hooks give *path*.

    Every hook of mpistage is skipped (bundled and live ones): the regular
    finder is what reads the originals when a copy cannot serve, and asking
    a finder of ours again would only come back here.
    """
    for hook in _sys.path_hooks:
        if not getattr(hook, "mpistage_hook", False):
            try:
                return hook(path)
            except ImportError:
                continue
    return NoFinder()  # as PathFinder keeps None: nothing is found there


class NoFinder:
    """The finder of a path no regular hook takes (a missing zip file)."""

    def find_spec(self, fullname, target=None):
        """Nothing is here."""
        return None

    def invalidate_caches(self):
        """Nothing to drop."""

    def iter_modules(self, prefix=""):
        """Nothing to list."""
        return iter(())


# -- the path hook, the path entry finder and the source loader ----------------------


class ServingHook:
    """A path hook first in ``sys.path_hooks``: a finder for each served directory.

    Subclasses say which directories they serve (:meth:`finder`).
    """

    mpistage_hook = True  # not a regular hook (regular_finder)

    def __call__(self, path):
        """Return the finder of *path*, or refuse it as no finder of ours."""
        finder = self.finder(_os.path.abspath(path or "."))
        if finder is None:
            raise ImportError("not served", path=path)
        return finder

    def finder(self, folder):
        """Return the finder of the absolute *folder*, or ``None``."""
        raise NotImplementedError


class ServingFinder(_FileFinder):
    """The path entry finder of one served directory, from listings.

    It is a ``FileFinder`` to the rest of the ecosystem (``pkg_resources``
    and ``pkgutil`` treat served directories as the directories they are).
    It finds a name as ``FileFinder`` would (:func:`locate`) and loads it
    from the copy; what the copy does not hold is the regular finder's.
    Paths are the originals' throughout; a subclass says where listings
    and files come from:

    - :meth:`listing` of an original directory;
    - :meth:`copy`: where an original file is in the copy;
    - :meth:`holds`: whether the copy holds the file of module *name* (it
      may ask for it);
    - :meth:`keeps_original`: whether a module shows its original
      ``__file__`` and its package its original ``__path__`` (its code
      still comes from the copy: :meth:`original_loader`);
    - :meth:`package_dir`: where a package loaded from the copy searches;
    - :meth:`unlisted`: what to do with a name the listing lacks.

    A module that shows its copy's path finds beside it what its copy's
    directory holds: a subclass shows one only where that is what the
    original's directory holds too.
    """

    def __init__(self, path):
        super().__init__(path)
        self._regular = None

    def regular(self):
        """The finder plain python would use here (for what cannot be served)."""
        if self._regular is None:
            self._regular = regular_finder(self.path)
        return self._regular

    def usable(self):
        """Whether the copy serves imports in this process now."""
        return True

    def find_spec(self, fullname, target=None):
        """Find *fullname* here, from listings, loading from the copy."""
        if not self.usable():
            return self.regular().find_spec(fullname, target)
        name = fullname.rpartition(".")[2]
        try:
            found = self.located(name)
        except Unknown:
            return self.regular().find_spec(fullname, target)
        if found is None:
            return self.unlisted(fullname, target)
        kind, path, search = found
        if kind != "namespace" and not self.holds(name, kind, path):
            return self.regular().find_spec(fullname, target)
        return self.spec(fullname, kind, path, search)

    def located(self, name):
        """Return what :func:`locate` finds of *name* in this directory."""
        return locate(self.listing, self.path, name)

    def unlisted(self, fullname, target):
        """A name the listing lacks is not here (plain python finds none either)."""
        return None

    def spec(self, fullname, kind, path, search):
        """Return the spec of the module *path* (an original) of *kind*."""
        if kind == "namespace":
            spec = _ModuleSpec(fullname, None)
            spec.submodule_search_locations = [self.package_dir(path)]
            return spec
        if self.keeps_original(path):
            origin, loader = path, self.original_loader(kind, fullname, path)
        else:
            origin = self.copy(path)
            loader = LOADERS[kind](fullname, origin)
            if search is not None:
                search = [self.package_dir(search[0])]
        return spec_from_file_location(
            fullname, origin, loader=loader, submodule_search_locations=search
        )

    def original_loader(self, kind, fullname, path):
        """The loader of a module shown at its original *path*, read from the copy."""
        if kind == "source":
            return self.source_loader(fullname, path)
        return MAPPED[kind](fullname, path, self.staged_path)

    def staged_path(self, path):
        """Where the original *path* is read from now (the copy while it serves)."""
        return self.copy(path)

    def package_dir(self, folder):
        """Where a package (or portion) loaded from the copy at *folder* searches."""
        return self.copy(folder)

    def iter_modules(self, prefix=""):
        """Yield ``(name, ispkg)`` as ``pkgutil`` would for the original directory."""
        try:
            entries = self.entries()
        except Unknown:
            entries = ()
        return listed_modules(plain(entries) or (), self.is_package, prefix)

    def entries(self):
        """This directory's entries, as ``pkgutil`` should see them."""
        return self.listing(self.path)

    def is_package(self, name):
        """Whether the directory *name* holds an ``__init__`` module."""
        try:
            entries = self.listing(f"{self.path}/{name}") or ()
        except Unknown:
            return False
        return any(module_name(e) == "__init__" for e in entries)

    def invalidate_caches(self):
        """Drop the regular finder's cached listing."""
        if self._regular is not None:
            self._regular.invalidate_caches()


class CopyLoader(_SourceFileLoader):
    """Load a source module from the copy under its original path.

    Every path the import system asks about (the source, its bytecode) is
    mapped to the copy (:meth:`staged_path`); ``__file__``, ``__cached__``
    and tracebacks show the original, and bytecode is written into the
    copy, never next to the original.
    """

    def staged_path(self, path):
        """Return where the original *path* is in the copy."""
        raise NotImplementedError

    def get_data(self, path):
        """Read *path* from the copy."""
        return super().get_data(self.staged_path(path))

    def path_stats(self, path):
        """Stat *path* in the copy."""
        return super().path_stats(self.staged_path(path))

    def set_data(self, path, data, *, _mode=0o666):
        """Write bytecode into the copy, never the original."""
        return super().set_data(self.staged_path(path), data, _mode=_mode)


class CopyBytecodeLoader(_SourcelessFileLoader):
    """Load a bytecode-only module from the copy under its original path."""

    def __init__(self, fullname, path, staged_path):
        super().__init__(fullname, path)
        self.staged_path = staged_path

    def get_data(self, path):
        """Read *path* from the copy."""
        return super().get_data(self.staged_path(path))


class CopyExtensionLoader(_ExtensionFileLoader):
    """Load an extension module from the copy under its original path.

    The dynamic loader maps the copy, so the libraries it needs through
    ``$ORIGIN`` are the copy's too; ``__file__`` and the spec show the
    original, so that what a program finds beside the module is what plain
    python finds there.
    """

    def __init__(self, fullname, path, staged_path):
        super().__init__(fullname, path)
        self.staged_path = staged_path

    def create_module(self, spec):
        """Load the copy; show the original's path."""
        copy = _ModuleSpec(spec.name, self, origin=self.staged_path(spec.origin))
        module = _imp.create_dynamic(copy)
        try:  # a single-phase module was given the path it was loaded from
            module.__file__ = spec.origin
        except AttributeError:
            pass  # no module object (``Py_mod_create``): it shows what it shows
        return module


# The loaders of the modules :meth:`ServingFinder.original_loader` maps.
MAPPED = {"bytecode": CopyBytecodeLoader, "extension": CopyExtensionLoader}


def register_pkgutil(pkgutil):
    """Let ``pkgutil.iter_modules`` list served directories from their listings."""

    @pkgutil.iter_importer_modules.register(ServingFinder)
    def _iter_served(importer, prefix=""):
        return importer.iter_modules(prefix)


# -- distributions, and modules told of the finders ------------------------------------


class MetaWrapper:
    """A meta path finder standing in for another (*base*), which it forwards to."""

    def __init__(self, base):
        self.base = base

    def __getattr__(self, name):
        return getattr(self.base, name)


class ServingMetaFinder(MetaWrapper):
    """Stands in for ``PathFinder`` in ``sys.meta_path``.

    Finding modules is left to ``PathFinder`` (and so to the path hook);
    ``importlib.metadata`` finds the distributions of a served directory
    where the subclass says (:meth:`distributions`), others as usual. A
    module named in :attr:`AFTER` is told of the finders once it has run
    (``pkgutil`` of the served finders, :func:`register_pkgutil`).
    """

    AFTER = {"pkgutil": register_pkgutil}

    def find_spec(self, fullname, path=None, target=None):
        """Find a module as ``PathFinder`` does; prepare those named in AFTER."""
        spec = self.base.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None and fullname in self.AFTER:
            spec.loader = AfterImport(spec.loader, fullname, self)
        return spec

    def find_distributions(self, context=None):
        """Find distributions: served directories as served, others as usual."""
        from importlib.metadata import DistributionFinder

        context = context or DistributionFinder.Context()
        for entry in context.path:
            found = self.distributions(_os.path.abspath(entry or "."), context.name)
            if found is None:
                one = DistributionFinder.Context(name=context.name, path=[entry])
                found = self.base.find_distributions(one)
            yield from found

    def distributions(self, folder, name):
        """Return the distributions called *name* in a served *folder*, or ``None``."""
        return None

    def run(self, loader, module):
        """Run a module named in AFTER, as its own *loader* does."""
        loader.exec_module(module)


class AfterImport:
    """A loader that runs a module as its own does, then tells it of the finders."""

    def __init__(self, loader, name, meta):
        self.loader, self.name, self.meta = loader, name, meta

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def create_module(self, spec):
        """Create the module as the real loader does."""
        return self.loader.create_module(spec)

    def exec_module(self, module):
        """Run the module (:meth:`ServingMetaFinder.run`), then tell it."""
        module.__loader__ = module.__spec__.loader = self.loader
        self.meta.run(self.loader, module)
        self.meta.AFTER[self.name](module)


# -- putting the finders in place and taking them away ---------------------------------


def stand_in(make):
    """Put ``make(PathFinder)`` where ``PathFinder`` is in sys.meta_path; return it."""
    for index, finder in enumerate(_sys.meta_path):
        if finder is _PathFinder:
            _sys.meta_path[index] = make(finder)
            return _sys.meta_path[index]
    return None


def step_aside(wrappers):
    """Put the finders that *wrappers* (:class:`MetaWrapper`) wrap back in place."""
    for index, finder in enumerate(_sys.meta_path):
        if any(finder is wrapper for wrapper in wrappers):
            _sys.meta_path[index] = finder.base


def forget(served):
    """Drop cached path finders of the directories *served(path)* says are served."""
    for path in list(_sys.path_importer_cache):
        if served(_os.path.abspath(path or ".")):
            del _sys.path_importer_cache[path]


def drop_finders(kind):
    """Drop the cached path finders that are instances of *kind*."""
    for path, finder in list(_sys.path_importer_cache.items()):
        if isinstance(finder, kind):
            del _sys.path_importer_cache[path]


def repoint(copies):
    """Point what was loaded from a copy back at the originals.

    *copies* are ``(copy, original)`` directory pairs. The copy is removed
    when serving ends. A package whose ``__path__`` named it could import
    no submodule it had not imported yet, and a ``__file__`` naming it
    would lead to a file that is gone: so every module's ``__file__``,
    ``__cached__``, ``__path__``, spec and loader path, and ``sys.path``,
    are mapped to the originals.
    """
    if not copies:
        return

    def original(path):
        for copy, orig in copies:
            if isinstance(path, str) and (path + _os.sep).startswith(copy + _os.sep):
                return orig + path[len(copy) :]
        return path

    for module in list(_sys.modules.values()):
        repoint_module(module, original)
    _sys.path[:] = [original(p) for p in _sys.path]


def namespace_of(module):
    """Return a module's ``__dict__`` without running its code, or ``None``.

    A lazily loaded module (``importlib.util.LazyLoader``) would load itself
    on any attribute looked up the usual way.
    """
    from types import ModuleType

    if not isinstance(module, ModuleType):
        return None
    return object.__getattribute__(module, "__dict__")


def repoint_module(module, original):
    """Map the paths of one module (see :func:`repoint`) with *original*."""
    namespace = namespace_of(module)
    if namespace is None:
        return
    for key in ("__file__", "__cached__"):
        if isinstance(namespace.get(key), str):
            namespace[key] = original(namespace[key])
    spec = namespace.get("__spec__")
    for paths in (
        namespace.get("__path__"),
        getattr(spec, "submodule_search_locations", None),
    ):
        paths = getattr(paths, "_path", paths)  # a namespace package's path
        if isinstance(paths, list):
            paths[:] = [original(p) for p in paths]
    if spec is not None and isinstance(getattr(spec, "origin", None), str):
        spec.origin = original(spec.origin)
        if spec.cached:
            spec.cached = original(spec.cached)
    for loader in {
        id(x): x for x in (namespace.get("__loader__"), getattr(spec, "loader", None))
    }.values():
        if isinstance(getattr(loader, "path", None), str):
            try:
                loader.path = original(loader.path)
            except AttributeError:
                pass  # a loader whose path cannot be set
