"""Step 6: every rank imports from its node's staged copy.

Activation changes four things, and :func:`deactivate` undoes them:

- a path hook first in ``sys.path_hooks`` (:class:`StagedHook`) serves
  each bundled sys.path root from the staged copy, whether the root is on
  ``sys.path`` now or is added later; ``sys.path`` is left as it is;
- ``PathFinder`` in ``sys.meta_path`` is wrapped (:class:`MetadataFinder`)
  so that ``importlib.metadata`` reads distributions from the staged copy;
- other meta path finders (setuptools' finder-based editable installs) are
  wrapped (:class:`RedirectFinder`) so that what they find in a bundled
  tree is loaded from the staged copy too;
- ``PYTHONPATH`` gains a node-local directory whose ``sitecustomize``
  activates the same copy in child processes (``subprocess``,
  ``multiprocessing`` with spawn or forkserver) for the life of the job.

The finders are thin subclasses of :mod:`~mpistage.runtime.finders`', the
one way imports are served (live imports stand on it too); what is
bundled about them is where listings and files come from. A bundled root's
finder (:class:`StagedFinder`) answers from the staged copy and the
manifest's listing:

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
distribution owns (site-packages), of a top-level package the bundle holds
whole, are served with their staged paths, so data read relative to
``__file__`` is node-local too. The others keep their original
``__file__``, their bytes still from the staged copy
(:class:`TransparentLoader`, and the loaders of bytecode and extensions of
:mod:`~mpistage.runtime.finders`, which map an extension from the copy,
where its ``$ORIGIN`` libraries are): source files no distribution owns
(the script's directory, ``--path`` trees, a package under development,
test files) and the standard library's, since pytest and coverage compare
``__file__`` with files they find on disk and coverage knows the standard
library by its place; and every module of a package the bundle holds in
part (:meth:`~mpistage.runtime.listings.BundledRoot.shows_original`),
so that what a program finds beside a module is what plain python finds.

A library that ``ctypes`` is asked to load by the path of its original
below a bundled root (torch preloads CUDA libraries it finds along
``sys.path``: ``nvidia/cuda_nvrtc/lib/libnvrtc.so.12``) is loaded from the
copy when the copy holds it (:class:`mpistage.runtime.libraries.Libraries`),
as the dynamic loader finds the extensions' own libraries there through
``$ORIGIN``.

``pkgutil.iter_modules`` lists bundled roots from their listings, and
``pkg_resources`` builds its working set from the staged copies. After a
``staged()`` block, modules imported inside it are pointed back at the
originals (:func:`~mpistage.runtime.finders.repoint`). What was served is
:func:`mpistage.runtime.report.classify`'s to say.
"""

import os as _os
import sys as _sys

from mpistage.runtime import finders as _finders
from mpistage.runtime import libraries as _libraries
from mpistage.runtime import listings as _listings

CHILD_PLAN = ".mpistage-plan.json"
CHILD_ENV = "MPISTAGE_CHILD"


