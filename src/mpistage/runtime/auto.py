"""The auto cache: bundles learned on a first run, replayed on later ones.

``python -m mpistage --auto app.py`` looks for a bundle under a key that
covers the Python executable and version, ``sys.path`` as the target will
see it, and the target (script path, module name or code). On a miss, or
when the cached bundle is unusable or stale, the job runs normally while
every rank records what it uses; at the end the union over all ranks is
reduced to rank 0 along a tree (O(log P) steps) and written as the bundle.
On a hit it is replayed.

A :class:`Recorder` runs inside the program (every rank of a learning run,
and every Python process of ``mpistage record``). An audit hook notes every
file it opens for reading (``open``, ``importlib.resources``,
``importlib.metadata``, ``get_data``), every directory it lists, and every
library ``ctypes`` loads; at the end, the modules in ``sys.modules`` and the
files mapped into the process (``/proc/self/maps``: extension modules and
the shared libraries they link) are added. Paths are normalized, so a data
file reached as ``pkg/../data/x`` counts as ``data/x``.

A replay needs more than what was read, and must not get what the program
wrote. A stat is no audit event, so while it records, ``os.stat``,
``os.lstat`` and ``os.access`` (and with them ``os.path.exists``,
``isfile``, ``pathlib``...) note the paths the program *checked*: torch
only checks that ``torch/bin/torch_shm_manager`` exists, and fails to
import without it. The audit hook also notes what the program *wrote*
(files opened for writing or created, renamed, linked or truncated into
place, directories made): the builder takes none of it, nor makes a root
of a directory it wrote into (:class:`mpistage.bundle.record.Written`).

After the program, rank 0 builds the bundle in its own process
(:mod:`mpistage.learn`, a layer above this runtime and the bundle writer,
which the runner is handed by ``python -m mpistage``): no process starts
from the shared file system, and nothing the run read is looked at again.

The cache directory may sit on a shared file system used by many jobs at
once: a bundle is written to a temporary file in the same directory and
renamed into place, so readers never see a partial file, two jobs writing
the same key both succeed (the last rename wins, both bundles are valid),
and nothing takes a lock. A cache directory that cannot be written is
refused before the program runs, so nothing is lost.
"""

import os as _os
import sys as _sys

from mpistage import StageError
from mpistage.runtime.libraries import mapped_files
from mpistage.runtime.report import read_of

KEY_DIGITS = 24  # hex digits of a cache key: 96 bits, no two targets alike


def cache_dir(option=None):
    """Return the cache directory: option, ``MPISTAGE_CACHE_DIR`` or XDG."""
    from mpistage.settings import get

    option = option or get("MPISTAGE_CACHE_DIR")
    if option:
        return _os.path.abspath(option)
    base = _os.environ.get("XDG_CACHE_HOME") or _os.path.expanduser("~/.cache")
    return _os.path.join(base, "mpistage")


def target_path0(args):
    """Return ``sys.path[0]`` as the target will see it."""
    if args[0] == "-c":
        return ""
    if args[0] == "-m":
        return _os.path.abspath(_sys.path[0] or ".")
    return _os.path.realpath(_os.path.dirname(args[0]))


def key(args):
    """Return the cache key of running *args* with this Python and sys.path."""
    from mpistage.runtime.bundlefile import sha256

    target = args[1] if args[0] in ("-c", "-m") else _os.path.abspath(args[0])
    path = [target_path0(args)] + [_os.path.abspath(p or ".") for p in _sys.path[1:]]
    parts = [_os.path.abspath(_sys.executable), _sys.version, *path, args[0], target]
    return sha256("\0".join(parts).encode()).hexdigest()[:KEY_DIGITS]


def bundle_path(args, folder=None):
    """Return the cached bundle's path for *args*."""
    from mpistage.runtime.bundlefile import SUFFIX

    if args[0] == "-m":
        stem = args[1]
    elif args[0] == "-c":
        stem = "code"
    else:
        stem = _os.path.splitext(_os.path.basename(args[0]))[0]
    return _os.path.join(cache_dir(folder), f"{stem}-{key(args)}{SUFFIX}")


