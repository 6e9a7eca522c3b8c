"""Build a bundle from named packages and whole sys.path directories.

``mpistage pack -o app.mpistage numpy mypkg --path ./lib`` finds each named
top-level package or module as the current Python would, and bundles it with
everything an import of it needs from its sys.path root: all its files, its
distribution metadata directory, the auditwheel ``<name>.libs`` directory its
extensions link to through ``$ORIGIN`` RPATHs, and the top-level ``.pth``
files its distribution installed. Each root's full listing is recorded so
that absent names can later be answered without the file system.
"""

import os as _os

from mpistage.errors import StageError


def pack(output, names=(), paths=(), *, exclude=(), created_by="pack"):
    """Write a bundle of *names* (importable top-level) and *paths* to *output*.

    *exclude* holds glob patterns matched against each member's path relative
    to its root (``*/tests``); a matching directory is left out whole.
    Returns the manifest that was written. Raises :class:`StageError` for
    a name that cannot be found or a path that is not a directory.
    """
    if not names and not paths:
        raise StageError("nothing to pack: name a package or give --path DIR")
    roots = Roots(exclude)
    for name in names:
        add_package(roots, name)
    for path in paths:
        add_tree(roots, path)
    return write(output, roots, sorted(names), created_by)


class Roots:
    """The sys.path roots of a bundle and, for each, the files it takes."""

    def __init__(self, exclude=()):
        self.paths = []
        self.files = {}
        self.exclude = tuple(exclude)

    def index(self, root):
        """Return the number of *root*, registering it on first use."""
        root = _os.path.abspath(root)
        if root not in self.files:
            self.paths.append(root)
            self.files[root] = set()
        return self.paths.index(root)

    def take(self, root, path):
        """Add *path* (below *root*) and, for a directory, all below it."""
        self.index(root)
        root = _os.path.abspath(root)
        kept = (p for p in walk(path) if not self.excluded(_os.path.relpath(p, root)))
        self.files[root].update(kept)

    def excluded(self, rel):
        """Whether *rel* or one of its parent directories matches --exclude."""
        from fnmatch import fnmatch

        while rel and self.exclude:
            if any(fnmatch(rel, pattern) for pattern in self.exclude):
                return True
            rel = _os.path.dirname(rel)
        return False


def walk(path):
    """Yield *path* and, for a real directory, everything below it."""
    yield _os.path.abspath(path)
    if _os.path.isdir(path) and not _os.path.islink(path):
        for top, dirs, files in _os.walk(path):
            for name in dirs + files:
                yield _os.path.abspath(_os.path.join(top, name))


def root_of(location):
    """Return the directory that holds *location*: its sys.path root."""
    return _os.path.dirname(_os.path.abspath(location))


def add_package(roots, name):
    """Add the top-level package or module *name* and what belongs to it."""
    import importlib.util

    if not name.isidentifier():
        raise StageError(f"{name!r} is not a top-level module name")
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        raise StageError(f"cannot find {name!r}: {exc}") from None
    if spec is None or not (spec.submodule_search_locations or spec.has_location):
        raise StageError(f"no importable package or module named {name!r} on sys.path")
    for location in module_locations(spec):
        add_top(roots, root_of(location), name, [location])
    cached = None if spec.submodule_search_locations else spec.cached
    if cached and _os.path.exists(cached):
        # a single-file module: its own .pyc, not all of the root's __pycache__
        roots.take(root_of(spec.origin), cached)


def add_top(roots, root, name, locations):
    """Add *locations* of *name* in *root*, its distribution and its .libs."""
    for location in locations:
        roots.take(root, location)
    add_distribution(roots, root, name)
    libs = _os.path.join(root, name + ".libs")
    if _os.path.isdir(libs):
        roots.take(root, libs)


def module_locations(spec):
    """Return the files or directories that make up the module of *spec*."""
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)
    return [spec.origin]


def add_distribution(roots, root, name):
    """Add the installed distributions in *root* that provide *name*."""
    from importlib.metadata import distributions

    for dist in distributions(path=[root]):
        files = dist.files or []
        if any(top_name(f.parts[0]) == name for f in files):
            for f in files:
                path = _os.path.abspath(dist.locate_file(f))
                if path.startswith(root + _os.sep) and _os.path.lexists(path):
                    roots.take(root, path)


def top_name(part):
    """Return the module name a top-level file or directory provides."""
    return part.split(".", 1)[0]


def add_tree(roots, path):
    """Add the whole directory *path* as a root of its own."""
    if not _os.path.isdir(path):
        raise StageError(f"--path {path!r} is not a directory")
    for child in sorted(_os.listdir(path)):
        roots.take(path, _os.path.join(path, child))


def root_entry(root):
    """Describe a root for the manifest: path, mtime and full listing."""
    return {
        "path": root,
        "mtime_ns": _os.stat(root).st_mtime_ns,
        "listing": listing(root),
    }


def listing(root):
    """Return the names in *root*, directories marked with a trailing slash."""
    names = []
    for entry in _os.scandir(root):
        names.append(entry.name + "/" if entry.is_dir() else entry.name)
    return sorted(names)


def write(output, roots, names, created_by, python=None, extra=None):
    """Write the members of *roots* to the bundle *output*.

    *python* is the tag of the Python the bundle is for (default: this one);
    *extra* holds more manifest fields (how the bundle was recorded).
    """
    import time

    from mpistage import __version__, bundle

    if not output.endswith(bundle.SUFFIX):
        raise StageError(f"bundle name {output!r} must end in {bundle.SUFFIX!r}")
    manifest = {
        "created_by": created_by,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "mpistage": __version__,
        "python": python or bundle.python_tag(),
        "packages": names,
        "roots": [root_entry(p) for p in roots.paths],
        **(extra or {}),
    }
    with bundle.BundleWriter(output) as writer:
        for index, root in enumerate(roots.paths):
            for path in sorted(roots.files[root]):
                if path != root:
                    writer.add(index, _os.path.relpath(path, root), path)
        return writer.finish(manifest)
