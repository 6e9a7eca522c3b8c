"""The finders and loaders that serve a bundled root from its staged copy.

:class:`StagedFinder` is the path entry finder of one bundled root (or of a
directory inside one). It is a ``FileFinder`` to the rest of the ecosystem,
so ``pkg_resources`` and ``pkgutil`` treat bundled roots as the directories
they are, and it answers from the staged copy and the manifest's listing:

- a name in the bundle is found in the staged copy;
- a name the original root does not hold is answered "not here" from the
  listing, without the file system;
- a name the original holds but the bundle lacks is found in the original
  (correct, slower, counted as a miss).

"Holds" is decided as ``FileFinder`` decides it, from the listing of the
directory (the root's, or for a directory the bundle holds in part, the one
recorded in the manifest), so a module the bundle does not hold is found
exactly where plain python finds it.

Which ``__file__`` a served module gets: files that an installed
distribution owns (site-packages) are served with their staged paths, so C
extensions find their ``$ORIGIN`` libraries and data read relative to
``__file__`` is node-local too. Source files no distribution owns (the
script's directory, ``--path`` trees, a package under development, test
files) and the standard library's keep their original ``__file__``: pytest
and coverage compare it with files they find on disk, and coverage knows
the standard library by its place. Their bytes still come from the staged
copy (:class:`TransparentLoader`).

The rest of the import ecosystem is served by wrappers kept here too:
:class:`MetadataFinder` (``importlib.metadata`` from the staged copy, and
``pkgutil``/``pkg_resources`` told of the staged roots when imported) and
:class:`RedirectFinder` (other meta path finders, such as setuptools'
editable installs, load what they find in a bundled tree from the copy).
:mod:`~mpistage.runtime.activate` puts them in place and takes them away.
"""

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
from importlib.machinery import FileFinder as _FileFinder
from importlib.machinery import SourceFileLoader as _SourceFileLoader

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
    "mpistage.runtime.finders",
)


def import_serving(names=SERVING):
    """Import what serving imports needs, before any finder is installed."""
    import importlib

    for name in names:
        importlib.import_module(name)


class BundledRoot:
    """What activation knows of one bundled root."""

    def __init__(self, path, staged, listing, partial=None, owned=(), stdlib=False):
        from mpistage.runtime.roots import module_names

        self.path, self.staged, self.listing = path, staged, listing
        self.names = module_names(listing)
        self.partial, self.owned = dict(partial or {}), frozenset(owned)
        self.stdlib, self.unbundled_dists = stdlib, False

    def names_in(self, rel):
        """The names a lookup in directory *rel* of this root may find in the original.

        Empty for a directory the bundle holds whole; for one it holds in
        part, the names of the listing recorded when it was bundled (the
        staleness check keeps that true); ``None`` (ask the original every
        time) when no listing was recorded.
        """
        from mpistage.runtime.roots import module_names

        if rel not in self.partial:
            return frozenset()
        found = self.partial[rel]
        if isinstance(found, list):
            found = self.partial[rel] = frozenset(module_names(found))
        return found

    def transparent(self, rel):
        """Whether the source file *rel* keeps its original ``__file__``."""
        return rel.endswith(".py") and (self.stdlib or rel not in self.owned)

    def metadata_paths(self):
        """Where ``importlib.metadata`` looks for this root's distributions."""
        found = [self.staged] if self.staged else []
        return found + [self.path] if self.unbundled_dists else found