def open_cache(folder, create=False):
    """Open the cache directory *folder* as a private place; return its descriptor.

    Its bundles are code this user runs, so it follows the rule of a
    node's place (:func:`mpistage.node.place.open_safe`): every
    directory on the way, as given and as resolved, is root's or ours and
    not writable by others unless sticky, a symlink on the way is ours or
    root's; the cache itself is ours, not writable by others, and made
    0700 (group and others lose any access). With *create*, missing
    directories are made, 0700.
    """
    from mpistage.node.place import check_own, open_safe

    try:
        _real, fd = open_safe(folder, create=create)
    except OSError as exc:
        raise StageError(
            f"cannot use the --auto cache {folder!r}: {exc.strerror}"
        ) from None
    except StageError as exc:
        raise StageError(
            f"the --auto cache is not a private place: {exc}; give --cache-dir DIR "
            "(or MPISTAGE_CACHE_DIR) a directory of your own"
        ) from None
    try:
        st = _os.fstat(fd)
        check_own(st, folder, True)
    except StageError as exc:
        _os.close(fd)
        raise StageError(
            f"the --auto cache is not a private place: {exc}; give --cache-dir DIR "
            "(or MPISTAGE_CACHE_DIR) a directory of your own"
        ) from None
    if st.st_mode & 0o077:
        try:
            _os.fchmod(fd, st.st_mode & 0o700)
        except OSError:
            pass  # A read-only cache: nobody can write it, which is what counts.
    return fd


def ensure_writable(path, why):
    """Create the cache directory of *path* if needed; refuse one we cannot write.

    *why* says why a bundle must be learned (``no cached bundle``, stale).
    """
    folder = _os.path.dirname(path)
    try:
        _os.close(open_cache(folder, create=True))
    except OSError as exc:
        raise StageError(
            f"cannot create the --auto cache {folder!r}: {exc.strerror}; give "
            "--cache-dir DIR or MPISTAGE_CACHE_DIR"
        ) from None
    if not _os.access(folder, _os.W_OK | _os.X_OK):
        raise StageError(
            f"cannot write the --auto cache {folder!r} ({why}); give "
            "--cache-dir DIR or MPISTAGE_CACHE_DIR"
        )


def open_cached(path):
    """Open the cached bundle *path* if there is one; return its descriptor or None.

    What is replayed must have been written by this user: the cache is a
    private place (:func:`open_cache`), the bundle is opened there without
    following a symlink, and must be a regular file of ours that others
    cannot write.
    """
    import stat

    folder, name = _os.path.split(path)
    try:
        cache = open_cache(folder)
    except StageError:
        if not _os.path.lexists(folder):
            return None
        raise
    flags = _os.O_RDONLY | _os.O_NOFOLLOW | _os.O_NONBLOCK | _os.O_CLOEXEC
    try:
        fd = _os.open(name, flags, dir_fd=cache)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StageError(
            f"cannot read the --auto bundle {path!r}: {exc.strerror}"
        ) from None
    finally:
        _os.close(cache)
    st = _os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != _os.getuid() or st.st_mode & 0o022:
        _os.close(fd)
        raise StageError(
            f"the --auto bundle {path!r} is not a file of yours that only you "
            "can write; remove it"
        )
    return fd


def read_cached(path, check):
    """Rank 0: return (bundle, None) to replay, or (None, a reason to record).

    The bundle (:class:`~mpistage.runtime.read.Bundle`) is open, its
    manifest checked; its bytes are checked as they are sent. A cache that
    holds a fresh bundle is only read, so it may be read-only (a bundle
    learned once, then kept). One that must take a new bundle is checked
    writable first, before the program runs. Either must be a private
    place of this user (:func:`open_cache`, :func:`open_cached`).
    """
    from mpistage.runtime.read import open_bundle

    verdict = "no cached bundle"
    fd = open_cached(path)
    if fd is not None:
        try:
            bundle = open_bundle(path, fd=fd)  # the descriptor is the bundle's now
        except StageError as exc:
            verdict = str(exc)
        else:
            try:
                verdict = check(bundle.manifest)
            except BaseException:
                bundle.close()
                raise
            if not verdict:
                return bundle, None
            bundle.close()
    return None, relearn(path, verdict)


def relearn(path, verdict):
    """Rank 0: check that a new bundle can be learned; return the report's word."""
    ensure_writable(path, verdict)
    return f"recorded ({verdict})"


def start_recording():
    """Start recording this rank's use of files (a learning run)."""
    return Recorder()


UNITED = ("files", "listed", "checked", "written", "made", "start_path")


def merge(a, b):
    """Union of two usages (the reduction operator of :func:`save`)."""
    copies = {**a.get("copies", {}), **b.get("copies", {})}
    united = {k: sorted(set(a.get(k, [])) | set(b.get(k, []))) for k in UNITED}
    started = [u["started_ns"] for u in (a, b) if u.get("started_ns")]
    return dict(a, **united, copies=copies, started_ns=min(started, default=None))


# -- recording ---------------------------------------------------------------------


