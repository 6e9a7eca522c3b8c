"""Listings: a directory's entries as the finders see them, and what they hold.

Both kinds of serving (the staged copy of a bundle, the live copy) answer
lookups from listings, never from a stat per name: a directory's entries,
directories ending in ``/``, what is no regular file or directory marked
(:func:`listed_entry`). :func:`locate` decides from listings what
``FileFinder`` would find, so a name that is not there is answered without
the file system; :func:`listed_modules` lists modules as ``pkgutil`` does.
A bundled root (:class:`BundledRoot`) compares its copy's listings with
those the bundle recorded, to tell which of its packages the copy holds
whole.
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


class BundledRoot:
    """What activation knows of one bundled root."""

    def __init__(self, path, staged, listing, partial=None, owned=(), stdlib=False):
        from mpistage.runtime.roots import module_names

        self.path, self.staged, self.listing = path, staged, listing
        self.names = module_names(listing)
        self.partial, self.owned = dict(partial or {}), frozenset(owned)
        self.stdlib, self.unbundled_dists = stdlib, False
        self.found_names, self.shortness, self.inside = {}, {}, None

    def names_in(self, rel):
        """The names a lookup in directory *rel* of this root may find in the original.

        Empty for a directory the bundle holds whole; for one it holds in
        part, the names of the listing recorded when it was bundled (the
        staleness check keeps that true); ``None`` (ask the original every
        time) when no listing was recorded.
        """
        from mpistage.runtime.roots import module_names

        if rel not in self.partial:
            return frozenset()
        if rel not in self.found_names:
            found = self.partial[rel]
            self.found_names[rel] = (
                None if found is None else frozenset(module_names(found))
            )
        return self.found_names[rel]

    def transparent(self, rel):
        """Whether the source file *rel* keeps its original ``__file__``."""
        return rel.endswith(".py") and (self.stdlib or rel not in self.owned)

    def shows_original(self, rel):
        """Whether the modules in directory *rel* show their original paths.

        So does all of a top-level package whose copy lists less than its
        original anywhere in its tree (test directories left out,
        ``--exclude``, files a recorded run did not use), and the root
        itself unless its copy has all of it. A program that lists, walks,
        globs or opens what is beside a module there then finds what plain
        python finds; and a package's modules all lie below its directory,
        as code that finds its own frames by path expects (pandas' stack
        levels of warnings).
        """
        if self.inside is None:
            self.inside = held_in_part(self.partial)
        if not rel and self.short(""):
            return True
        top = rel.split("/", 1)[0]
        return any(self.short(found) for found in self.inside.get(top, ()))

    def short(self, rel):
        """Whether the copy of directory *rel* lacks an entry of the original's.

        Asked of the copy once (a node-local listing), against the listing
        recorded in the bundle; without one, assumed so.
        """
        if rel not in self.shortness:
            recorded = self.partial.get(rel) if rel else self.listing
            copy = None
            if self.staged is not None and recorded is not None:
                copy = local_listing(_os.path.join(self.staged, rel))
            if copy is None or copy is False:  # unknown, or no directory there
                self.shortness[rel] = True
            else:
                held = {entry_name(e) for e in copy}
                self.shortness[rel] = any(e.rstrip("/") not in held for e in recorded)
        return self.shortness[rel]

    def staged_path(self, path):
        """Where the original *path* below this root is read from now.

        The copy while the bundle is active; afterwards the original itself.
        """
        if self.staged is None or not path.startswith(self.path + _os.sep):
            return path
        return self.staged + path[len(self.path) :]

    def metadata_paths(self):
        """Where ``importlib.metadata`` looks for this root's distributions."""
        found = [self.staged] if self.staged else []
        return found + [self.path] if self.unbundled_dists else found


def held_in_part(partial):
    """Map each directory to the directories held in part at or below it.

    The root is ``""``. ``__pycache__`` is Python's own cache, which no
    listing records and no program looks into: it is left out.
    """
    inside = {}
    for found in partial:
        if "__pycache__" in found.split("/"):
            continue
        above = found
        while True:
            inside.setdefault(above, []).append(found)
            if not above:
                break
            above = _os.path.dirname(above)
    return inside