class StagedFinder(_FileFinder):
    """The path entry finder of one bundled directory: staged copy, then original.

    *names* are the module names the original holds (``None``: unknown, so
    try the original on every miss).
    """

    def __init__(self, root, original, staged, names):
        super().__init__(original)
        self.root, self.staged, self.names = root, staged, names
        self._finders = {}

    def __repr__(self):
        return f"StagedFinder({self.path!r}, staged={self.staged!r})"

    def finder(self, path):
        """Return the regular finder of *path*, made once by the other hooks."""
        if path not in self._finders:
            self._finders[path] = regular_finder(path)
        return self._finders[path]

    def find_spec(self, fullname, target=None):
        """Find *fullname* in the staged copy, else where the listing says."""
        spec = None
        if self.staged is not None:
            spec = self.finder(self.staged).find_spec(fullname, target)
            if spec is not None:
                return self.present(spec)
        if self.names is None or fullname.rpartition(".")[2] in self.names:
            spec = self.finder(self.path).find_spec(fullname, target)
        return spec

    def present(self, spec):
        """Give a spec found in the staged copy the ``__file__`` it should show."""
        if not spec.has_location or not spec.origin or not self.root.staged:
            return spec
        if not self.root.transparent(_os.path.relpath(spec.origin, self.root.staged)):
            return spec
        return transparent_spec(spec, self.root)

    def below(self, path):
        """Return the finder of a directory *path* inside this root, or ``None``.

        Packages imported before activation keep their original ``__path__``;
        their submodules are served from the staged copy all the same. A
        directory the bundle holds whole answers absent names itself; one it
        holds in part falls back to the original for the names it left out.
        """
        if self.staged is None or not path.startswith(self.path + _os.sep):
            return None
        rel = path[len(self.path) + 1 :]
        inside = _os.path.join(self.staged, rel)
        if not _os.path.isdir(inside):
            return None
        return StagedFinder(self.root, path, inside, self.root.names_in(rel))

    def iter_modules(self, prefix=""):
        """Yield ``(name, ispkg)`` as ``pkgutil`` would for the original directory."""
        return listed_modules(self.entries(), self.is_package, prefix)

    def entries(self):
        """The directory's entries, directories ending in ``/``: listing or copy."""
        from mpistage.runtime.roots import listing

        if self.path == self.root.path:
            return self.root.listing
        return listing(self.staged or self.path)

    def is_package(self, name):
        """Whether the directory *name* holds an ``__init__`` module."""
        for base in (self.staged, self.path):
            if base and _os.path.isdir(_os.path.join(base, name)):
                return any(
                    entry.startswith("__init__.")
                    for entry in _os.listdir(_os.path.join(base, name))
                )
        return False

    def invalidate_caches(self):
        """Drop the cached directory listings of both finders."""
        for finder in self._finders.values():
            finder.invalidate_caches()


def listed_modules(entries, is_package, prefix=""):
    """Yield ``(name, ispkg)`` of a directory's *entries* as ``pkgutil`` does.

    *entries* end in ``/`` for directories; ``is_package(name)`` says
    whether the directory *name* holds an ``__init__`` module.
    """
    yielded = set()
    for entry in entries:
        name = entry.rstrip("/")
        module, package = module_name(name), False
        if not module and entry.endswith("/") and "." not in name:
            module, package = name, is_package(name)
            if not package:
                continue
        if module and module != "__init__" and "." not in module:
            if module not in yielded:
                yielded.add(module)
                yield prefix + module, package


def module_name(filename):
    """Return the module name of *filename* as ``inspect.getmodulename`` does."""
    from mpistage.runtime.roots import import_suffixes

    for suffix in sorted(import_suffixes(), key=len, reverse=True):
        if filename.endswith(suffix):
            return filename[: -len(suffix)]
    return None


