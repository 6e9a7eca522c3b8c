"""Step 5 of the runner: every rank imports from its node's staged copy.

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

    def __init__(self, original, staged, names, unbundled_dists):
        self.path, self.staged, self.names = original, staged, names
        self.unbundled_dists = unbundled_dists
        self._finders = {}

    def metadata_paths(self):
        """Where ``importlib.metadata`` looks for this root's distributions."""
        return [self.staged, self.path] if self.unbundled_dists else [self.staged]

    def finder(self, path):
        """Return the regular finder of *path*, made once by the other hooks."""
        if path not in self._finders:
            self._finders[path] = regular_finder(path)
        return self._finders[path]

    def find_spec(self, fullname, target=None):
        """Find *fullname* in the staged copy, else where the listing says.

        Without a listing (*names* ``None``), always try the original.
        """
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
        """Return the finder of *path* if it is a bundled root or partial."""
        path = _os.path.abspath(path or ".")
        finder = self.finders.get(path) or self.partial.get(path)
        if finder is None:
            raise ImportError("not a bundled root", path=path)
        return finder


def module_names(listing):
    """Return the top-level module names a root listing can provide.

    Directories count (packages, namespace portions), and files with a
    suffix the import system loads; other files (data, ``.pth``) do not.
    """
    from importlib.machinery import all_suffixes

    suffixes, names = tuple(all_suffixes()), set()
    for entry in listing:
        if entry.endswith("/") or entry.endswith(suffixes):
            name = entry.rstrip("/").split(".", 1)[0]
            if name.isidentifier():
                names.add(name)
    return names


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


def unbundled_dists(listing, staged):
    """Whether the original root has distributions the staged copy lacks."""
    wanted = {e for e in listing if e.endswith((".dist-info/", ".egg-info/"))}
    return any(not _os.path.isdir(_os.path.join(staged, e)) for e in wanted)


class Activation:
    """What activation changed, kept to classify the job's imports later."""

    def __init__(self, root, hook, before):
        self.root, self.hook, self.before = root, hook, before


def partial_dirs(manifest, index):
    """Return the directories of root *index* that the bundle holds in part.

    A directory the bundle holds whole is a member of its own; one that only
    leads to file members (``--granularity file``) is not.
    """
    whole, parents = set(), set()
    for member in manifest["members"]:
        if member["root"] != index:
            continue
        if member["type"] == "dir":
            whole.add(member["rel"])
        else:
            rel = _os.path.dirname(member["rel"])
            while rel and rel not in parents:
                parents.add(rel)
                rel = _os.path.dirname(rel)
    return sorted(parents - whole)


def activate(root, roots):
    """Serve the bundled *roots* from the staging *root*.

    Each root is (path, listing, directories held in part: see
    :func:`partial_dirs`).
    """
    import importlib

    finders, partial = {}, {}
    for index, (path, listing, part) in enumerate(roots):
        staged = _os.path.join(root, f"r{index}")
        extra = unbundled_dists(listing, staged)
        finders[path] = StagedFinder(path, staged, module_names(listing), extra)
        for rel in part:
            inside, original = _os.path.join(staged, rel), _os.path.join(path, rel)
            partial[inside] = StagedFinder(original, inside, None, False)
    hook = StagedHook(finders, partial)
    _sys.path_hooks.insert(0, hook)
    install_metadata_finder(finders)
    for path in list(_sys.path_importer_cache):
        if _os.path.abspath(path or ".") in finders:
            del _sys.path_importer_cache[path]
    importlib.invalidate_caches()
    return Activation(root, hook, set(_sys.modules))


def stdlib_dir():
    """Return the standard library's directory (it holds lib-dynload too)."""
    return _os.path.dirname(_os.__file__)


def in_stdlib(path):
    """Whether *path* is part of the standard library (not site-packages)."""
    return path.startswith(stdlib_dir() + _os.sep) and not any(
        part in ("site-packages", "dist-packages") for part in path.split(_os.sep)
    )


def classify(activation):
    """Sort modules imported since activation: served, missed, stdlib."""
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
