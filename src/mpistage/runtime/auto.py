"""The auto cache: bundles learned on a first run, replayed on later ones.

``python -m mpistage --auto app.py`` looks for a bundle under a key that
covers the Python executable and version, ``sys.path`` as the target will
see it, and the target (script path, module name or code). On a miss, or
when the cached bundle is unusable or stale, the job runs normally while
every rank records what it uses; at the end the union over all ranks is
reduced to rank 0 along a tree (O(log P) steps) and written as the bundle.
On a hit it is replayed.

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
    return sha256("\0".join(parts).encode()).hexdigest()[:24]


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


def ensure_writable(path):
    """Create the cache directory of *path* if needed; refuse one we cannot write."""
    folder = _os.path.dirname(path)
    try:
        _os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise StageError(
            f"cannot create the --auto cache {folder!r}: {exc.strerror}"
        ) from None
    if not _os.access(folder, _os.W_OK | _os.X_OK):
        raise StageError(
            f"cannot write the --auto cache {folder!r}; give --cache-dir DIR "
            "or MPISTAGE_CACHE_DIR"
        )


def read_cached(path, check):
    """Rank 0: return (bytes, manifest, None) to replay, or a reason to record."""
    from mpistage.runtime.read import read_checked

    ensure_writable(path)
    if not _os.path.exists(path):
        return None, None, "recorded (no cached bundle)"
    try:
        buf, manifest = read_checked(path)
    except StageError as exc:
        return None, None, f"recorded ({exc})"
    stale = check(manifest)
    if stale:
        return None, None, f"recorded ({stale})"
    return buf, manifest, None


def start_recording():
    """Start recording this rank's use of files (a learning run)."""
    from mpistage.bundle.record import Recorder

    return Recorder()


def merge(a, b):
    """Union of two usages (the reduction operator of :func:`save`)."""
    return dict(a, files=sorted(set(a["files"]) | set(b["files"])))


def save(comm, recorder, path, args):
    """Reduce every rank's usage to rank 0, which writes the bundle (collective)."""
    from mpistage.runtime.collective import attempt

    usage = comm.reduce(attempt(comm, recorder.usage), op=merge, root=0)

    def write():
        if comm.rank != 0:
            return
        from mpistage.bundle.record import build

        command = ["python", "-m", "mpistage", "--auto", *args]
        extra = {"command": command, "processes": comm.size}
        try:
            with ProgramAside():
                build(path, [usage], "package", "auto", extra)
        except OSError as exc:
            raise StageError(f"cannot save the --auto bundle {path!r}: {exc}") from None

    attempt(comm, write)


class ProgramAside:
    """While mpistage writes a learned bundle, the program's own modules step aside.

    The program has run: a ``json.py`` or ``csv.py`` beside its script may
    be in ``sys.modules`` under a standard library name, and its directory
    is ``sys.path[0]``. Both are taken out for the while, and put back.
    """

    def __enter__(self):
        here = _os.path.abspath(_sys.path[0] or ".")
        self.path = _sys.path[:]
        from mpistage.runtime.activate import namespace_of

        self.modules = {
            name: module
            for name, module in list(_sys.modules.items())
            if below((namespace_of(module) or {}).get("__file__"), here)
        }
        _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != here]
        for name in self.modules:
            del _sys.modules[name]

    def __exit__(self, *exc):
        _sys.path[:] = self.path
        _sys.modules.update(self.modules)


def below(path, folder):
    """Whether *path* (a string, or not) lies in *folder* or below it."""
    return isinstance(path, str) and path.startswith(folder + _os.sep)