class Recorder:
    """Notes the files this process uses; see the module docstring."""

    def __init__(self):
        import time

        self.paths, self.listed, self.checked = set(), set(), set()
        self.written, self.made = set(), set()
        self.active = True
        self.started_ns = time.time_ns()
        self.start_path = [_os.path.abspath(p or ".") for p in _sys.path]
        # Loaded before any runner can act (.pth hooks, the runner itself):
        # staging them would not help, so they are not recorded.
        self.preloaded = set(_sys.modules)
        _sys.addaudithook(self.hook)
        self.checks = watch_checks(self)

    def hook(self, event, args):
        """Audit hook: remember paths opened for reading, listed or dlopened.

        And what the program wrote: files opened for writing or put in
        place, directories made.
        """
        if not self.active:
            return
        kind, path = read_of(event, args)
        if kind is None:
            kind, path = write_of(event, args)
        if kind is None or by_us() or (kind != "open" and by_import_system()):
            return
        path = _os.path.normpath(_os.path.abspath(path))
        found = {"listing": self.listed, "written": self.written, "made": self.made}
        found.get(kind, self.paths).add(path)

    def check(self, path):
        """Note that the program checked *path* (a stat, an access)."""
        if self.active and not by_us_checking():
            path = _os.fsdecode(path)
            self.checked.add(_os.path.normpath(_os.path.abspath(path)))

    def stop(self):
        """Stop recording; put the checks back."""
        self.active = False
        for name, check in self.checks.items():
            if getattr(_os, name, None) is check:
                setattr(_os, name, check.__wrapped__)
        self.checks = {}

    def usage(self, served=()):
        """Stop recording; return what was used, as JSON-ready data.

        The files of the modules loaded since recording started are looked
        up, but those of *served* (modules a live run served: its reader
        knows their files, and looking costs a stat of each original).
        """
        from mpistage.runtime.bundlefile import python_tag

        self.stop()
        paths = self.paths | mapped_files()
        paths |= module_files(self.preloaded | set(served))
        paths = originals(paths) - main_script()
        entries = [_os.path.abspath(p or ".") for p in _sys.path]
        entries += finder_roots(entries)
        return {
            "python": python_tag(),
            "sys_path": entries,
            "files": sorted(paths),
            "listed": sorted(self.listed),
            "checked": sorted(originals(self.checked) - paths),
            "written": sorted(self.written),
            "made": sorted(self.made),
            "start_path": sorted(set(self.start_path) | script_dir()),
            "started_ns": self.started_ns,
        }


def main_script():
    """Return the program's own script (as given, and resolved): no bundle holds it.

    Every rank reads it anyway (it is what the job runs), and in the
    bundle each edit of it would make the bundle stale. ``sys.argv[0]``
    names it (Python takes ``__file__`` off ``__main__`` once it has run).
    """
    script = _sys.argv[0] if _sys.argv else ""
    if script in ("", "-c", "-m") or not script.endswith(".py"):
        return set()
    path = _os.path.abspath(script)
    return {_os.path.normpath(path), _os.path.realpath(path)}


# event: (kind, index of the path, index of its directory descriptor)
WRITE_EVENTS = {
    "os.rename": ("written", 1, 3),  # os.replace too
    "os.link": ("written", 1, 3),
    "os.symlink": ("written", 1, 2),
    "os.truncate": ("written", 0, None),
    "os.mkdir": ("made", 0, 2),
}
CHECKS = ("stat", "lstat", "access")


def write_of(event, args):
    """Return (kind, path) of an audit event that writes a path, else (None, None).

    Kinds: ``written`` (a file opened for writing or created, the target of
    a rename, link or symlink, a file truncated) and ``made`` (``os.mkdir``).
    A path relative to a directory descriptor is not followed.
    """
    from mpistage.runtime.report import writes

    if event == "open" and len(args) == 3 and writes(args):
        kind, path, fd = "written", args[0], None
    elif event in WRITE_EVENTS and len(args) > WRITE_EVENTS[event][1]:
        kind, at, fd_at = WRITE_EVENTS[event]
        path, fd = args[at], args[fd_at] if fd_at is not None else None
    else:
        return None, None
    if isinstance(path, bytes):
        path = _os.fsdecode(path)
    if not isinstance(path, str) or fd not in (None, -1) and not _os.path.isabs(path):
        return None, None
    return kind, path


def watch_checks(recorder):
    """Make ``os.stat``, ``os.lstat`` and ``os.access`` tell *recorder*; return them.

    ``os.path`` and ``pathlib`` call them through the ``os`` module, so
    their checks are seen too. A descriptor, or a path relative to one, is
    not noted.
    """
    found = {}
    for name in CHECKS:
        found[name] = checking(getattr(_os, name), recorder)
        setattr(_os, name, found[name])
    return found


