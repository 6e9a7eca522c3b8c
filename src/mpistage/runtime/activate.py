"""Step 6: every rank imports from its node's staged copy.

A path hook, first in ``sys.path_hooks``, takes over each bundled sys.path
root (whether it is on ``sys.path`` now or is added later by the program):

- a name that is in the bundle is found in the staged copy, so its
  ``__file__`` points into the staging root and C extensions find their
  ``$ORIGIN``-relative libraries there too;
- a name that the manifest's listing of the original root does not hold at
  all is answered "not here" from memory, without touching the file system;
- a name that the original root holds but the bundle does not imports from
  its original location as usual: correct, only slower, and counted as a
  miss in the report. The same holds inside a package the bundle has only
  in part (``mpistage record --granularity file``): a submodule that is not
  in the staged copy is looked for in the original package directory.

``importlib.metadata`` reads the staged copies too (:class:`MetadataFinder`),
and ``importlib.resources`` and reads relative to ``__file__`` follow the
staged module. ``sys.path`` itself is left as it was.
"""

import os as _os
import sys as _sys


class StagedFinder:
    """The path entry finder of one bundled root: staged copy, then original."""

    def __init__(self, original, staged, names, unbundled_dists, partial=()):
        self.path, self.staged, self.names = original, staged, names
        self.unbundled_dists, self.partial = unbundled_dists, frozenset(partial)
        self._finders = {}

    def below(self, path):
        """Return the finder of a directory *path* inside this root, or ``None``.

        Packages imported before activation keep their original ``__path__``;
        their submodules are served from the staged copy all the same. A
        directory the bundle holds whole answers absent names itself; one it
        holds in part falls back to the original.
        """
        if self.staged is None or not path.startswith(self.path + _os.sep):
            return None
        rel = path[len(self.path) + 1 :]
        inside = _os.path.join(self.staged, rel)
        if not _os.path.isdir(inside):
            return None
        names = None if rel in self.partial else frozenset()
        return StagedFinder(path, inside, names, False)

    def metadata_paths(self):
        """Where ``importlib.metadata`` looks for this root's distributions."""
        found = [self.staged] if self.staged else []
        return found + [self.path] if self.unbundled_dists else found

    def finder(self, path):
        """Return the regular finder of *path*, made once by the other hooks."""
        if path not in self._finders:
            self._finders[path] = regular_finder(path)
        return self._finders[path]

    def find_spec(self, fullname, target=None):
        """Find *fullname* in the staged copy, else where the listing says.

        Without a listing (*names* ``None``), always try the original. A root
        the bundle holds nothing of has no staged copy (*staged* ``None``).
        """
        spec = None
        if self.staged is not None:
            spec = self.finder(self.staged).find_spec(fullname, target)
        if spec is None and (
            self.names is None or fullname.rpartition(".")[2] in self.names
        ):
            spec = self.finder(self.path).find_spec(fullname, target)
        return spec

    def invalidate_caches(self):
        """Drop the cached directory listings of both finders."""
        for finder in self._finders.values():
            finder.invalidate_caches()


def regular_finder(path):
    """Return the finder the standard path hooks give *path*."""
    for hook in _sys.path_hooks:
        if not isinstance(hook, StagedHook):
            try:
                return hook(path)
            except ImportError:
                continue
    raise ImportError(f"no path hook for {path!r}", path=path)


class StagedHook:
    """A path hook that hands out a :class:`StagedFinder` for bundled roots.

    *partial* maps the staged copies of package directories that the bundle
    holds only in part to their finders (a package's ``__path__`` points
    into the staged copy, so its submodules are looked up there).
    """

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


class MetadataFinder:
    """Stands in for ``PathFinder`` in ``sys.meta_path``.

    Finding modules is left to ``PathFinder`` unchanged; finding
    distributions (``importlib.metadata``) looks at the staged copy of each
    bundled root instead of the original. The original is still searched
    after it when its listing has distributions the bundle lacks.
    """

    def __init__(self, base, finders):
        self.base, self.finders = base, finders

    def __getattr__(self, name):
        return getattr(self.base, name)

    def find_spec(self, fullname, path=None, target=None):
        """Find a module exactly as ``PathFinder`` does."""
        return self.base.find_spec(fullname, path, target)

    def find_distributions(self, context=None):
        """Find distributions, reading bundled roots from their staged copy."""
        from importlib.metadata import DistributionFinder

        context = context or DistributionFinder.Context()
        path = []
        for entry in context.path:
            finder = self.finders.get(_os.path.abspath(entry or "."))
            path += finder.metadata_paths() if finder else [entry]
        return self.base.find_distributions(
            DistributionFinder.Context(name=context.name, path=path)
        )


