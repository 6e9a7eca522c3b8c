"""mpistage: fast start-up for MPI-parallel Python.

One process reads the shared file system, the bytes travel over MPI to one
leader per node, each node keeps one local copy, and every rank imports from
it. The public API (see docs/api.md)::

    import mpistage
    with mpistage.staged("app.mpistage", comm=MPI.COMM_WORLD):
        import numpy                      # served from this node's copy
    mpistage.pack("app.mpistage", ["numpy"])
    mpistage.inspect("app.mpistage")      # the manifest
    mpistage.data.read(path, comm=...)    # one copy of a data file per node

Every name is loaded lazily: ``import mpistage`` reads this one file. This
module also holds :func:`load_runtime`, which every rank calls before it
imports the runtime package: a module of its own would cost each rank some
thirty more metadata operations on the shared file system.
"""

import sys as _sys

__version__ = "0.2.0"
__all__ = ["StageError", "__version__", "data", "inspect", "pack", "staged"]

# The ``mpistage`` commands that are tools, and the module of each; every
# other word is the runner (a script), but ``stage`` and ``data``, which run
# in every rank (:mod:`mpistage.runtime.stager`, :mod:`mpistage.data.command`).
TOOLS = {
    "pack": "mpistage.cli.pack",
    "record": "mpistage.cli.record",
    "inspect": "mpistage.cli.inspect",
    "clean": "mpistage.cli.clean",
    "run": "mpistage.cli.run",
    "bench": "mpistage.bench.cli",
}
COMMANDS = ("stage", "data", *TOOLS)


class StageError(Exception):
    """The one error class of mpistage: bad input, refused places, failed steps.

    In a job it is raised on every rank of the communicator after the ranks
    agreed on it, so a program may catch it and go on. The command line
    prints it as one ``mpistage: error: ...`` line and exits with status 1.
    """


def describe(error):
    """Return a one-line message for any exception a step raised.

    The one wording of an error, on every rank and in every tool (the
    agreed errors of :mod:`mpistage.runtime.collective`, the node boot's).
    """
    if isinstance(error, StageError):
        return str(error)
    if isinstance(error, MemoryError):
        return "out of memory" + (f": {error}" if str(error) else "")
    if isinstance(error, OSError) and error.strerror:
        where = f" {error.filename!r}" if error.filename else ""
        return f"{error.strerror}{where}"
    return f"internal error: {type(error).__name__}: {error}"


def staged(bundle, comm=None, **options):
    """Stage *bundle* node-locally and serve its imports (collective).

    A context manager; see :func:`mpistage.runtime.session.staged`.
    """
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    load_runtime(comm)
    from mpistage.runtime.session import staged as _staged

    return _staged(bundle, comm, **options)


def pack(output, names=(), **options):
    """Write a bundle; the library form of ``mpistage pack``.

    See :func:`mpistage.bundle.pack.pack` for the keywords.
    """
    from mpistage.bundle.pack import pack as _pack

    return _pack(output, names, **options)


def inspect(bundle):
    """Return the manifest of *bundle*; the library form of ``mpistage inspect``."""
    from mpistage.bundle.inspect import inspect as _inspect

    return _inspect(bundle)


def __getattr__(name):
    if name == "data":
        import importlib

        return importlib.import_module("mpistage.data")
    raise AttributeError(f"module 'mpistage' has no attribute {name!r}")


# -- collective loading of the runtime package --------------------------------

RUNTIME = "mpistage.runtime"
RANK0_STDLIB = ("json", ("__init__", "decoder", "scanner", "encoder"))
_OWN = {}  # mpistage's private copies of standard library modules
_STDLIB_CODES = {}  # rank 0's preloaded code of RANK0_STDLIB


def load_runtime(comm):
    """Make ``mpistage.runtime`` importable on every rank of *comm* (collective).

    Rank 0 reads the package's code (one directory listing, then each file
    relative to an open directory) and broadcasts it; the other ranks import
    it from memory and never touch the file system for it. Rank 0 also reads
    the standard library modules only it needs before activation (``json``,
    for the manifest) the same way, for :func:`own_module`. Calling it again
    does nothing.
    """
    import os

    if not preload(comm, RUNTIME):
        return
    if comm.rank == 0 and RANK0_STDLIB[0] not in _OWN:
        folder = os.path.join(os.path.dirname(os.__file__), RANK0_STDLIB[0])
        _STDLIB_CODES.update(_read_package(folder, *RANK0_STDLIB))