def checking(real, recorder):
    """Return *real* (``os.stat``...) that first tells *recorder* what it checks."""

    def check(path, *args, **kwargs):
        if kwargs.get("dir_fd") is None and isinstance(path, (str, bytes)):
            recorder.check(path)
        elif isinstance(path, _os.PathLike) and kwargs.get("dir_fd") is None:
            recorder.check(_os.fspath(path))
        return real(path, *args, **kwargs)

    check.__wrapped__ = real
    check.__name__, check.__doc__ = real.__name__, real.__doc__
    return check


def by_us_checking():
    """Whether a check came from mpistage or the import system, not the program.

    The standard library functions in between (``os.path.exists``,
    ``pathlib``) are looked through.
    """
    try:
        frame = _sys._getframe(3)  # past check(), Recorder.check() and this
    except ValueError:
        return True
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith((OWN_CODE, "<frozen importlib")):
            return True
        if not in_stdlib_code(name):
            return False
        frame = frame.f_back
    return True


def in_stdlib_code(filename):
    """Whether code of *filename* is the standard library's (frozen included)."""
    if filename.startswith("<frozen "):
        return True
    return filename.startswith(STDLIB) and "-packages" + _os.sep not in filename


STDLIB = _os.path.dirname(_os.__file__) + _os.sep


def script_dir():
    """Return the directory of the script being run, as a set (none: empty)."""
    script = _sys.argv[0] if _sys.argv else ""
    if script and script not in ("-c", "-m") and _os.path.isfile(script):
        return {_os.path.dirname(_os.path.realpath(script))}
    return set()


def by_import_system():
    """Whether the audited call came from the import system (its own listings)."""
    try:
        frame = _sys._getframe(2)
    except ValueError:
        return False
    return frame.f_code.co_filename.startswith("<frozen importlib")


def by_us():
    """Whether the audited call came from mpistage's own code, not the program's.

    The live reader opens files relative to directory descriptors: the
    audit event names them relative, without the descriptor.
    """
    try:
        frame = _sys._getframe(2)
    except ValueError:
        return False
    return frame.f_code.co_filename.startswith(OWN_CODE)


OWN_CODE = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))) + _os.sep


def finder_roots(entries):
    """Return the roots of top-level modules found off ``sys.path``.

    A finder-based editable install (PEP 660) maps a package to its source
    tree without putting that tree on ``sys.path``; the tree's parent is a
    root all the same.
    """
    found = set()
    prefixes = tuple(e + _os.sep for e in entries)
    for name, module in list(_sys.modules.items()):
        origin = getattr(getattr(module, "__spec__", None), "origin", None)
        if "." in name or not origin or not _os.path.isabs(origin):
            continue
        origin = next(iter(originals([origin])))
        if origin.startswith(prefixes) or not _os.path.isfile(origin):
            continue
        is_package = _os.path.basename(origin).startswith("__init__.")
        top = _os.path.dirname(origin)
        found.add(_os.path.dirname(top) if is_package else top)
    return sorted(found)


def module_files(skip=()):
    """Return the source, bytecode and extension files of loaded modules.

    Nothing is looked up here (each rank would stat every original): the
    bundle's builder keeps only the files that exist, once, on rank 0.
    """
    found = set()
    for name, module in list(_sys.modules.items()):
        if name in skip:
            continue
        spec = getattr(module, "__spec__", None)
        if not getattr(spec, "has_location", False):
            continue
        for path in (spec.origin, getattr(spec, "cached", None)):
            if path and _os.path.isabs(path):
                found.add(_os.path.normpath(path))
    return found


def originals(paths):
    """Return *paths* with the node boot's copies named by their originals."""
    boot = _sys.modules.get("mpistage.node.boot")
    return {boot.original(p) for p in paths} if boot is not None else set(paths)


def start_child(folder):
    """Record this process; write its usage to *folder* at exit."""
    import atexit

    recorder = Recorder()
    atexit.register(save_usage, recorder, folder)
    return recorder


def save_usage(recorder, folder):
    """Write *recorder*'s usage as ``usage.<pid>.json`` in *folder*.

    It runs at the program's exit: its ``json`` may be the program's own.
    """
    from mpistage import lend, own_module

    json = own_module("json")

    path = _os.path.join(folder, f"usage.{_os.getpid()}.json")
    usage = recorder.usage()
    with open(path + ".tmp", "w") as f, lend("json"):
        json.dump(usage, f)
    _os.replace(path + ".tmp", path)
