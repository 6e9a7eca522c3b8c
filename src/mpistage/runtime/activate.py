"""Step 6: every rank imports from its node's staged copy.

Activation changes four things, and :func:`deactivate` undoes them:

- a path hook first in ``sys.path_hooks`` (:class:`~.finders.StagedHook`)
  serves each bundled sys.path root from the staged copy, whether the root
  is on ``sys.path`` now or is added later; ``sys.path`` is left as it is;
- ``PathFinder`` in ``sys.meta_path`` is wrapped (:class:`~.finders.MetadataFinder`)
  so that ``importlib.metadata`` reads distributions from the staged copy;
- other meta path finders (setuptools' finder-based editable installs) are
  wrapped (:class:`~.finders.RedirectFinder`) so that what they find in a bundled tree
  is loaded from the staged copy too;
- ``PYTHONPATH`` gains a node-local directory whose ``sitecustomize``
  activates the same copy in child processes (``subprocess``,
  ``multiprocessing`` with spawn or forkserver) for the life of the job.

``pkgutil.iter_modules`` lists bundled roots from their listings, and
``pkg_resources`` builds its working set from the staged copies. After a
``staged()`` block, modules imported inside it are pointed back at the
originals (:func:`repoint`). The finders and loaders themselves are
:mod:`~mpistage.runtime.finders`'; what was served is
:func:`mpistage.runtime.report.classify`'s to say.
"""

import os as _os
import sys as _sys

CHILD_PLAN = ".mpistage-plan.json"
CHILD_ENV = "MPISTAGE_CHILD"


class Activation:
    """What activation changed, so that it can be classified and undone."""

    def __init__(self, root, hook, meta, wrapped, before, environ, roots=None):
        self.root, self.hook, self.meta, self.wrapped = root, hook, meta, wrapped
        self.before, self.environ, self.roots = before, environ, roots or {}


def roots_of(staged):
    """Return ``{original path: BundledRoot}`` for every root of a staged bundle."""
    from mpistage.runtime.finders import BundledRoot
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
        root = BundledRoot(
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
    from mpistage.runtime.finders import StagedFinder

    finders, partial = {}, {}
    for path, root in roots.items():
        finders[path] = StagedFinder(root, path, root.staged, root.names)
        for rel in root.partial if root.staged else ():
            inside, original = _os.path.join(root.staged, rel), _os.path.join(path, rel)
            partial[inside] = StagedFinder(root, original, inside, root.names_in(rel))
    return finders, partial


def forget(finders):
    """Drop cached path finders of bundled roots and of directories inside them."""
    roots = tuple(root + _os.sep for root in finders)
    for path in list(_sys.path_importer_cache):
        full = _os.path.abspath(path or ".")
        if full in finders or full.startswith(roots):
            del _sys.path_importer_cache[path]


def activate(staged, children=True):
    """Serve the bundled roots of *staged* from its node-local copy."""
    import importlib

    from mpistage.runtime.finders import (
        StagedHook,
        import_serving,
        install_metadata_finder,
        register_pkgutil,
        wrap_meta_finders,
    )

    import_serving()
    roots = roots_of(staged)
    finders, partial = finders_of(roots)
    hook = StagedHook(finders, partial)
    _sys.path_hooks.insert(0, hook)
    meta = install_metadata_finder(roots)
    wrapped = wrap_meta_finders(roots)
    forget(finders)
    importlib.invalidate_caches()
    if "pkgutil" in _sys.modules:
        register_pkgutil(_sys.modules["pkgutil"])
    environ = inherit(staged) if children else None
    before = set(_sys.modules)
    return Activation(staged.path, hook, meta, wrapped, before, environ, roots)


def deactivate(activation):
    """Undo :func:`activate`: hooks and finders as before, caches dropped."""
    import importlib

    from mpistage.runtime.finders import StagedFinder

    if activation.hook in _sys.path_hooks:
        _sys.path_hooks.remove(activation.hook)
    for index, finder in enumerate(_sys.meta_path):
        if finder is activation.meta or finder in activation.wrapped:
            _sys.meta_path[index] = finder.base
    for path, finder in list(_sys.path_importer_cache.items()):
        if isinstance(finder, StagedFinder):
            del _sys.path_importer_cache[path]
    if activation.environ is not None:
        restore(activation.environ)
    repoint(activation.roots)
    importlib.invalidate_caches()


def repoint(roots):
    """Point what was loaded from the staged copy back at the originals.

    The copy is removed when activation ends. A package whose ``__path__``
    named it could import no submodule it had not imported yet, and a
    ``__file__`` naming it would lead to a file that is gone: so every
    module's ``__file__``, ``__cached__``, ``__path__``, spec and loader
    path, and ``sys.path``, are mapped to the originals, and source served
    under its original path is read from there.
    """
    copies = [(r.staged, r.path) for r in roots.values() if r.staged]
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
    for root in roots.values():
        root.staged = None


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