def preload(comm, package, only=None):
    """Make the modules of *package* (mpistage's own) importable by broadcast.

    Collective: rank 0 reads them (*only* these module stems, if given) and
    sends their code; the other ranks import them from memory. Returns
    ``False`` if they were preloaded already (nothing done).
    """
    import os

    if (package, only) in _PRELOADED:
        return False
    codes, folder = {}, os.path.join(__path__[0], *package.split(".")[1:])
    if comm.rank == 0:
        try:
            codes = _read_package(folder, package, only)
        except (OSError, SyntaxError, ValueError) as exc:
            codes = f"cannot read {package}: {exc}"  # told to every rank
    codes = comm.bcast(codes, root=0)
    if isinstance(codes, str):
        raise StageError(codes)
    if package in _sys.modules:
        codes.pop(package, None)  # imported already (mpistage.data itself)
    _sys.meta_path.insert(0, _Preloaded(codes))
    _PRELOADED.add((package, only))
    return True


_PRELOADED = set()


def load_local(package, stems):
    """Make the modules *stems* of mpistage's *package* importable, read here.

    The one-process form of :func:`preload`, for what runs before MPI (the
    node boot, :mod:`mpistage.node.boot`): each module is read relative to
    an open descriptor of its directory, about six metadata operations,
    instead of being looked for along ``sys.path``. Modules imported or
    loadable already are skipped; with none left, nothing is read. A
    package not imported yet whose ``__init__`` is not among *stems* is
    made empty rather than read: ``mpistage.node``'s and
    ``mpistage.runtime``'s hold only their docstrings (tests/test_nodeboot.py
    keeps them so), and every rank would pay six operations for one.
    """
    import os

    names = {stem: package if stem == "__init__" else f"{package}.{stem}"
             for stem in stems}  # fmt: skip
    wanted = [s for s, n in names.items() if n not in _sys.modules and n not in _LOCAL]
    if not wanted:
        return
    folder = os.path.join(__path__[0], *package.split(".")[1:])
    codes = _read_package(folder, package, wanted)
    if package not in _sys.modules and package not in _LOCAL and package not in codes:
        import marshal

        origin = os.path.join(folder, "__init__.py")
        codes[package] = (origin, True, marshal.dumps(compile("", origin, "exec")))
    _LOCAL.update(codes)
    _sys.meta_path.insert(0, _Preloaded(codes))


_LOCAL = {}  # what load_local read, by module name
# The modules of mpistage.node every rank reads before MPI (the node boot);
# the package itself is made empty (:func:`load_local`).
NODE = ("boot", "imports", "launch", "place", "cleanup")


def own_module(name):
    """Return the standard library module *name* for mpistage's own use.

    The program must see the modules plain python would give it, on every
    rank; so what mpistage imports for its own work (rank 0's ``json`` and
    ``_hashlib``) leaves no trace in ``sys.modules``: the module is imported
    from the standard library alone (a ``json.py`` beside the script is not
    it), kept here, and every entry the import added to ``sys.modules`` is
    taken out again, and any the program had is put back. Code that looks
    its own package up by name while it runs (``_json`` does, to raise an
    error) runs inside :func:`lend`.
    """
    if name not in _OWN:
        _OWN[name] = _import_aside(name)
    return _OWN[name][name]


def lend(name):
    """A context in which ``sys.modules`` holds mpistage's own *name* and its parts."""
    own_module(name)
    return _Lent(_OWN[name])


class _Lent:
    """Puts some ``sys.modules`` entries in place for a while, then back."""

    def __init__(self, entries):
        self.entries, self.saved = entries, {}

    def __enter__(self):
        self.saved = {k: _sys.modules.get(k) for k in self.entries}
        _sys.modules.update(self.entries)

    def __exit__(self, *exc):
        for key, module in self.saved.items():
            if module is None:
                _sys.modules.pop(key, None)
            else:
                _sys.modules[key] = module


def _import_aside(name):
    """Import *name* from the standard library; return the entries it added.

    ``sys.modules`` is left as it was.
    """
    import os

    modules, path = dict(_sys.modules), _sys.path[:]
    for key in [k for k in modules if k == name or k.startswith(name + ".")]:
        del _sys.modules[key]
    dynload = [p for p in path if p.endswith("lib-dynload")]
    _sys.path[:] = [os.path.dirname(os.__file__), *dynload]
    finder = _Preloaded(_STDLIB_CODES)
    _sys.meta_path.insert(0, finder)
    try:
        __import__(name)
        return {k: m for k, m in _sys.modules.items() if modules.get(k) is not m}
    finally:
        _sys.meta_path.remove(finder)
        _sys.path[:] = path
        for key in [k for k in _sys.modules if k not in modules]:
            del _sys.modules[key]
        _sys.modules.update(modules)


