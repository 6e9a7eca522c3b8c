"""The first rank of a node: import mpi4py, and leave what it loaded for the node.

:func:`import_and_copy` imports ``mpi4py.MPI`` with ``MPI_Init`` held back
(``mpi4py.rc.initialize``), through a :class:`ImportRecorder`:

- Python modules are found as usual and their code is kept as it runs, so
  the followers need not read them (nothing is read twice);
- extension modules and the MPI library are copied into the node's place
  before they are loaded, and loaded from the copy, by this rank too, so
  every rank of the node maps the same files (:class:`Copier`);
- an extension module of a package takes along the rest of the package's
  directory (``__pycache__`` made, empty): its ``__file__`` is in the copy,
  and what the package reaches beside it must be there as in the original
  (mpi4py's ``libmpi.pxd``, ``mpi.cfg`` behind ``get_config()``,
  ``include/`` behind ``get_include()``); a directory too big to copy
  whole leaves the extension module where it is;
- a copied library takes along the libraries it needs from the directories
  its ``$ORIGIN`` run path names (read from its ELF dynamic section, then
  looked for in listings of those directories, as the dynamic loader would
  find them), and the plugin directories beside it, those that hold shared
  objects only (UCX's ``ucx/``, libfabric's providers), which are loaded
  later, inside ``MPI_Init``. Copies keep their original absolute paths
  below ``files/``, so every ``$ORIGIN`` path leads to a copy.

Files in the system's library directories (``/usr/lib`` and the like) are
on every node already and are not copied. Anything the copy cannot match
exactly is left where it is and loaded from there, on every rank (a run
path with ``$LIB`` or ``$PLATFORM``, an old ``DT_RPATH``, a directory with
``glibc-hwcaps``, ``tls`` or platform subdirectories, a file that is not a
64-bit little-endian ELF object, a copy that does not load); the record
says which. Then the record is
written, atomically, which is the mark the followers wait for, and only
then does this rank start MPI, as mpi4py would have at import.
"""

import os as _os
import sys as _sys
from _frozen_importlib_external import ExtensionFileLoader
from _frozen_importlib_external import spec_from_file_location as spec_at

from mpistage.node.elf import elf_dynamic, mapped_names, origin_dirs
from mpistage.node.imports import (
    FILES,
    RECORD,
    VERSION,
    Declined,
    Hook,
    finder_name,
    identity,
    source_kind,
    via_path,
)
from mpistage.node.originals import Originals
from mpistage.node.place import write_new

# The dynamic loader's own directories: part of the node's image, not copied.
SYSTEM_DIRS = ("/lib/", "/lib64/", "/usr/lib/", "/usr/lib64/")
PLUGIN_DEPTH = 3  # directory levels of a plugin directory
PACKAGE_FILES = 256  # files a package's directory may hold to go with its extension
PACKAGE_DEPTH = 4  # directory levels of that directory (mpi4py/include/mpi4py)
LOADER_SUBDIRS = ("glibc-hwcaps", "tls", "haswell", "xeon_phi", "avx512_1")


def import_and_copy(meeting):
    """Import ``mpi4py.MPI``, leave it in *meeting*'s place, then start MPI."""
    recorder = ImportRecorder(Copier(meeting.fd, meeting.path))
    recorder.install()
    try:
        try:
            MPI, start = import_unstarted()
        finally:
            recorder.remove()
            recorder.copier.close()
    except BaseException as exc:
        meeting.fail(describe(exc))
        raise
    try:
        write_record(meeting.fd, recorder.record(meeting.launch, meeting.instance))
    except (OSError, ValueError) as exc:
        give_up(meeting, f"cannot write the record: {exc}")
    start()
    return MPI


def give_up(meeting, reason):
    """Tell the followers to import as usual; free the room the copies take."""
    from mpistage.node.cleanup import remove_entry

    try:
        remove_entry(meeting.fd, FILES)
    except OSError:
        pass  # The place goes as a whole at the end.
    meeting.fail(reason)


