"""The node boot's import hooks: the first rank records, the followers replay.

Both are meta path finders put first on ``sys.meta_path`` for the time of
``from mpi4py import MPI`` alone (:class:`Hook`). The first rank's
:class:`~mpistage.node.copy.ImportRecorder` lets the usual finders find each
module, keeps the code of Python modules as it runs it, and has extension
modules and libraries loaded from their copies. A follower's
:class:`Server` answers the recorded names from the record and the copy,
without looking at the shared file system; other names are not its own.

The MPI library is not imported: mpi4py opens it with ``ctypes.CDLL``
(its ``_mpiabi`` decides which file). While a hook is in place,
``ctypes.CDLL`` is a subclass that opens the node's copy of that file
instead, so mpi4py makes its own choice the same way on every rank. An
extension module the first rank got from another finder than the path
finder (mpi4py's own, for ``MPI``) is looked up again through the other
finders on the followers too, for that choice.

When the hook goes, every module it served keeps the loader plain python
would have given it (``SourceFileLoader`` and its kin), and ``ctypes.CDLL``
is the class it was.
"""

import os as _os
import sys as _sys
from _frozen_importlib import ModuleSpec as _ModuleSpec
from _frozen_importlib_external import ExtensionFileLoader as _ExtensionFileLoader
from _frozen_importlib_external import PathFinder as _PathFinder
from _frozen_importlib_external import SourceFileLoader as _SourceFileLoader
from _frozen_importlib_external import SourcelessFileLoader as _SourcelessFileLoader
from _frozen_importlib_external import spec_from_file_location as _spec_at

from mpistage.node.launch import fnv1a

SOURCE_LOADERS = {_SourceFileLoader: "source", _SourcelessFileLoader: "sourceless"}


class Hook:
    """A meta path finder of the node boot, in place for one import."""

    def __init__(self):
        self.served = {}  # module name -> the loader it keeps afterwards
        self.ctypes = self.cdll = None

    def install(self):
        """Go first on ``sys.meta_path``; take over ``ctypes.CDLL`` if imported."""
        _sys.meta_path.insert(0, self)
        self.patch_ctypes()

    def remove(self):
        """Leave ``sys.meta_path``; give the modules and ``ctypes`` their own back."""
        if self in _sys.meta_path:
            _sys.meta_path.remove(self)
        for name, loader in self.served.items():
            module = _sys.modules.get(name)
            if module is not None:
                module.__loader__ = loader
                if getattr(module, "__spec__", None) is not None:
                    module.__spec__.loader = loader
        if self.ctypes is not None:
            self.ctypes.CDLL = self.cdll
            self.ctypes = self.cdll = None

    def others(self, name, path, target, only=None):
        """Return (spec, finder) as the finders after this one find *name*.

        *only* names the one finder to ask (:func:`finder_name`).
        """
        for finder in list(_sys.meta_path):
            if finder is self or (only is not None and finder_name(finder) != only):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                return spec, finder
        return None, None

    def ran(self, module):
        """After a module's code ran: take over ``ctypes.CDLL`` once it exists."""
        if module.__name__ == "ctypes":
            self.patch_ctypes()

    def patch_ctypes(self):
        """Make ``ctypes.CDLL`` open what :meth:`open_library` says."""
        ctypes = _sys.modules.get("ctypes")
        if ctypes is None or self.ctypes is not None:
            return
        hook, base = self, ctypes.CDLL

        class CDLL(base):
            __doc__ = base.__doc__

            def __init__(self, name, *args, **kwargs):
                hook.open_library(base, self, name, args, kwargs)

        CDLL.__module__, CDLL.__qualname__ = base.__module__, base.__qualname__
        self.ctypes, self.cdll = ctypes, base
        ctypes.CDLL = CDLL

    def open_library(self, base, lib, name, args, kwargs):
        """Open the library *name* as ``base.__init__`` would (subclasses redirect)."""
        base.__init__(lib, name, *args, **kwargs)


class Server(Hook):
    """A follower's hook: the recorded modules, from the record and the copy."""

    def __init__(self, place, record):
        super().__init__()
        self.place, self.modules = place, record["modules"]
        self.libraries, self.missing = record["libraries"], set(record["missing"])
        self.first = record.get("first", {})

    def find_spec(self, name, path=None, target=None):
        """Return the spec of a recorded module, or ``None``.

        A name no finder found for the first rank is not found here either,
        without a look along the path.
        """
        if name in self.missing:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        entry = self.modules.get(name)
        if entry is None:
            return None
        if entry[0] == "ext":
            return self.extension_spec(name, path, target, *entry[1:])
        _kind, origin, cached, is_package, locations, _code, how = entry
        spec = _ModuleSpec(name, self, origin=origin, is_package=is_package)
        spec.has_location, spec.cached = True, cached
        if is_package:
            spec.submodule_search_locations = list(locations)
        loader = _SourcelessFileLoader if how == "sourceless" else _SourceFileLoader
        self.served[name] = loader(name, origin)
        return spec

    def extension_spec(self, name, path, target, origin, rel, finder, locations):
        """The spec of a recorded extension module, loaded from its copy.

        One that another finder than the path finder found (mpi4py's own,
        for ``MPI``) is asked of that finder again, for what it does on the
        way: mpi4py chooses and opens the MPI library there.
        """
        if finder is not None:
            spec, _finder = self.others(name, path, target, only=finder)
            if spec is None or spec.origin != origin:
                return spec
        copy = f"{self.place}/{rel}"
        loader = _ExtensionFileLoader(name, copy)
        spec = _spec_at(name, copy, loader=loader, submodule_search_locations=locations)
        self.served[name] = loader
        return spec

    def create_module(self, spec):
        """Use the default module creation."""
        return None

    def exec_module(self, module):
        """Run the module's recorded code."""
        import marshal

        code = marshal.loads(self.modules[module.__spec__.name][5])
        exec(code, module.__dict__)
        self.ran(module)

    def open_library(self, base, lib, name, args, kwargs):
        """Open the node's copy of *name* if the first rank did, else *name*."""
        rel = self.libraries.get(name) if isinstance(name, str) else None
        if rel is None:
            base.__init__(lib, name, *args, **kwargs)
        elif isinstance(rel, tuple):
            raise OSError(rel[1])  # what opening it gave the first rank
        else:
            for first in self.first.get(name, ()):  # as the first rank did
                LOADED.append(base(f"{self.place}/{first}"))
            base.__init__(lib, f"{self.place}/{rel}", *args, **kwargs)


