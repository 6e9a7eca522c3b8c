"""``mpistage pack``: choose what a bundle holds, by name, directory or environment.

``mpistage pack -o app.mpistage numpy mypkg --path ./lib`` finds each named
top-level package or module as the current Python would, and takes
everything an import of it needs from its sys.path root: all its files, its
distribution metadata directory, the files its ``RECORD`` places in the root
(auditwheel's ``<name>.libs``, ``.pth`` files) and a ``<name>.libs``
sibling. The shared libraries the package's extensions need (their ELF
``DT_NEEDED``, found through RUNPATH, RPATH and ``$ORIGIN`` as the loader
finds them: :mod:`mpistage.bundle.elfdeps`) that other distributions of the
same root hold are taken too, with the distribution that owns each (CUDA's
``nvidia/cublas/lib``, another wheel's ``<name>.libs``): the node's copy
keeps the root's layout, so ``$ORIGIN/../../nvidia/cublas/lib`` leads into
the copy as it led to the original. Test directories (``*/tests``) are
left out unless ``tests=True``: they are a quarter of numpy and no program
imports them. ``stdlib=True`` adds the standard library, so that what the
program imports from it after activation is served node-locally too.
Every directory on ``sys.path`` is recorded with its listing, so that the
runner answers absent names there without the file system.
"""

import os as _os
import sys as _sys

from mpistage import StageError

TEST_DIRS = ("*/**/tests",)  # below a package, never a root's own ``tests``
STDLIB_EXCLUDE = (
    "/site-packages",
    "/dist-packages",
    "/test",
    "/idlelib",
    "/turtledemo",
    "/config-*",
    "**/__pycache__/*.opt-[12].pyc",
)


def pack(
    output,
    names=(),
    *,
    paths=(),
    exclude=(),
    stdlib=False,
    tests=False,
    env=None,
    exclude_lib=(),
    self_extracting=False,
):
    """Write a bundle to *output*; return its manifest.

    *names* are importable top-level names, *paths* whole directories added
    as roots of their own, *exclude* glob patterns matched against each
    member's path below its root (a matching directory is left out whole).
    *stdlib* adds the standard library; *tests* keeps test directories.
    *env* packs the whole environment at that prefix instead (for
    ``mpistage stage``), leaving out the libraries matching *exclude_lib*;
    *self_extracting* makes that an executable for a launcher's broadcast
    (:mod:`mpistage.bundle.selfextract`).
    """
    if self_extracting and env is None:
        raise StageError("--self-extracting is for a whole environment: add --env")
    if env is not None:
        if names or paths or stdlib:
            raise StageError("--env packs a whole environment: give no names or --path")
        return pack_env_to(output, env, exclude, exclude_lib, self_extracting)
    if not names and not paths and not stdlib:
        raise StageError("nothing to pack: name a package or give --path DIR")
    from mpistage.bundle.writer import Selection, write

    selection = Selection(tuple(exclude) + (() if tests else TEST_DIRS))
    for name in names:
        add_package(selection, name)
    libraries = add_libraries(selection, names)
    for path in paths:
        add_tree(selection, path)
    if stdlib:
        add_stdlib(selection)
    add_listings(selection)
    fields = {"created_by": "pack", "packages": sorted(names)}
    if libraries:
        fields["libraries"] = libraries
    return write(output, selection, fields)


def pack_env_to(output, env, exclude, exclude_lib, self_extracting):
    """Pack the environment at *env* to *output*, self-extracting or not."""
    from mpistage.bundle.envpack import pack_env

    if not self_extracting:
        return pack_env(output, env, exclude, exclude_lib)
    from mpistage.bundle.selfextract import attach

    plain = f"{output}.tmp.mpistage"
    try:
        manifest = pack_env(plain, env, exclude, exclude_lib)
        attach(plain, output)
    finally:
        if _os.path.exists(plain):
            _os.unlink(plain)
    return manifest


def add_package(selection, name):
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
        root = _os.path.dirname(_os.path.abspath(location))
        if not _os.path.isdir(root):
            raise StageError(
                f"{name!r} is imported from {location!r}, inside a file (a zip?); "
                "pack the archive's directory with --path, or unpack it"
            )
        add_top(selection, root, name, [location])
    cached = None if spec.submodule_search_locations else spec.cached
    if cached and _os.path.exists(cached):
        # A single-file module: its own bytecode, not all of the root's __pycache__.
        selection.take(_os.path.dirname(_os.path.abspath(spec.origin)), cached)