class StagedFinder(_finders.ServingFinder):
    """The path entry finder of one bundled directory: staged copy, then original.

    Listings are the staged copy's (node-local, read once); *names* are the
    module names the original holds (``None``: unknown, so try the original
    on every miss).
    """

    def __init__(self, root, original, staged, names):
        super().__init__(original)
        self.root, self.staged, self.names = root, staged, names
        self.listed = {}

    def __repr__(self):
        return f"StagedFinder({self.path!r}, staged={self.staged!r})"

    def listing(self, folder):
        """The staged copy's listing of the original *folder* (none without a copy)."""
        if self.staged is None:
            return None
        copy = self.copy(folder)
        if copy not in self.listed:
            self.listed[copy] = _listings.local_listing(copy)
        return self.listed[copy]

    def copy(self, path):
        """Return where *path*, at or below this directory, is in the staged copy."""
        return self.staged + path[len(self.path) :]

    def holds(self, name, kind, path):
        """The staged copy holds whatever its listing shows."""
        return True

    def unlisted(self, fullname, target):
        """A name the copy lacks: the original's, if its listing holds it."""
        if self.names is None or fullname.rpartition(".")[2] in self.names:
            return self.regular().find_spec(fullname, target)
        return None

    def keeps_original(self, path):
        """Whether the module *path* keeps its original ``__file__``.

        Sources no distribution owns do, and so does every module of a
        top-level package the bundle holds in part
        (:meth:`~mpistage.runtime.listings.BundledRoot.shows_original`).
        """
        rel = path[len(self.root.path) + 1 :]
        return self.root.transparent(rel) or self.root.shows_original(
            _os.path.dirname(rel)
        )

    def source_loader(self, fullname, path):
        """The loader of a source that keeps its original ``__file__``."""
        return TransparentLoader(fullname, path, self.root)

    def staged_path(self, path):
        """Where a module shown at its original *path* is read from now."""
        return self.root.staged_path(path)

    def package_dir(self, folder):
        """Where a namespace portion at the original *folder* searches.

        Its original where its package shows its originals.
        """
        if self.root.shows_original(folder[len(self.root.path) + 1 :]):
            return folder
        return self.copy(folder)

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

    def entries(self):
        """The directory's entries, as the original's.

        The root's and those of directories held in part come from the
        listings recorded in the bundle (the original's, when none was);
        a directory held whole lists as its copy.
        """
        from mpistage.runtime.roots import listing

        root = self.root
        if self.path == root.path:
            return root.listing
        rel = self.path[len(root.path) + 1 :]
        if self.staged is None or not self.path.startswith(root.path + _os.sep):
            return listing(self.path)
        if rel in root.partial:
            recorded = root.partial[rel]
            return recorded if recorded is not None else listing(self.path)
        return self.listing(self.path)

    def is_package(self, name):
        """Whether the directory *name* holds an ``__init__`` module.

        One the staged copy lacks (the bundle left it out) is looked at in
        the original.
        """
        if self.staged and _os.path.isdir(_os.path.join(self.staged, name)):
            return super().is_package(name)
        folder = _os.path.join(self.path, name)
        if not _os.path.isdir(folder):
            return False
        return any(_listings.module_name(e) == "__init__" for e in _os.listdir(folder))

    def invalidate_caches(self):
        """Drop the cached listings, the copy's and the regular finder's."""
        self.listed.clear()
        super().invalidate_caches()


class StagedHook(_finders.ServingHook):
    """A path hook that hands out a :class:`StagedFinder` for bundled directories.

    It serves each bundled root, each directory inside one (a package's
    ``__path__`` may point to the original) and, for packages the bundle
    holds in part, their directories in the staged copy.
    """

    def __init__(self, finders, partial=None):
        self.finders, self.partial = finders, partial or {}

    def finder(self, folder):
        """Return the finder of *folder*: a bundled root, a directory in one, a copy."""
        finder = self.finders.get(folder) or self.partial.get(folder)
        for root in self.finders.values():
            finder = finder or root.below(folder)
        return finder


class TransparentLoader(_finders.CopyLoader):
    """Load a source module from the staged copy under its original path."""

    def __init__(self, fullname, path, root):
        super().__init__(fullname, path)
        self.root = root

    def staged_path(self, path):
        """Map a path below the original root to the staged copy."""
        return self.root.staged_path(path)  # the original once activation ended

    def get_resource_reader(self, name):
        """Serve ``importlib.resources`` of the package from the staged copy.

        A package shown at its original is read where plain python reads
        it, so that its resources list as they do there.
        """
        from importlib.resources.readers import FileReader

        reader = FileReader(self)
        folder = str(reader.path)
        if not self.root.shows_original(folder[len(self.root.path) + 1 :]):
            reader.path = type(reader.path)(self.staged_path(folder))
        return reader


# -- the rest of the ecosystem: metadata, pkg_resources, other finders ---------------


def register_pkg_resources(pkg_resources):
    """Let later ``pkg_resources`` scans of bundled roots read the staged copy."""

    def find_staged(importer, path_item, only=False):
        for path in importer.root.metadata_paths():
            yield from pkg_resources.find_on_path(importer, path, only)

    pkg_resources.register_finder(StagedFinder, find_staged)