def regular_finder(path):
    """Return the finder the standard path hooks give *path*.

    Every hook of mpistage is skipped (bundled and live ones): the regular
    finder is what reads the originals when a copy cannot serve.
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


class StagedHook:
    """A path hook that hands out a :class:`StagedFinder` for bundled directories.

    It serves each bundled root, each directory inside one (a package's
    ``__path__`` may point to the original) and, for packages the bundle
    holds in part, their directories in the staged copy.
    """

    mpistage_hook = True  # not a regular hook (regular_finder)

    def __init__(self, finders, partial=None):
        self.finders, self.partial = finders, partial or {}

    def __call__(self, path):
        """Return the finder of *path*: a bundled root, a directory in one, a copy."""
        path = _os.path.abspath(path or ".")
        finder = self.finders.get(path) or self.partial.get(path)
        for root in self.finders.values():
            finder = finder or root.below(path)
        if finder is None:
            raise ImportError("not a bundled root", path=path)
        return finder


class TransparentLoader(_SourceFileLoader):
    """Load a source module from the staged copy under its original path.

    Every path the import system asks about (the source, its bytecode) is
    mapped from the original root to the staged copy; ``__file__``,
    ``__cached__`` and tracebacks show the original.
    """

    def __init__(self, fullname, path, root):
        super().__init__(fullname, path)
        self.root = root

    def staged_path(self, path):
        """Map a path below the original root to the staged copy."""
        head = self.root.path + _os.sep
        if self.root.staged is None or not path.startswith(head):
            return path  # activation has ended: the original is what there is
        return self.root.staged + path[len(self.root.path) :]

    def get_data(self, path):
        """Read *path* from the staged copy."""
        return super().get_data(self.staged_path(path))

    def path_stats(self, path):
        """Stat *path* in the staged copy."""
        return super().path_stats(self.staged_path(path))

    def set_data(self, path, data, *, _mode=0o666):
        """Write bytecode into the staged copy, never the original."""
        return super().set_data(self.staged_path(path), data, _mode=_mode)

    def get_resource_reader(self, name):
        """Serve ``importlib.resources`` of the package from the staged copy."""
        from importlib.resources.readers import FileReader

        reader = FileReader(self)
        reader.path = type(reader.path)(self.staged_path(str(reader.path)))
        return reader


def transparent_spec(spec, root):
    """Return *spec* (found in the staged copy) with original paths."""
    original = root.path + spec.origin[len(root.staged) :]
    locations = None
    if spec.submodule_search_locations is not None:
        locations = [_os.path.dirname(original)]
    loader = TransparentLoader(spec.name, original, root)
    return spec_from_file_location(
        spec.name, original, loader=loader, submodule_search_locations=locations
    )


# -- the rest of the ecosystem: metadata, pkgutil, pkg_resources, other finders --


class MetadataFinder:
    """Stands in for ``PathFinder`` in ``sys.meta_path``.

    Finding modules is left to ``PathFinder``; finding distributions
    (``importlib.metadata``) looks at the staged copy of each bundled root,
    and at the original after it only when the original holds distributions
    the bundle lacks. It also lets ``pkgutil`` and ``pkg_resources`` know
    the staged roots when they are imported.
    """

    def __init__(self, base, roots):
        self.base, self.roots = base, roots

    def __getattr__(self, name):
        return getattr(self.base, name)

    def find_spec(self, fullname, path=None, target=None):
        """Find a module as ``PathFinder`` does; prepare pkgutil, pkg_resources."""
        spec = self.base.find_spec(fullname, path, target)
        if spec is not None and fullname in AFTER_IMPORT:
            spec.loader = Prepared(spec.loader, fullname, self.roots)
        return spec

    def find_distributions(self, context=None):
        """Find distributions, reading bundled roots from their staged copy."""
        from importlib.metadata import DistributionFinder

        context = context or DistributionFinder.Context()
        path = metadata_path(context.path, self.roots)
        return self.base.find_distributions(
            DistributionFinder.Context(name=context.name, path=path)
        )


def metadata_path(entries, roots, keep=False):
    """Return *entries* with each bundled root replaced by where its metadata is.

    A root the bundle holds nothing of is dropped when its listing shows no
    distributions; with *keep*, it stays (``pkg_resources`` also imports
    through this path while it scans).
    """
    path = []
    for entry in entries:
        root = roots.get(_os.path.abspath(entry or "."))
        if root is None or (keep and root.staged is None):
            path.append(entry)
        else:
            path += root.metadata_paths()
    return path


class Prepared:
    """A loader that runs ``pkgutil`` or ``pkg_resources`` with staged roots known."""

    def __init__(self, loader, name, roots):
        self.loader, self.name, self.roots = loader, name, roots

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def create_module(self, spec):
        """Create the module as the real loader does."""
        return self.loader.create_module(spec)

    def exec_module(self, module):
        """Run the module; for ``pkg_resources``, with staged metadata on sys.path.

        ``pkg_resources`` scans ``sys.path`` for distributions once, while it
        is imported; scanning the staged copies keeps that node-local.
        """
        module.__loader__ = module.__spec__.loader = self.loader
        saved = _sys.path[:]
        if self.name == "pkg_resources":
            _sys.path[:] = metadata_path(saved, self.roots, keep=True)
        try:
            self.loader.exec_module(module)
        finally:
            _sys.path[:] = saved
        AFTER_IMPORT[self.name](module)


def register_pkgutil(pkgutil):
    """Let ``pkgutil.iter_modules`` list bundled roots from their listings."""

    @pkgutil.iter_importer_modules.register(StagedFinder)
    def _iter_staged(importer, prefix=""):
        return importer.iter_modules(prefix)


def register_pkg_resources(pkg_resources):
    """Let later ``pkg_resources`` scans of bundled roots read the staged copy."""

    def find_staged(importer, path_item, only=False):
        for path in importer.root.metadata_paths():
            yield from pkg_resources.find_on_path(importer, path, only)

    pkg_resources.register_finder(StagedFinder, find_staged)


AFTER_IMPORT = {"pkgutil": register_pkgutil, "pkg_resources": register_pkg_resources}


class RedirectFinder:
    """Wraps a meta path finder so that what it finds in a bundled tree is staged."""

    def __init__(self, base, roots):
        self.base, self.roots = base, roots

    def __getattr__(self, name):
        return getattr(self.base, name)

    def find_spec(self, fullname, path=None, target=None):
        """Ask the wrapped finder; load a module of a bundled tree from the copy."""
        from importlib.machinery import (
            ExtensionFileLoader,
            SourceFileLoader,
            SourcelessFileLoader,
        )

        spec = self.base.find_spec(fullname, path, target)
        plain = (SourceFileLoader, SourcelessFileLoader, ExtensionFileLoader)
        if spec is None or type(spec.loader) not in plain or not spec.has_location:
            return spec  # A loader of its own (pytest's rewriting): left alone.
        return staged_spec(spec, self.roots) or spec


def staged_spec(spec, roots):
    """Return a spec that loads *spec*'s file from the staged copy, or ``None``."""
    for root in roots.values():
        if root.staged and spec.origin.startswith(root.path + _os.sep):
            copy = root.staged + spec.origin[len(root.path) :]
            if not _os.path.isfile(copy):
                return None
            package = spec.submodule_search_locations is not None
            locations = [_os.path.dirname(copy)] if package else None
            found = spec_from_file_location(
                spec.name, copy, submodule_search_locations=locations
            )
            rel = copy[len(root.staged) + 1 :]
            return transparent_spec(found, root) if root.transparent(rel) else found
    return None


def wrap_meta_finders(roots):
    """Wrap the meta path finders that are not the standard ones; return them."""
    from importlib.machinery import BuiltinImporter, FrozenImporter

    standard = (BuiltinImporter, FrozenImporter)
    wrapped = []
    for index, finder in enumerate(_sys.meta_path):
        if finder in standard or isinstance(finder, MetadataFinder):
            continue
        if type(finder).__module__.startswith(("mpistage", "_frozen_importlib")):
            continue
        if not hasattr(finder, "find_spec"):
            continue
        _sys.meta_path[index] = RedirectFinder(finder, roots)
        wrapped.append(_sys.meta_path[index])
    return wrapped


def install_metadata_finder(roots):
    """Put a :class:`MetadataFinder` where ``PathFinder`` is in sys.meta_path."""
    from importlib.machinery import PathFinder

    for index, finder in enumerate(_sys.meta_path):
        if finder is PathFinder:
            _sys.meta_path[index] = MetadataFinder(finder, roots)
            return _sys.meta_path[index]
    return None