def module_locations(spec):
    """Return the files or directories that make up the module of *spec*."""
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)
    return [spec.origin]


def add_top(selection, root, name, locations):
    """Add *locations* of *name* in *root*, its distribution and its ``.libs``."""
    for location in locations:
        selection.take(root, location)
    add_distribution(selection, root, name)
    libs = _os.path.join(root, name + ".libs")
    if _os.path.isdir(libs):
        selection.take(root, libs)


def add_distribution(selection, root, name):
    """Add the installed distributions in *root* that provide *name*."""
    from importlib.metadata import distributions

    from mpistage.runtime.roots import top_name

    for dist in distributions(path=[root]):
        files = dist.files or []
        if not any(top_name(f.parts[0], len(f.parts) > 1) == name for f in files):
            continue
        for f in files:
            path = _os.path.normpath(_os.path.abspath(dist.locate_file(f)))
            if path.startswith(root + _os.sep) and _os.path.lexists(path):
                selection.take(root, path)


def add_libraries(selection, names):
    """Add the libraries the taken extensions need from other distributions.

    Only those below the extension's own root: a library elsewhere is found
    at its original place from the copy too. Returns the libraries added, by
    root-relative path.
    """
    added = []
    if not names:
        return added
    try:
        import elftools  # noqa: F401
    except ImportError:
        print(
            "mpistage: note: libraries from other distributions not followed: "
            "pack reads ELF files with pyelftools (pip install pyelftools)",
            file=_sys.stderr,
        )
        return added
    for root in selection.paths:
        owners = Owners(root)
        for path in needed_below(root, selection.taken(root)):
            rel = _os.path.relpath(path, root)
            if selection.excluded(rel):
                continue  # left to the original, and so is its distribution
            if path not in selection.taken(root):
                owners.take(selection, path)
            added.append(rel)
    return added


def needed_below(root, taken):
    """Return the libraries below *root*, not in *taken*, that ELF files of it need."""
    from mpistage.bundle.elfdeps import closure, is_elf

    elves = [
        path
        for path in sorted(taken)
        if ".so" in _os.path.basename(path) and not _os.path.islink(path)
        and is_elf(path)
    ]  # fmt: skip
    if not elves:
        return []
    found, _missing = closure(elves)
    paths = {_os.path.normpath(_os.path.abspath(p)) for p in found.values()}
    return sorted(p for p in paths if p.startswith(root + _os.sep) and p not in taken)


class Owners:
    """Which installed distribution of a root owns a file (its ``RECORD``)."""

    def __init__(self, root):
        self.root, self.files = root, None

    def owner(self, path):
        """Return every file of the distribution that owns *path*, or ``[]``."""
        from importlib.metadata import distributions

        if self.files is None:
            self.files = {}
            for dist in distributions(path=[self.root]):
                paths = [_os.path.normpath(_os.path.abspath(dist.locate_file(f)))
                         for f in dist.files or ()]  # fmt: skip
                for found in paths:
                    self.files.setdefault(found, paths)
        return self.files.get(path, [])

    def take(self, selection, path):
        """Take the distribution that owns the library *path*; else its directory."""
        owned = self.owner(path)
        for found in owned:
            if found.startswith(self.root + _os.sep) and _os.path.lexists(found):
                selection.take(self.root, found)
        folder = _os.path.dirname(path)
        if not owned:
            selection.take(self.root, folder if folder != self.root else path)


def add_tree(selection, path):
    """Add the whole directory *path* as a root of its own."""
    if not _os.path.isdir(path):
        raise StageError(f"--path {path!r} is not a directory")
    for child in sorted(_os.listdir(path)):
        selection.take(path, _os.path.join(path, child))


def add_stdlib(selection):
    """Add the standard library, as the runtime finds it, without its tests."""
    from mpistage.runtime.roots import stdlib_dirs

    with selection.excluding(STDLIB_EXCLUDE):
        for folder in stdlib_dirs():
            for child in sorted(_os.listdir(folder)):
                selection.take(folder, _os.path.join(folder, child))


def add_listings(selection):
    """Register every directory on ``sys.path`` as a root, for its listing.

    ``sys.path[0]`` is the directory of ``mpistage`` itself here, not the
    program's: it is left out.
    """
    import sys

    for entry in sys.path[1:]:
        path = _os.path.abspath(entry or ".")
        if entry and _os.path.isdir(path):
            selection.index(path)