class MetadataFinder(_finders.ServingMetaFinder):
    """Stands in for ``PathFinder``: distributions of bundled roots from the copy.

    ``importlib.metadata`` looks at the staged copy of each bundled root,
    and at the original after it only when the original holds distributions
    the bundle lacks. ``pkgutil`` and ``pkg_resources`` are told of the
    staged roots when they are imported.
    """

    AFTER = dict(_finders.ServingMetaFinder.AFTER, pkg_resources=register_pkg_resources)

    def __init__(self, base, roots, libraries=None):
        super().__init__(base)
        self.roots = roots
        if libraries is not None:
            self.AFTER = dict(self.AFTER, ctypes=libraries.install)

    def distributions(self, folder, name):
        """The distributions of a bundled root: its copy's, and maybe its own."""
        from importlib.metadata import DistributionFinder

        root = self.roots.get(folder)
        if root is None:
            return None
        path = root.metadata_paths()
        return self.base.find_distributions(
            DistributionFinder.Context(name=name, path=path)
        )

    def run(self, loader, module):
        """Run the module; for ``pkg_resources``, with staged metadata on sys.path.

        ``pkg_resources`` scans ``sys.path`` for distributions once, while it
        is imported; scanning the staged copies keeps that node-local.
        """
        saved = _sys.path[:]
        if module.__name__ == "pkg_resources":
            _sys.path[:] = metadata_path(saved, self.roots)
        try:
            loader.exec_module(module)
        finally:
            _sys.path[:] = saved


def metadata_path(entries, roots):
    """Return *entries* with each bundled root replaced by where its metadata is.

    A root the bundle holds nothing of stays (``pkg_resources`` also imports
    through this path while it scans).
    """
    path = []
    for entry in entries:
        root = roots.get(_os.path.abspath(entry or "."))
        if root is None or root.staged is None:
            path.append(entry)
        else:
            path += root.metadata_paths()
    return path


class RedirectFinder(_finders.MetaWrapper):
    """Wraps a meta path finder so that what it finds in a bundled tree is staged."""

    def __init__(self, base, finders):
        super().__init__(base)
        self.finders = finders

    def find_spec(self, fullname, path=None, target=None):
        """Ask the wrapped finder; load a module of a bundled tree from the copy."""
        spec = self.base.find_spec(fullname, path, target)
        if spec is None or not spec.has_location:
            return spec
        kinds = {loader: kind for kind, loader in _finders.LOADERS.items()}
        kind = kinds.get(type(spec.loader))
        if kind is None:
            return spec  # A loader of its own (pytest's rewriting): left alone.
        return staged_spec(spec, kind, self.finders) or spec


def staged_spec(spec, kind, finders):
    """Return a spec that loads *spec*'s file from the staged copy, or ``None``."""
    for finder in finders.values():
        if finder.staged and spec.origin.startswith(finder.path + _os.sep):
            if not _os.path.isfile(finder.copy(spec.origin)):
                return None
            package = spec.submodule_search_locations is not None
            search = [_os.path.dirname(spec.origin)] if package else None
            return finder.spec(spec.name, kind, spec.origin, search)
    return None


def wrap_meta_finders(finders):
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
        _sys.meta_path[index] = RedirectFinder(finder, finders)
        wrapped.append(_sys.meta_path[index])
    return wrapped


# -- activation and its end ----------------------------------------------------------


class Activation:
    """What activation changed, so that it can be classified and undone."""

    def __init__(self, root, hook, meta, wrapped, before, environ, roots=None):
        self.root, self.hook, self.meta, self.wrapped = root, hook, meta, wrapped
        self.before, self.environ, self.roots = before, environ, roots or {}
        self.libraries = None


def roots_of(staged):
    """Return ``{original path: BundledRoot}`` for every root of a staged bundle."""
    from mpistage.runtime.roots import destinations, partial_dirs

    manifest, roots = staged.manifest, {}
    held, owned = {}, {}
    for member in manifest["members"]:
        held[member["root"]] = True
        if member.get("owned"):
            owned.setdefault(member["root"], set()).add(member["rel"])
    for index, dest in enumerate(destinations(manifest)):
        entry = manifest["roots"][index]
        copy = _os.path.join(staged.path, dest) if index in held else None
        root = _listings.BundledRoot(
            entry["path"],
            copy,
            entry.get("listing", []),
            partial_listings(entry, partial_dirs(manifest, index)),
            owned.get(index, ()),
            bool(entry.get("stdlib")),
        )
        root.unbundled_dists = unbundled_dists(root.listing, copy)
        roots[root.path] = root
    return roots


def partial_listings(entry, rels):
    """Return ``{rel: recorded listing or None}`` of the directories held in part."""
    recorded = entry.get("partial", {})
    return {rel: recorded[rel]["listing"] if rel in recorded else None for rel in rels}


def unbundled_dists(listing, copy):
    """Whether the original root has distributions the staged copy lacks."""
    wanted = {e for e in listing if e.endswith((".dist-info/", ".egg-info/"))}
    return any(
        copy is None or not _os.path.isdir(_os.path.join(copy, e)) for e in wanted
    )