def describe(error):
    """Say in one line what stopped the first rank (for its followers)."""
    from mpistage import describe as one_line

    return one_line(error)


def import_entry():
    """Import what the target's entry point runs before the program, if any.

    ``-m mpi4py`` (the documented ``python -m mpi4py app.py``) runs
    ``mpi4py.run`` first: imported here, it is left for the node with the
    rest, and every rank has it before the runner's finders take over.
    """
    from mpistage.node.imports import entry_modules

    for name in entry_modules():
        __import__(name)


def import_unstarted():
    """Import ``mpi4py.MPI`` without ``MPI_Init``; return it and what starts MPI.

    mpi4py starts MPI inside its import when ``rc.initialize`` says so; here
    the import runs with it off (and ``rc.finalize`` as mpi4py would have
    derived it), and the function returned starts MPI the way mpi4py's
    import would have (``MPI_Init_thread`` at ``rc.thread_level``, or
    ``MPI_Init``).
    """
    import mpi4py

    rc = mpi4py.rc
    initialize, finalize = rc.initialize, rc.finalize
    rc.initialize = False
    rc.finalize = initialize if finalize is None else finalize
    try:
        from mpi4py import MPI

        import_entry()
    finally:
        rc.initialize, rc.finalize = initialize, finalize

    def start():
        if initialize not in (True, "yes") or MPI.Is_initialized():
            return
        if rc.threads in (True, "yes"):
            level = f"THREAD_{str(rc.thread_level).upper()}"
            MPI.Init_thread(getattr(MPI, level, MPI.THREAD_MULTIPLE))
        else:
            MPI.Init()

    return MPI, start


def write_record(fd, record):
    """Write *record* into the place *fd*: a new file renamed into place."""
    import marshal

    data, tmp = marshal.dumps(record), f"{RECORD}.{_os.getpid()}.tmp"
    write_new(fd, tmp, data, 0o600)
    try:
        _os.rename(tmp, RECORD, src_dir_fd=fd, dst_dir_fd=fd)
    except BaseException:
        _os.unlink(tmp, dir_fd=fd)
        raise


def load_first(base, place, rels):
    """Load the copies *rels* of the place, in order, before what needs them.

    A library loaded by path is known to the loader by its ``DT_SONAME``:
    a later ``DT_NEEDED`` of that name is this copy, whatever
    ``LD_LIBRARY_PATH`` says. The handles stay open for the process's life.
    One that does not load alone (it needs symbols of a library it does
    not name) is left to its dependents; returns the copies loaded.
    """
    done = []
    for rel in rels:
        try:
            LOADED.append(base(f"{place}/{rel}"))
        except OSError:
            continue
        done.append(rel)
    return done


LOADED = []  # the copies loaded ahead of their dependents (kept open)


