"""Listings: a directory's entries as the finders see them, and what they hold.

Both kinds of serving (the staged copy of a bundle, the live copy) answer
lookups from listings, never from a stat per name: a directory's entries,
directories ending in ``/``, what is no regular file or directory marked
(:func:`listed_entry`). :func:`locate` decides from listings what
``FileFinder`` would find, so a name that is not there is answered without
the file system; :func:`listed_modules` lists modules as ``pkgutil`` does.
"""

import os as _os
from importlib.machinery import BYTECODE_SUFFIXES as _BYTECODE_SUFFIXES
from importlib.machinery import EXTENSION_SUFFIXES as _EXTENSION_SUFFIXES
from importlib.machinery import SOURCE_SUFFIXES as _SOURCE_SUFFIXES

# Marks of listing entries that are no regular file or directory (no file
# name holds a NUL): a FIFO, socket or device; a link to nothing.
OTHER, DANGLING = "\0o", "\0x"


def listed_entry(entry):
    """Return a directory entry as listings hold it: what it is, marked.

    A directory ends in ``/``; a regular file is its name; anything else is
    marked (:data:`OTHER`, :data:`DANGLING`), so that it is neither a module
    nor a file to the finders. Only those cost a stat.
    """
    try:
        if entry.is_dir():
            return entry.name + "/"
        if entry.is_file():
            return entry.name
        entry.stat()
        return entry.name + OTHER
    except OSError:
        return entry.name + DANGLING


def local_listing(path):
    """Return the listing of the node-local directory *path*.

    ``None`` when there is none, ``False`` when *path* is no directory.
    """
    try:
        with _os.scandir(path) as entries:
            return tuple(sorted(listed_entry(e) for e in entries))
    except NotADirectoryError:
        return False
    except OSError:
        return None


def entry_name(entry):
    """Return the name a listing *entry* stands for, without its mark."""
    return entry.partition("\0")[0].rstrip("/")


def entry_kind(entries, name):
    """Return ``dir``, ``file``, ``other``, ``dangling`` or ``absent``."""
    for mark, kind in (("/", "dir"), ("", "file"), (OTHER, "other")):
        if name + mark in entries:
            return kind
    return "dangling" if name + DANGLING in entries else "absent"


def plain(entries):
    """Return listing *entries* without the marks of what is no file or dir."""
    if not entries:
        return entries
    return tuple(e if e.endswith("/") else entry_name(e) for e in entries)


def loader_kinds():
    """Return (kind, suffixes) in the order ``FileFinder`` tries them."""
    return (
        ("extension", _EXTENSION_SUFFIXES),
        ("source", _SOURCE_SUFFIXES),
        ("bytecode", _BYTECODE_SUFFIXES),
    )


def locate(listing_of, folder, name):
    """Find the module *name* in *folder* as ``FileFinder`` would.

    *listing_of(path)* returns a directory's entries (directories end in
    ``/``), or ``None``/``False`` when there is none. Returns ``(kind,
    path, search)``: kind ``extension``, ``source``, ``bytecode`` or
    ``namespace``; *search* is the package's directory list, else ``None``.
    Returns ``None`` when *folder* holds no such module.
    """
    entries = listing_of(folder)
    if not entries:
        return None
    base, namespace = f"{folder}/{name}", False
    if name + "/" in entries:
        inside = listing_of(base) or ()
        for kind, suffixes in loader_kinds():
            for suffix in suffixes:
                if "__init__" + suffix in inside:
                    return kind, f"{base}/__init__{suffix}", [base]
        namespace = True
    for kind, suffixes in loader_kinds():
        for suffix in suffixes:
            if name + suffix in entries:
                return kind, f"{folder}/{name}{suffix}", None
    return ("namespace", base, [base]) if namespace else None


def module_name(filename):
    """Return the module name of *filename* as ``inspect.getmodulename`` does."""
    from mpistage.runtime.roots import import_suffixes

    for suffix in sorted(import_suffixes(), key=len, reverse=True):
        if filename.endswith(suffix):
            return filename[: -len(suffix)]
    return None


def listed_modules(entries, is_package, prefix=""):
    """Yield ``(name, ispkg)`` of a directory's *entries* as ``pkgutil`` does.

    *entries* end in ``/`` for directories; ``is_package(name)`` says
    whether the directory *name* holds an ``__init__`` module. Python's
    ``__pycache__`` holds bytecode only, so it is no package, and nobody
    looks into it: a copy lacks the one Python writes beside an original
    after packing, and looking there would be a look at the original.
    """
    yielded = set()
    for entry in entries:
        name = entry.rstrip("/")
        if name == "__pycache__":
            continue
        module, package = module_name(name), False
        if not module and entry.endswith("/") and "." not in name:
            module, package = name, is_package(name)
            if not package:
                continue
        if module and module != "__init__" and "." not in module:
            if module not in yielded:
                yielded.add(module)
                yield prefix + module, package
