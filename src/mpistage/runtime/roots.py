"""The vocabulary of sys.path roots, shared by every step and tool.

A *root* is a directory on ``sys.path`` (site-packages, the standard library,
a ``--path`` tree, the script's directory). Its *listing* is the sorted list
of its entries, directories ending in ``/``. This module alone decides:

- which top-level module name an entry provides (:func:`top_name`), and
  which names a lookup in a listed directory finds (:func:`module_names`);
- whether a path is part of the standard library (:func:`in_stdlib`);
- which directories a bundle holds only in part (:func:`partial_dirs`);
- what of a directory's entries a bundle depends on, bytecode left out
  (:func:`entries_digest`);
- where each root goes below a node's place (:func:`destinations`).
"""

import os as _os
import sys as _sys

METADATA_SUFFIXES = (".dist-info", ".egg-info")
NOT_MODULES = METADATA_SUFFIXES + (".libs", ".pth", ".data")


def import_suffixes():
    """Return the file suffixes the import system loads (``.py``, ``.so``, ...)."""
    from importlib.machinery import all_suffixes

    return tuple(all_suffixes())


def top_name(entry, is_dir=None):
    """Return the top-level module name a root entry provides, or ``None``.

    *entry* is a listing entry (a directory ends in ``/``) or a name with
    *is_dir* given. Packages and namespace portions are directories with an
    identifier for a name; modules are files with an import suffix.
    Metadata, ``.libs``, ``.pth`` files and ``__pycache__`` provide none.
    """
    if is_dir is None:
        is_dir = entry.endswith("/")
    name = entry.rstrip("/")
    if name == "__pycache__" or name.endswith(NOT_MODULES):
        return None
    if is_dir:
        return name if name.isidentifier() else None
    if not name.endswith(import_suffixes()):
        return None
    stem = name.split(".", 1)[0]
    return stem if stem.isidentifier() else None


def module_names(listing):
    """Return every name a ``FileFinder`` of a directory with *listing* finds.

    This is the finder's own rule, not :func:`top_name`'s: a directory is
    found under its name (a package, or a namespace portion), a file under
    its name less any import suffix, identifier or not, because
    ``importlib.import_module`` takes any string (``sysconfig`` imports
    ``_sysconfigdata__linux_x86_64-linux-gnu``). A name outside this set is
    one plain python would not find in that directory either.
    """
    suffixes, names = import_suffixes(), set()
    for entry in listing:
        if entry.endswith("/"):
            names.add(entry[:-1])
        else:
            names.update(entry[: -len(s)] for s in suffixes if entry.endswith(s))
    return names


def listing(root):
    """Return the entries of the directory *root*, directories ending in ``/``.

    *root* is a path or an open directory descriptor. This is the one form
    of a listing: in manifests, in staleness checks and in finders.
    """
    with _os.scandir(root) as entries:
        return sorted(e.name + "/" if e.is_dir() else e.name for e in entries)


def entries_digest(directory):
    """Return a digest of a directory's names and inodes, ``__pycache__`` left out.

    *directory* is a path or an open directory descriptor (not ``O_PATH``).
    A directory's mtime changes when Python first writes bytecode into it
    (``__pycache__`` appears); that is not the package changing. When the
    mtime changed, the staleness check compares this digest instead: a
    name added, removed or replaced by rename (a new inode) still changes
    it. One ``getdents`` pass: inodes come from the listing, not a stat.
    """
    with _os.scandir(directory) as entries:
        return digest_of(entries)


def digest_of(entries):
    """Return the digest of scanned directory *entries* (see :func:`entries_digest`)."""
    from mpistage.runtime.bundlefile import sha256

    found = [f"{e.name}\0{e.inode()}" for e in entries if e.name != "__pycache__"]
    found.sort()
    return sha256("\n".join(found).encode()).hexdigest()[:32]


def stdlib_dirs():
    """Return the standard library's directories: the stdlib and lib-dynload."""
    stdlib = _os.path.dirname(_os.__file__)
    dynload = [p for p in _sys.path if p.endswith("lib-dynload")]
    return (stdlib, *dynload)


def in_stdlib(path):
    """Whether *path* is part of the standard library (not site-packages)."""
    parts = path.split(_os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    return any(path == d or path.startswith(d + _os.sep) for d in stdlib_dirs())


def destinations(manifest):
    """Return, per bundled root, its directory below the node's place.

    Runner bundles keep root *i* in ``r<i>``; environment bundles say where
    each root goes (``dest``), so that several roots merge into one prefix.
    """
    return [root.get("dest", f"r{i}") for i, root in enumerate(manifest["roots"])]


def partial_dirs(manifest, index):
    """Return the directories of root *index* that the bundle holds in part.

    A directory the bundle holds whole is a member of its own; one that only
    leads to file members (``--granularity file``) is not, and one with
    entries left out (``--exclude``, test directories) is marked ``partial``.
    """
    whole, parents = set(), set()
    for member in manifest["members"]:
        if member["root"] != index:
            continue
        if member["type"] == "dir":
            if not member.get("partial"):
                whole.add(member["rel"])
        else:
            rel = _os.path.dirname(member["rel"])
            while rel and rel not in parents:
                parents.add(rel)
                rel = _os.path.dirname(rel)
    return sorted(parents - whole)


def root_of(path, roots):
    """Return (root, top entry, rel) for *path* below one of *roots*, or ``None``.

    *roots* are tried in order, so give the deepest first.
    """
    for root in roots:
        if path.startswith(root + _os.sep):
            rel = path[len(root) + 1 :]
            return root, rel.split(_os.sep, 1)[0], rel
    return None
