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


class StageError(Exception):
    """The one error class of mpistage: bad input, refused places, failed steps.

    In a job it is raised on every rank of the communicator after the ranks
    agreed on it, so a program may catch it and go on. The command line
    prints it as one ``mpistage: error: ...`` line and exits with status 1.
    """


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


def load_runtime(comm):
    """Make ``mpistage.runtime`` importable on every rank of *comm* (collective).

    Rank 0 reads the package's code (one directory listing, then each file
    relative to an open directory) and broadcasts it; the other ranks import
    it from memory and never touch the file system for it. Calling it again
    does nothing.
    """
    if any(isinstance(f, _Preloaded) for f in _sys.meta_path):
        return
    codes = _read_runtime() if comm.rank == 0 else None
    codes = comm.bcast(codes, root=0)
    _sys.meta_path.insert(0, _Preloaded(codes))


def _read_runtime():
    """Return ``{module name: (origin, is package, marshalled code)}`` (rank 0)."""
    import os

    folder = os.path.join(__path__[0], "runtime")
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        codes = {}
        for entry in os.listdir(fd):
            stem, dot, suffix = entry.partition(".")
            if dot and suffix == "py" and stem.isidentifier():
                name = RUNTIME if stem == "__init__" else f"{RUNTIME}.{stem}"
                origin = os.path.join(folder, entry)
                codes[name] = (origin, stem == "__init__", _code(fd, entry, origin))
        return codes
    finally:
        os.close(fd)


def _code(fd, entry, origin):
    """Return the marshalled code of *entry*: its valid bytecode cache, or compiled."""
    import marshal
    import os
    from importlib.util import MAGIC_NUMBER, cache_from_source

    st = os.stat(entry, dir_fd=fd)
    cached = os.path.relpath(cache_from_source(origin), os.path.dirname(origin))
    try:
        data = _read_at(fd, cached)
    except OSError:
        data = b""  # No bytecode cache yet: compile the source below.
    stamp = (int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF)
    want = MAGIC_NUMBER + bytes(4) + b"".join(n.to_bytes(4, "little") for n in stamp)
    if data[:16] == want:
        return data[16:]
    source = _read_at(fd, entry)
    return marshal.dumps(compile(source, origin, "exec", dont_inherit=True))


def _read_at(fd, name):
    """Return the bytes of the file *name* in the directory open as *fd*."""
    import os

    with open(os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=fd), "rb") as f:
        return f.read()


class _Preloaded:
    """A meta path finder serving the runtime package from broadcast code."""

    def __init__(self, codes):
        self.codes = codes

    def find_spec(self, fullname, path=None, target=None):
        """Return a spec for a preloaded module, or ``None``."""
        if fullname not in self.codes:
            return None
        from importlib.machinery import ModuleSpec
        from importlib.util import cache_from_source

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