def install_metadata_finder(finders):
    """Put a :class:`MetadataFinder` where ``PathFinder`` is in sys.meta_path."""
    from importlib.machinery import PathFinder

    for index, finder in enumerate(_sys.meta_path):
        if finder is PathFinder:
            _sys.meta_path[index] = MetadataFinder(finder, finders)
            return _sys.meta_path[index]
    return None


def unbundled_dists(listing, staged):
    """Whether the original root has distributions the staged copy lacks."""
    wanted = {e for e in listing if e.endswith((".dist-info/", ".egg-info/"))}
    return any(not _os.path.isdir(_os.path.join(staged, e)) for e in wanted)


class Activation:
    """What activation changed, so that it can be classified and undone."""

    def __init__(self, root, hook, meta, before):
        self.root, self.hook, self.meta, self.before = root, hook, meta, before


def finders_of(staged):
    """Return the root finders and partial-directory finders of a staged bundle."""
    from mpistage.runtime.roots import destinations, module_names, partial_dirs

    manifest, finders, partial = staged.manifest, {}, {}
    held = {m["root"] for m in manifest["members"]}
    for index, dest in enumerate(destinations(manifest)):
        entry = manifest["roots"][index]
        path, listing = entry["path"], entry.get("listing", [])
        copy = _os.path.join(staged.path, dest) if index in held else None
        extra = copy is None or unbundled_dists(listing, copy)
        part = partial_dirs(manifest, index)
        finders[path] = StagedFinder(path, copy, module_names(listing), extra, part)
        for rel in part:
            inside, original = _os.path.join(copy, rel), _os.path.join(path, rel)
            partial[inside] = StagedFinder(original, inside, None, False)
    return finders, partial


def activate(staged):
    """Serve the bundled roots of *staged* from its node-local copy."""
    import importlib

    finders, partial = finders_of(staged)
    hook = StagedHook(finders, partial)
    _sys.path_hooks.insert(0, hook)
    meta = install_metadata_finder(finders)
    forget(finders)
    importlib.invalidate_caches()
    return Activation(staged.path, hook, meta, set(_sys.modules))


def forget(finders):
    """Drop cached path finders of bundled roots and of directories inside them."""
    roots = tuple(root + _os.sep for root in finders)
    for path in list(_sys.path_importer_cache):
        full = _os.path.abspath(path or ".")
        if full in finders or full.startswith(roots):
            del _sys.path_importer_cache[path]


def deactivate(activation):
    """Undo :func:`activate`: hooks and finders as before, caches dropped."""
    import importlib

    if activation.hook in _sys.path_hooks:
        _sys.path_hooks.remove(activation.hook)
    for index, finder in enumerate(_sys.meta_path):
        if finder is activation.meta:
            _sys.meta_path[index] = activation.meta.base
    for path, finder in list(_sys.path_importer_cache.items()):
        if isinstance(finder, StagedFinder):
            del _sys.path_importer_cache[path]
    importlib.invalidate_caches()


def classify(activation):
    """Sort modules imported since activation: served, missed, stdlib."""
    from mpistage.runtime.roots import in_stdlib

    served, missed, stdlib = [], [], []
    root = activation.root + _os.sep
    for name, module in list(_sys.modules.items()):
        origin = getattr(getattr(module, "__spec__", None), "origin", None)
        if name in activation.before or name.partition(".")[0] == "mpistage":
            continue
        if not origin or not _os.path.isabs(origin):
            continue
        if origin.startswith(root):
            served.append(name)
        elif in_stdlib(origin):
            stdlib.append(name)
        else:
            missed.append(name)
    return {"served": served, "missed": missed, "stdlib": stdlib}
