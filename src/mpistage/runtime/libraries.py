"""Which shared objects a rank mapped, and from where: the report's libraries.

A GPU stack's weight is in libraries, not modules: torch's CUDA libraries
(``nvidia/cublas/lib/libcublas.so.12``) are gigabytes that other
distributions hold, loaded by the dynamic loader or ``dlopen``. At the
report point every rank reads ``/proc/self/maps``; a mapped shared object
(a file named ``*.so`` or ``*.so.N``: extension modules and the libraries
they need) is

- *from the node's copy* when it lies in the bundle's copy, the live
  imports' copy or the node boot's;
- *from the originals* when it lies below a root the bundle takes files
  from (or a directory live imports serve): the shared file system, where
  the bundle could have spared it;
- not counted elsewhere (the system's ``/usr/lib``, a root the bundle only
  lists).

Each is named by its original path, so the ranks of all nodes agree; rank
0 looks up the sizes of the originals, once each.

While a bundle is active, :class:`Libraries` loads from the copy what
``ctypes`` is asked for by an original's path.
"""

import os as _os
import sys as _sys

LARGEST = 5  # originals the screen report names


def mapped_files():
    """Return the files mapped into this process (``/proc/self/maps``)."""
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


def is_shared_object(path):
    """Whether *path* names a shared object: ``*.so`` or ``*.so.N``."""
    name = _os.path.basename(path)
    return name.endswith(".so") or ".so." in name


def local(session, live=None):
    """Return this rank's mapped shared objects, ``copy`` and ``originals``."""
    namers = copy_namers(session, live)
    roots = tuple(root + "/" for root in original_roots(session, live))
    copy, originals = set(), set()
    for path in sorted(mapped_files()):
        if not is_shared_object(path):
            continue
        named = original_of(path, namers)
        if named is not None:
            copy.add(named)
        elif path.startswith(roots):
            originals.add(path)
    return {"copy": sorted(copy), "originals": sorted(originals)}


def original_of(path, namers):
    """Return the original of *path* when it lies in a node's copy, else ``None``."""
    for namer in namers:
        found = namer(path)
        if found is not None and found != path:
            return found
    return None


def copy_namers(session, live):
    """Return the functions that name the original of a path in a node's copy."""
    namers = []
    staged = session.staged if session is not None else None
    if staged is not None and staged.path:
        namers.append(bundle_namer(staged.path, staged.manifest))
    if live is not None and getattr(live, "copy_root", None):
        namers.append(live.original)
    boot = _sys.modules.get("mpistage.node.boot")
    if boot is not None:
        namers.append(boot.original)
    return namers


def bundle_namer(place, manifest):
    """Return the function that names the original of a path in a bundle's copy."""
    from mpistage.runtime.roots import destinations

    pairs = []
    for root, dest in zip(manifest["roots"], destinations(manifest), strict=True):
        copy = f"{place}/{dest}/" if dest else f"{place}/"
        pairs.append((copy, root["path"].rstrip("/") + "/"))
    pairs.sort(key=lambda pair: len(pair[0]), reverse=True)

    def namer(path):
        for copy, original in pairs:
            if path.startswith(copy):
                return original + path[len(copy) :]
        return None

    return namer


def original_roots(session, live):
    """Return the roots whose libraries count as from the originals.

    A bundle's roots that hold members (not those it only lists); with live
    imports, the directories they serve.
    """
    staged = session.staged if session is not None else None
    found = []
    if staged is not None:
        held = {member["root"] for member in staged.manifest["members"]}
        roots = staged.manifest["roots"]
        found += [roots[i]["path"].rstrip("/") for i in sorted(held)]
    if live is not None and getattr(live, "mode", None) == "live":
        found += [root.rstrip("/") for root in live.roots]
    return found


def summarize(ranks):
    """Combine the ranks' libraries: counts, and the originals' bytes (rank 0)."""
    copy = {path for facts in ranks if facts for path in facts["copy"]}
    originals = {path for facts in ranks if facts for path in facts["originals"]}
    sizes = {path: size_of(path) for path in originals}
    largest = sorted(sizes.items(), key=lambda item: (-item[1], item[0]))
    return {
        "copy": len(copy),
        "originals": len(originals),
        "original_bytes": sum(sizes.values()),
        "largest": [list(item) for item in largest],
        "copy_names": sorted(copy),
    }


def size_of(path):
    """Return the size of the file *path*, or 0 when it is gone."""
    try:
        return _os.stat(path).st_size
    except OSError:
        return 0


def render(found):
    """Say in lines how many libraries came from where, and the largest originals."""
    if not found or not (found["copy"] or found["originals"]):
        return []
    lines = [
        f"  libraries: {found['copy']} from the node's copy, {found['originals']} "
        f"from the originals ({megabytes(found['original_bytes'])})"
    ]
    if found["largest"]:
        shown = ", ".join(
            f"{path} ({megabytes(size)})" for path, size in found["largest"][:LARGEST]
        )
        more = " ..." if len(found["largest"]) > LARGEST else ""
        lines.append(f"  largest originals: {shown}{more}")
    return lines


def megabytes(size):
    """Return *size* in bytes as ``12.3 MB``."""
    return f"{size / 1e6:.1f} MB"


class Libraries:
    """Loads what ``ctypes`` is asked for by an original's path from the copy.

    ``ctypes.CDLL`` opens a library through ``ctypes._dlopen``; while the
    bundle is active, that is wrapped: a path below a bundled root whose
    copy holds the file is opened in the copy (a stat of the node-local
    copy, no look at the original). Names without a ``/``, paths elsewhere
    and files the bundle lacks go to the loader as they are. ``ctypes``
    is not imported for this: it is wrapped when the program imports it.
    """

    def __init__(self, roots):
        self.roots = [(r.path + _os.sep, r.staged) for r in roots.values() if r.staged]
        self.prefixes = tuple(prefix for prefix, _ in self.roots)
        self.module = self.real = self.wrapper = None

    def copy(self, name):
        """Return where the library *name* is in the copy, else *name*."""
        if not isinstance(name, str) or not name.startswith(_os.sep):
            return name
        path = _os.path.normpath(name)
        if not path.startswith(self.prefixes):
            return name
        for prefix, staged in self.roots:
            if path.startswith(prefix):
                copy = _os.path.join(staged, path[len(prefix) :])
                return copy if _os.path.isfile(copy) else name
        return name

    def install(self, ctypes):
        """Wrap ``ctypes._dlopen`` of the module *ctypes* (once)."""
        real = getattr(ctypes, "_dlopen", None)
        if self.real is not None or real is None:
            return
        self.module, self.real = ctypes, real

        def dlopen(name, *args, **kwargs):
            return real(self.copy(name), *args, **kwargs)

        ctypes._dlopen = self.wrapper = dlopen

    def uninstall(self):
        """Put ``ctypes._dlopen`` back, if it is still ours."""
        if self.real is not None and self.module._dlopen is self.wrapper:
            self.module._dlopen = self.real
        self.module = self.real = None
