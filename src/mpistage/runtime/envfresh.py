"""Whether the environment an environment bundle was packed from changed since.

``mpistage pack --env`` is a snapshot. An install, upgrade or removal in
the environment afterwards changes one of a few directories: a
``site-packages`` (every distribution adds or removes its entries there),
``conda-meta``, the standard library's directory. The bundle records each
one's mtime and a digest of its names and inodes (``env.watch`` in the
manifest, :func:`snapshot`); :func:`changed` compares them again, once per
run, in the process that launches it: one ``stat`` per directory, and one
listing of a directory only where its mtime moved (bytecode written into a
new ``__pycache__`` moves it, and is no change). A package reinstalled at
the same version gets new inodes, so it shows too. A file edited in place
does not: that is what packing again is for. Bundles made before this
check have no ``env.watch`` and are never called stale.
"""

import glob as _glob
import os as _os
from stat import S_ISDIR

LIMIT = 3  # changed directories named in the message, at most


def watched(prefix, stdlib):
    """The directories whose change means the environment at *prefix* changed.

    Its ``site-packages`` directories, ``conda-meta`` if it has one, and
    the standard library directory *stdlib* (the base interpreter's, for a
    venv). Each is named once, by its real path.
    """
    found = []
    patterns = ("lib/python3*/site-packages", "lib64/python3*/site-packages")
    for pattern in patterns:
        found += sorted(_glob.glob(_os.path.join(prefix, pattern)))
    found += [_os.path.join(prefix, "conda-meta"), stdlib]
    real = {}
    for path in found:
        if _os.path.isdir(path):
            real.setdefault(_os.path.realpath(path), None)
    return list(real)


def snapshot(dirs):
    """Return ``[[path, mtime_ns, digest], ...]`` of *dirs*, for the manifest."""
    from mpistage.runtime.roots import entries_digest

    return [[d, _os.stat(d).st_mtime_ns, entries_digest(d)] for d in dirs]


def changed(manifest, limit=LIMIT):
    """Return up to *limit* watched directories that changed since the pack."""
    from mpistage.runtime.validate import dir_changed

    found = []
    for path, mtime_ns, digest in manifest.get("env", {}).get("watch", []):
        try:
            st = _os.lstat(path)  # watched paths are real paths: no link to follow
        except OSError:
            found.append(path)  # gone
            continue
        if not S_ISDIR(st.st_mode) or dir_changed(
            st, mtime_ns, digest, lambda p=path: open_dir(p)
        ):
            found.append(path)  # no longer a directory, or one that changed
        if len(found) >= limit:
            break
    return found


def open_dir(path):
    """Open the directory *path*: never a FIFO, a device or a link put there since."""
    flags = _os.O_RDONLY | _os.O_DIRECTORY | _os.O_NOFOLLOW | _os.O_NONBLOCK
    return _os.open(path, flags | _os.O_CLOEXEC)


def verdict(bundle, manifest):
    """The one-line refusal of a stale environment bundle, or ``None``."""
    found = changed(manifest)
    if not found:
        return None
    names = ", ".join(repr(p) for p in found)
    return (
        f"environment bundle {bundle!r} is stale: {names} changed since `pack "
        "--env` (a package installed, upgraded or removed); pack it again, or "
        "give --trust to run the old snapshot"
    )
