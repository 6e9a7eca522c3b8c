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
from mpistage.runtime.report import read_of

KEY_DIGITS = 24  # hex digits of a cache key: 96 bits, no two targets alike


def cache_dir(option=None):
    """Return the cache directory: option, ``MPISTAGE_CACHE_DIR`` or XDG."""
    if option:
        return _os.path.abspath(option)
    if _os.environ.get("MPISTAGE_CACHE_DIR"):
        return _os.path.abspath(_os.environ["MPISTAGE_CACHE_DIR"])
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


def ensure_writable(path, why):
    """Create the cache directory of *path* if needed; refuse one we cannot write.

    *why* says why a bundle must be learned (``no cached bundle``, stale).
    """
    folder = _os.path.dirname(path)
    try:
        _os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise StageError(
            f"cannot create the --auto cache {folder!r}: {exc.strerror}"
        ) from None
    if not _os.access(folder, _os.W_OK | _os.X_OK):
        raise StageError(
            f"cannot write the --auto cache {folder!r} ({why}); give "
            "--cache-dir DIR or MPISTAGE_CACHE_DIR"
        )


def read_cached(path, check):
    """Rank 0: return (bytes, manifest, None) to replay, or a reason to record.

    A cache that holds a fresh bundle is only read, so it may be read-only
    (a bundle learned once, then shared). One that must take a new bundle
    is checked writable first, before the program runs.
    """
    from mpistage.runtime.read import read_checked

    verdict = "no cached bundle"
    if _os.path.exists(path):
        try:
            buf, manifest = read_checked(path)
        except StageError as exc:
            verdict = str(exc)
        else:
            verdict = check(manifest)
            if not verdict:
                return buf, manifest, None
    ensure_writable(path, verdict)
    return None, None, f"recorded ({verdict})"


def start_recording():
    """Start recording this rank's use of files (a learning run)."""
    return Recorder()


def merge(a, b):
    """Union of two usages (the reduction operator of :func:`save`)."""
    copies = {**a.get("copies", {}), **b.get("copies", {})}
    files = sorted(set(a["files"]) | set(b["files"]))
    listed = sorted(set(a.get("listed", [])) | set(b.get("listed", [])))
    return dict(a, files=files, listed=listed, copies=copies)


def save(comm, recorder, path, args, live=None):
    """Reduce every rank's usage to rank 0, which has the bundle built (collective).

    Rank 0 writes the union to a file beside the cached bundle and runs
    ``mpistage record --usage FILE`` on it, in a process of its own: the
    bundle is made by the tool that makes bundles, with none of the
    program's modules around. After live imports (*live*), paths in a
    node's copy count as their originals, and rank 0 adds every file the
    reader served.
    """
    from mpistage.runtime.collective import attempt

    def usage():
        if live is None or live.mode != "live":
            return recorder.usage()
        return live.usage(recorder.usage(served=live.served_modules()))

    usage = comm.reduce(attempt(comm, usage), op=merge, root=0)
    if comm.rank == 0:
        usage.update(created_by="auto", processes=comm.size)
        usage["command"] = ["python", "-m", "mpistage", "--auto", *args]
    attempt(comm, lambda: build(path, usage) if comm.rank == 0 else None)


def build(path, usage):
    """Rank 0: write *usage* beside *path*, then build the bundle from it."""
    import subprocess

    from mpistage import lend, own_module

    json, tempfile = own_module("json"), own_module("tempfile")
    folder = _os.path.dirname(path)
    fd, saved = tempfile.mkstemp(dir=folder, prefix=".mpistage-usage-", suffix=".json")
    try:
        with _os.fdopen(fd, "w") as f, lend("json"):
            json.dump(usage, f)
        command = [_sys.executable, "-m", "mpistage", "record", "--usage", saved]
        if usage.get("copies"):  # what a live run served, read from node 0's copy
            command += ["--granularity", "file"]
        done = subprocess.run(
            [*command, "-o", path], cwd=folder, capture_output=True, text=True
        )
    finally:
        _os.unlink(saved)
    if done.returncode:
        why = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise StageError(f"cannot save the --auto bundle {path!r}: {why}")


# -- recording ---------------------------------------------------------------------


class Recorder:
    """Notes the files this process uses; see the module docstring."""

    def __init__(self):
        self.paths, self.listed = set(), set()
        self.active = True
        # Loaded before any runner can act (.pth hooks, the runner itself):
        # staging them would not help, so they are not recorded.
        self.preloaded = set(_sys.modules)
        _sys.addaudithook(self.hook)

    def hook(self, event, args):
        """Audit hook: remember paths opened for reading, listed or dlopened."""
        if not self.active:
            return
        kind, path = read_of(event, args)
        if kind is None or (kind == "listing" and by_import_system()) or by_us():
            return
        path = _os.path.normpath(_os.path.abspath(path))
        (self.listed if kind == "listing" else self.paths).add(path)

    def usage(self, served=()):
        """Stop recording; return what was used, as JSON-ready data.

        The files of the modules loaded since recording started are looked
        up, but those of *served* (modules a live run served: its reader
        knows their files, and looking costs a stat of each original).
        """
        from mpistage.runtime.bundlefile import python_tag

        self.active = False
        paths = self.paths | mapped_files()
        paths |= module_files(self.preloaded | set(served))
        paths = originals(paths)
        entries = [_os.path.abspath(p or ".") for p in _sys.path]
        entries += finder_roots(entries)
        return {
            "python": python_tag(),
            "sys_path": entries,
            "files": sorted(paths),
            "listed": sorted(self.listed),
        }


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
    boot = _sys.modules.get("mpistage.nodeboot")
    return {boot.original(p) for p in paths} if boot is not None else set(paths)


def mapped_files():
    """Return the files mapped into this process (shared libraries)."""
    found = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    found.add(fields[5].strip())
    except OSError:
        pass
    return found


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