class ImportRecorder(Hook):
    """The first rank's hook: usual finders, code kept, binaries from the copy."""

    def __init__(self, copier):
        super().__init__()
        self.copier, self.modules, self.libraries = copier, {}, {}
        self.first = {}  # library name -> copies loaded before it (relative)
        self.copies = {}  # extension module name -> its ExtensionCopy loader
        self.missing = []  # names no finder found
        self.finders = {}  # name -> the finder that found it (finder_name)

    def remove(self):
        """As :meth:`Hook.remove`; extension modules keep a plain loader."""
        for name, loader in self.copies.items():
            self.served[name] = ExtensionFileLoader(name, loader.path)
            if not loader.copied:
                self.modules.pop(name, None)
        super().remove()

    def find_spec(self, name, path=None, target=None):
        """Find *name* as the other finders do; keep or copy what it is made of."""
        spec, finder = self.others(name, path, target)
        if spec is None:
            self.missing.append(name)
            return None
        self.finders[name] = finder_name(finder)
        how = source_kind(spec.loader)
        if how is not None:
            self.served[name] = spec.loader
            spec.loader = Recording(spec.loader, self, how)
            return spec
        if type(spec.loader) is ExtensionFileLoader and spec.origin:
            return self.extension(spec, via_path(finder))
        return spec

    def extension(self, spec, found_by_path):
        """Return the spec of the extension module's copy (or *spec*, if none)."""
        folder = package_folder(spec)
        rel = self.copier.take(spec.origin, plugins=False, beside=folder)
        if rel is None:
            return spec
        name, locations = spec.name, spec.submodule_search_locations
        copy = f"{self.copier.place}/{rel}"
        loader = ExtensionCopy(name, copy, spec.origin)
        found = spec_at(name, copy, loader=loader, submodule_search_locations=locations)
        finder = None if found_by_path else self.finders.get(name)
        self.modules[name] = ("ext", spec.origin, rel, finder, locations)
        self.copies[name] = loader
        return found

    def kept(self, module, code, how):
        """Keep the code of a Python module the usual loader just gave."""
        import marshal

        spec = module.__spec__
        locations = spec.submodule_search_locations
        self.modules[spec.name] = (
            "code", spec.origin, spec.cached, locations is not None,
            list(locations or ()), marshal.dumps(code), how,
        )  # fmt: skip

    def open_library(self, base, lib, name, args, kwargs):
        """Copy the library mpi4py opens, with what it needs; open the copy.

        A file that is no library at all (``libmpi.so`` may be a linker
        script) fails to open as it would have; the followers are told the
        error, so they need not look at the file either.
        """
        rel = None
        if isinstance(name, str) and "/" in name:
            rel = self.copier.take(name, plugins=True)
        if rel is not None:
            try:
                first = self.copier.first.get(_os.path.abspath(name), [])
                first = [self.copier.taken[p] for p in first]
                self.first[name] = load_first(base, self.copier.place, first)
                base.__init__(lib, f"{self.copier.place}/{rel}", *args, **kwargs)
                self.libraries[name] = rel
                return
            except OSError as exc:
                self.copier.decline(name, f"its copy does not load: {exc}")
        try:
            base.__init__(lib, name, *args, **kwargs)
        except OSError as exc:
            if _os.path.abspath(name) in self.copier.not_elf:
                self.libraries[name] = ("error", str(exc))
            raise

    def record(self, launch, instance):
        """Return the record the followers read."""
        return {
            "version": VERSION,
            "launch": launch,
            "instance": instance,
            "identity": identity(),
            "modules": self.modules,
            "missing": self.missing,
            "libraries": self.libraries,
            "first": self.first,
            "files": len(self.copier.taken),
            "bytes": self.copier.bytes,
            "declined": self.copier.declined,
        }


def package_folder(spec):
    """The directory of the package an extension module *spec* lies in, or None.

    That is where the module's ``__file__`` leads its package, in the copy.
    """
    folder = _os.path.dirname(_os.path.abspath(spec.origin))
    parent = spec.parent and _sys.modules.get(spec.parent)
    paths = getattr(parent, "__path__", None) or ()
    return folder if folder in (_os.path.abspath(p) for p in paths) else None


class Recording:
    """A Python module's usual loader, whose code the :class:`ImportRecorder` keeps."""

    def __init__(self, loader, recorder, how):
        self.loader, self.recorder, self.how = loader, recorder, how

    def create_module(self, spec):
        """Use the default module creation."""
        return None

    def exec_module(self, module):
        """Run the module's code (as its loader gives it) and keep the code."""
        code = self.loader.get_code(module.__name__)
        if code is None:
            raise ImportError(f"cannot load {module.__name__!r}", name=module.__name__)
        self.recorder.kept(module, code, self.how)
        exec(code, module.__dict__)
        self.recorder.ran(module)


