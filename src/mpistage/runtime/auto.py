"""The auto cache: bundles learned on a first run, replayed on later ones.

``python -m mpistage --auto app.py`` looks for a bundle under a key that
covers the Python executable and version, ``sys.path`` as the target will
see it, and the target (script path, module name or code). On a miss, or
when the cached bundle is stale, the job runs normally while rank 0 records,
and the bundle is written at exit. On a hit it is replayed.

The cache directory may sit on a shared file system used by many jobs at
once: a bundle is written to a temporary file in the same directory and
renamed into place, so readers never see a partial file, two jobs writing
the same key both succeed (the last rename wins, both bundles are valid),
and nothing takes a lock.
"""

import os as _os
import sys as _sys


def cache_dir(option=None):
    """Return the cache directory: option, ``MPISTAGE_CACHE_DIR`` or XDG."""
    if option:
        return _os.path.abspath(option)
    if _os.environ.get("MPISTAGE_CACHE_DIR"):
        return _os.path.abspath(_os.environ["MPISTAGE_CACHE_DIR"])
    base = _os.environ.get("XDG_CACHE_HOME") or _os.path.expanduser("~/.cache")
    return _os.path.join(base, "mpistage")


def target_path0(args):
    """Return ``sys.path[0]`` as the target will see it (as mpi4py.run sets it)."""
    if args[0] == "-c":
        return ""
    if args[0] == "-m":
        return _os.path.abspath(_sys.path[0] or ".")
    return _os.path.realpath(_os.path.dirname(args[0]))


def key(args):
    """Return the cache key of running *args* with this Python and sys.path."""
    import hashlib
    import json

    target = args[1] if args[0] in ("-c", "-m") else _os.path.abspath(args[0])
    path = [target_path0(args)] + [_os.path.abspath(p or ".") for p in _sys.path[1:]]
    parts = [_os.path.abspath(_sys.executable), _sys.version, path, args[0], target]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


def bundle_path(args, folder=None):
    """Return the cached bundle's path for *args*."""
    from mpistage.bundle import SUFFIX

    stem = (
        args[1]
        if args[0] == "-m"
        else "code"
        if args[0] == "-c"
        else _os.path.splitext(_os.path.basename(args[0]))[0]
    )
    return _os.path.join(cache_dir(folder), f"{stem}-{key(args)}{SUFFIX}")


def save(recorder, path, args):
    """Write the bundle *recorder* learned to *path* (rank 0, at exit)."""
    from mpistage.record import build

    _os.makedirs(_os.path.dirname(path), mode=0o700, exist_ok=True)
    return build(
        path,
        [recorder.usage()],
        "package",
        "auto",
        {"command": ["python", "-m", "mpistage", "--auto", *args]},
    )