def finders_of(roots):
    """Return the root finders and the finders of partly held directories."""
    finders, partial = {}, {}
    for path, root in roots.items():
        finders[path] = StagedFinder(root, path, root.staged, root.names)
        for rel in root.partial if root.staged else ():
            inside, original = _os.path.join(root.staged, rel), _os.path.join(path, rel)
            partial[inside] = StagedFinder(root, original, inside, root.names_in(rel))
    return finders, partial


def activate(staged, children=True):
    """Serve the bundled roots of *staged* from its node-local copy."""
    import importlib

    _finders.import_serving()
    roots = roots_of(staged)
    finders, partial = finders_of(roots)
    hook = StagedHook(finders, partial)
    _sys.path_hooks.insert(0, hook)
    libraries = _libraries.Libraries(roots)
    meta = _finders.stand_in(lambda base: MetadataFinder(base, roots, libraries))
    wrapped = wrap_meta_finders(finders)
    inside = tuple(root + _os.sep for root in finders)
    _finders.forget(lambda path: path in finders or path.startswith(inside))
    importlib.invalidate_caches()
    if "pkgutil" in _sys.modules:
        _finders.register_pkgutil(_sys.modules["pkgutil"])
    if "ctypes" in _sys.modules:
        libraries.install(_sys.modules["ctypes"])
    environ = inherit(staged) if children else None
    before = set(_sys.modules)
    activation = Activation(staged.path, hook, meta, wrapped, before, environ, roots)
    activation.libraries = libraries
    return activation


def deactivate(activation):
    """Undo :func:`activate`: hooks and finders as before, caches dropped.

    What was loaded from the staged copy is pointed back at the originals,
    and sources served under their original path are read from there.
    """
    import importlib

    if activation.hook in _sys.path_hooks:
        _sys.path_hooks.remove(activation.hook)
    _finders.step_aside([activation.meta, *activation.wrapped])
    _finders.drop_finders(StagedFinder)
    if activation.environ is not None:
        restore(activation.environ)
    if activation.libraries is not None:
        activation.libraries.uninstall()
    roots = activation.roots.values()
    _finders.repoint([(r.staged, r.path) for r in roots if r.staged])
    for root in roots:
        root.staged = None
    importlib.invalidate_caches()


# -- child processes ---------------------------------------------------------------


def write_plan(staged):
    """Leader: write what a child needs to activate the copy, into the copy.

    The plan is JSON (a child never unpickles anything from the tree), under
    a name no bundle member may have (``.mpistage*``), created new without
    following a link.
    """
    from mpistage import lend, own_module

    with lend("json"):
        data = own_module("json").dumps(
            {"path": staged.path, "manifest": staged.manifest}
        )
    flags = _os.O_WRONLY | _os.O_CREAT | _os.O_EXCL | _os.O_NOFOLLOW | _os.O_CLOEXEC
    fd = _os.open(CHILD_PLAN, flags, 0o600, dir_fd=staged.root.fd)
    with open(fd, "w", encoding="utf-8") as f:
        f.write(data)


def inherit(staged):
    """Point child processes at the copy; return what the environment was.

    Children run mpistage's ``sitecustomize`` hook (the ``_hook`` directory,
    put first on ``PYTHONPATH``), which reads the plan the leader wrote.
    """
    import mpistage

    hook = _os.path.join(mpistage.__path__[0], "_hook")
    saved = {k: _os.environ.get(k) for k in ("PYTHONPATH", CHILD_ENV)}
    if staged.root is not None:
        write_plan(staged)
    rest = _os.environ.get("PYTHONPATH")
    _os.environ["PYTHONPATH"] = hook + (_os.pathsep + rest if rest else "")
    _os.environ[CHILD_ENV] = _os.path.join(staged.path, CHILD_PLAN)
    return saved


def restore(saved):
    """Put the environment variables back as they were."""
    for key, value in saved.items():
        if value is None:
            _os.environ.pop(key, None)
        else:
            _os.environ[key] = value


def activate_child(plan):
    """In a child process: activate the copy the *plan* file describes."""
    from mpistage import lend, own_module
    from mpistage.runtime.stage import Staged

    fd = _os.open(plan, _os.O_RDONLY | _os.O_NOFOLLOW | _os.O_CLOEXEC)
    with open(fd, encoding="utf-8") as f, lend("json"):
        found = own_module("json").load(f)
    activate(Staged(found["path"], found["manifest"], 0), children=False)