class ExtensionCopy(ExtensionFileLoader):
    """Loads an extension module from its copy; from the original if that fails."""

    def __init__(self, name, path, original):
        super().__init__(name, path)
        self.original, self.copied = original, True

    def create_module(self, spec):
        """Load the copy; the original if the copy does not load."""
        try:
            return super().create_module(spec)
        except ImportError:
            self.copied = False
            spec.origin = self.original
            self.path = self.original
            return super().create_module(spec)


# -- what the copy holds ------------------------------------------------------------


class Copier:
    """Copies ELF objects, what they need and their plugins into a node's place.

    Originals are read relative to a descriptor of their directory, opened
    once; directories are listed once. Copies go below ``files/`` at their
    original absolute paths.
    """

    def __init__(self, fd, place):
        self.fd, self.place = fd, place
        self.originals = Originals()
        self.listing, self.read = self.originals.listing, self.originals.read
        self.made = {}  # a directory of the copy, relative to the place -> its fd
        self.taken = {}  # original path -> its copy, relative to the place
        self.sonames, self.plugins, self.declined = set(), set(), []
        self.not_elf = set()  # originals that are no ELF file at all
        self.bytes, self.mapped = 0, None
        self.first = {}  # original path -> the copies to load before it, in order
        self.redirected = set()  # originals LD_LIBRARY_PATH finds before $ORIGIN

    def take(self, path, plugins, beside=None):
        """Copy the ELF object *path* with what it needs; return its copy, or None.

        With *plugins*, the plugin directories beside each library go too;
        with *beside* (a package's directory), the files of that directory.
        All is read first and written after; what cannot be read or written
        whole (a full file system) is not copied at all.
        """
        path = _os.path.abspath(path)
        if path in self.taken:
            return self.taken[path]
        if path.startswith(SYSTEM_DIRS):
            self.decline(path, "a system directory, part of the node's image")
            return None
        plan, order = {}, []
        try:
            self.closure(path, plan, order)
            self.first[path] = [p for p in order if p in self.redirected]
            if plugins:
                for folder in sorted({_os.path.dirname(p) for p in plan}):
                    self.plan_plugins(folder, plan)
            if beside is not None:
                self.plan_package(beside, plan)
            self.put_all(plan)
        except (Declined, OSError) as exc:
            failed = isinstance(exc, OSError)
            self.decline(path, f"no copy: {exc.strerror}" if failed else str(exc))
            return None
        return self.taken[path]

    def put_all(self, plan):
        """Write the copies of *plan* (``None``: a directory, made empty).

        On failure the files written are removed again, and it raises.
        """
        written = []
        try:
            for original, data in plan.items():
                if data is None:  # a directory, made empty
                    self.copy_dir(f"{FILES}{original.rstrip('/')}")
                elif original not in self.taken:
                    self.put(original, data)
                    written.append(original)
        except OSError:
            for original in written:
                self.unput(original)
            raise

    def decline(self, path, reason):
        """Note that *path* is loaded from where it is, and why."""
        self.declined.append((path, reason))

    def closure(self, path, plan, order):
        """Add *path* and what it needs from beside it to *plan* (path -> bytes).

        *order* gets each one after what it needs: the order to load them in.
        """
        data = self.read(path)
        info = elf_dynamic(data)
        if info is None:
            if data[:4] != b"\x7fELF":
                self.not_elf.add(path)
            raise Declined("not a 64-bit little-endian ELF object")
        needed, runpath, rpath, soname = info
        if rpath and not runpath:
            raise Declined("it has a DT_RPATH, which its dependents inherit")
        plan[path] = data
        if soname:
            self.sonames.add(soname)
        try:
            dirs = origin_dirs(runpath or "", _os.path.dirname(path))
        except ValueError as exc:
            raise Declined(str(exc)) from None
        for name in needed:
            if name in self.sonames or self.is_mapped(name) or "/" in name:
                continue
            found = self.find(name, dirs)
            if found is not None and found not in plan and found not in self.taken:
                self.closure(found, plan, order)
        order.append(path)

    def find(self, name, dirs):
        """Return where the loader finds *name*, or None (a system directory, or none).

        ``LD_LIBRARY_PATH`` comes first for the loader, then *dirs* (the
        ``$ORIGIN`` run path). What it finds is copied all the same; the
        copies are loaded before their dependents, by path, so the loader
        takes them by their ``DT_SONAME`` and never searches
        ``LD_LIBRARY_PATH`` for them (Open MPI's ``mpiexec`` sets it to its
        own ``lib``, on the shared file system).
        """
        paths = [f for f in _os.environ.get("LD_LIBRARY_PATH", "").split(":") if f]
        for folder in paths + list(dirs):
            entries = self.listing(folder)
            if entries is None:
                continue
            odd = [n for n in LOADER_SUBDIRS + (_os.uname().machine,) if entries.get(n)]
            if odd:
                raise Declined(f"{folder!r} has {odd[0]!r}, searched first by ld.so")
            if name in entries:
                found = f"{_os.path.abspath(folder)}/{name}"
                if found.startswith(SYSTEM_DIRS):
                    return None
                if folder in paths:
                    self.redirected.add(found)
                return found
        return None

    def is_mapped(self, name):
        """Whether a library named *name* is mapped into this process already."""
        if self.mapped is None:
            self.mapped = mapped_names()
        return name in self.mapped

    def plan_plugins(self, folder, plan):
        """Add the directories in *folder* that hold shared objects only to *plan*."""
        if folder in self.plugins:
            return
        self.plugins.add(folder)
        for name, is_dir in sorted((self.listing(folder) or {}).items()):
            if is_dir and name != "__pycache__":
                files = self.originals.plugin_files(f"{folder}/{name}", PLUGIN_DEPTH)
                for path in files or ():
                    if path not in self.taken and path not in plan:
                        plan[path] = self.read(path)

    def plan_package(self, folder, plan):
        """Add the files of the package directory *folder* to *plan*, or none.

        Its ``__pycache__`` directories are made empty (:meth:`put_all`).
        """
        files = self.originals.tree_files(folder, PACKAGE_DEPTH, PACKAGE_FILES)
        if files is None:
            raise Declined(f"its package's directory {folder!r} is too big to copy")
        for path in files:
            if path.endswith("/"):
                plan[path] = None
            elif path not in self.taken and path not in plan:
                plan[path] = self.read(path)

    # -- writing copies ------------------------------------------------------------

    def put(self, path, data):
        """Write the copy of *path* (its original absolute path below ``files/``)."""
        rel = f"{FILES}{path}"
        folder, name = rel.rsplit("/", 1)
        write_new(self.copy_dir(folder), name, data, 0o700)
        self.taken[path], self.bytes = rel, self.bytes + len(data)
        return rel

    def copy_dir(self, folder):
        """Return a descriptor of the copy's directory *folder*, made (0700) once."""
        if folder not in self.made:
            parent, _, name = folder.rpartition("/")
            fd = _os.dup(self.copy_dir(parent) if parent else self.fd)
            self.made[folder] = enter(fd, name)
        return self.made[folder]

    def unput(self, path):
        """Remove the copy of *path* again."""
        rel = self.taken.pop(path)
        try:
            _os.unlink(f"{self.place}/{rel}")
        except OSError:
            pass  # Gone already; the place goes as a whole at the end anyway.

    def close(self):
        """Close the descriptors of original directories and of the copy's."""
        self.originals.close()
        for fd in self.made.values():
            _os.close(fd)
        self.made = {}


def enter(fd, name):
    """Make (0700) or open the directory *name* below *fd*; close *fd*; return it."""
    from mpistage.node.place import DIR_FLAGS

    try:
        try:
            _os.mkdir(name, 0o700, dir_fd=fd)
        except FileExistsError:
            pass
        return _os.open(name, DIR_FLAGS, dir_fd=fd)
    finally:
        _os.close(fd)