def source_kind(loader):
    """Return how a Python module's code is read ("source", "sourceless"), or None."""
    return SOURCE_LOADERS.get(type(loader))


def via_path(finder):
    """Whether *finder* is the path finder (its modules are found by location)."""
    return finder is _PathFinder


def finder_name(finder):
    """Name a meta path finder alike in every process: module and qualified name."""
    kind = finder if isinstance(finder, type) else type(finder)
    return f"{kind.__module__}.{kind.__qualname__}"


# -- what the first rank and the others share: the record and its checks --------

LOADED = []  # copies a follower loaded ahead of their dependents (kept open)
RECORD = "record"  # what the first rank loaded, marshalled; its presence is the mark
FILES = "files"  # the copies, below it at their original absolute paths
VERSION = 1  # of the record
KEY_ENV = ("LD_LIBRARY_PATH", "LD_PRELOAD")  # what else decides what a rank loads


class Declined(Exception):
    """The copy is not used: the rank imports as usual, for this reason."""


def identity():
    """Return what a follower must share with its first rank to use the copy.

    The interpreter, the paths the import searches and what the dynamic
    loader is told: ranks of one launch that differ in any of them (a
    launch with several programs) import as usual.
    """
    parts = [_sys.executable, _sys.version, *_sys.path]
    parts += [f"{k}={_os.environ.get(k, '')}" for k in KEY_ENV]
    mpi4py = (f"{k}={v}" for k, v in _os.environ.items() if k.startswith("MPI4PY_"))
    parts += sorted(mpi4py)
    return f"{fnv1a(chr(0).join(parts).encode()):016x}"


# -- the record's shape: a follower checks every field before it uses one --------

MODULE_SHAPES = {
    "code": (str, (str, type(None)), bool, list, bytes, str),
    "ext": (str, str, (str, type(None)), (list, type(None))),
}
RECORD_SHAPE = {
    "version": int, "launch": str, "instance": str, "identity": str,
    "modules": dict, "missing": list, "libraries": dict, "first": dict,
    "files": int, "bytes": int, "declined": list,
}  # fmt: skip


def bad_shape(record):
    """Return what is wrong with the shape of a node boot *record*, or ``None``."""
    if not isinstance(record, dict):
        return "is not a record"
    for key, kind in RECORD_SHAPE.items():
        if not isinstance(record.get(key), kind) or isinstance(record.get(key), bool):
            return f"has no {key} of the right kind"
    for name, entry in record["modules"].items():
        if not isinstance(name, str) or not module_entry(entry):
            return f"has a module entry of the wrong shape ({name!r})"
    if not all(isinstance(n, str) for n in record["missing"]):
        return "has a missing name that is no string"
    for name, rel in record["libraries"].items():
        error = isinstance(rel, tuple) and len(rel) == 2 and rel[0] == "error"
        if not isinstance(name, str) or not (inside(rel) or error and strings(rel)):
            return f"has a library entry of the wrong shape ({name!r})"
    for name, rels in record["first"].items():
        if not isinstance(name, str) or not isinstance(rels, list):
            return f"has a first-loaded entry of the wrong shape ({name!r})"
        if not all(inside(rel) for rel in rels):
            return f"has a first-loaded copy outside the place ({name!r})"
    return None


def module_entry(entry):
    """Whether *entry* is a record's module: ``("code", ...)`` or ``("ext", ...)``."""
    if not isinstance(entry, tuple) or not entry or entry[0] not in MODULE_SHAPES:
        return False
    kinds = MODULE_SHAPES[entry[0]]
    fields = entry[1:]
    if len(fields) != len(kinds):
        return False
    if not all(isinstance(f, k) for f, k in zip(fields, kinds, strict=True)):
        return False
    if entry[0] == "ext":
        return inside(fields[1]) and strings(fields[3] or ())
    return fields[5] in ("source", "sourceless") and strings(fields[3])


def strings(items):
    """Whether every item of *items* is a string."""
    return all(isinstance(item, str) for item in items)


def inside(rel):
    """Whether *rel* names a file below the place: relative, no ``..`` or ``""``."""
    if not isinstance(rel, str) or not rel or rel.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in rel.split("/"))


ENTRY_POINTS = {"mpi4py": ("mpi4py.run",), "mpi4py.run": ("mpi4py.run",)}


def entry_modules(argv=None):
    """Return the modules the runner's ``-m`` target imports before the program.

    ``python -m mpi4py app.py`` and ``mpistage ... -m mpi4py app.py`` run
    ``mpi4py.run``; the node boot brings it with mpi4py, so that it is
    served from the node's copy, never looked for in the originals by
    every rank once the bundle's finders are in place.
    """
    argv = _sys.argv if argv is None else argv
    if "-m" not in argv[1:-1]:
        return ()
    return ENTRY_POINTS.get(argv[argv.index("-m", 1) + 1], ())