def _read_package(folder, package, only=None):
    """Return ``{name: (origin, is package, marshalled code)}`` of *folder*'s modules.

    *only* names the module stems to read (default: every ``.py`` file, from
    one listing). Each file is reached relative to descriptors of *folder*
    and its ``__pycache__``: about six metadata operations a module.
    """
    import os

    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        cache = _open_cache(fd)
        codes = {}
        names = [f"{stem}.py" for stem in only] if only else sorted(os.listdir(fd))
        for entry in names:
            stem, dot, suffix = entry.partition(".")
            if dot and suffix == "py" and stem.isidentifier():
                name = package if stem == "__init__" else f"{package}.{stem}"
                origin = os.path.join(folder, entry)
                code = _code(fd, cache, entry, origin)
                codes[name] = (origin, stem == "__init__", code)
        return codes
    finally:
        os.close(fd)
        if cache is not None:
            os.close(cache)


def _open_cache(fd):
    """Open the ``__pycache__`` below *fd*, or return ``None``."""
    import os

    try:
        return os.open("__pycache__", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    except OSError:
        return None


def _code(fd, cache, entry, origin):
    """Return the marshalled code of *entry*: its valid bytecode cache, or compiled."""
    import marshal
    import os
    from _frozen_importlib_external import cache_from_source

    st = os.stat(entry, dir_fd=fd)
    data = b""
    if cache is not None:
        try:
            data = _read_at(cache, os.path.basename(cache_from_source(origin)))
        except OSError:
            pass  # No bytecode cache yet: compile the source below.
    if data[:16] == pyc_header(st):
        return data[16:]
    source = _read_at(fd, entry)
    return marshal.dumps(compile(source, origin, "exec", dont_inherit=True))


def pyc_header(st):
    """The 16 bytes a timestamp ``.pyc`` of the source *st* begins with.

    The one check of bytecode against its source's ``os.stat_result``
    (the node boot's modules, live imports): magic, flags 0, then the
    source's mtime and size, each modulo 2**32, as the import system
    writes them.
    """
    from _frozen_importlib_external import MAGIC_NUMBER

    stamp = (int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF)
    return MAGIC_NUMBER + bytes(4) + b"".join(n.to_bytes(4, "little") for n in stamp)


def _read_at(fd, name):
    """Return the bytes of the file *name* in the directory open as *fd*."""
    import os

    file = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=fd)
    try:
        return read_fd(file, os.fstat(file).st_size)
    finally:
        os.close(file)


def read_fd(fd, size):
    """Read the *size* bytes the open file *fd* had at its ``fstat`` (fewer if
    it shrank since).

    Not Python's read to the end: asking past the size the client knows
    costs a shared file system one more metadata operation (a ``getattr``),
    and reading to the end asks twice. The one whole-file reader of the
    node boot, the live reader and the runner.
    """
    import os

    chunks = []
    while size > 0:
        chunk = os.read(fd, size)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


class Backoff:
    """The pauses of a wait that polls: from *first* seconds, doubling to *most*.

    The one rule for every poll (a collective's request, a live request's
    answer, the relay's loop, a follower's look at its node's place): a
    fast answer loses little, a long wait takes no CPU. Each caller names
    its two bounds.
    """

    def __init__(self, first, most):
        self.first, self.most = first, most
        self.pause = first

    def next(self):
        """Return the pause to take now; the one after is twice as long."""
        pause, self.pause = self.pause, min(self.pause * 2, self.most)
        return pause

    def sleep(self):
        """Sleep for :meth:`next`."""
        import time

        time.sleep(self.next())

    def reset(self):
        """Start again from *first* (something happened)."""
        self.pause = self.first


class _Preloaded:
    """A meta path finder serving the runtime package from broadcast code."""

    def __init__(self, codes):
        self.codes = codes

    def find_spec(self, fullname, path=None, target=None):
        """Return a spec for a preloaded module, or ``None``."""
        if fullname not in self.codes:
            return None
        from _frozen_importlib import ModuleSpec
        from _frozen_importlib_external import cache_from_source

        origin, is_package, _ = self.codes[fullname]
        spec = ModuleSpec(fullname, self, origin=origin, is_package=is_package)
        spec.has_location = True
        spec.cached = cache_from_source(origin)
        if is_package:
            spec.submodule_search_locations = [origin.rpartition("/")[0]]
        return spec

    def create_module(self, spec):
        """Use the default module creation."""
        return None

    def exec_module(self, module):
        """Run the module's broadcast code in its namespace."""
        import marshal

        code = marshal.loads(self.codes[module.__spec__.name][2])
        exec(code, module.__dict__)

    def get_source(self, fullname):
        """Return the source, for tracebacks and ``inspect``."""
        with open(self.codes[fullname][0], encoding="utf-8") as f:
            return f.read()
