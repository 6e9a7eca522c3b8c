"""What an ELF shared object needs, read with the standard library alone.

The first rank of a node copies the MPI library with what its ``$ORIGIN``
run path names (:mod:`mpistage.node.copy`), and the live reader sends an
extension with the libraries it needs from beside itself
(:mod:`mpistage.runtime.live.reader`); this reads the dynamic section that
says so. ``pyelftools`` does this for ``pack --env``, but what runs in every
rank stays standard library only.
"""

import os as _os

DT_NEEDED, DT_STRTAB, DT_SONAME, DT_RPATH, DT_RUNPATH = 1, 5, 14, 15, 29
PT_LOAD, PT_DYNAMIC = 1, 2
ORIGINS = ("$ORIGIN", "${ORIGIN}")


def shared_object(name):
    """Whether the file *name* is named as a shared object is (``.so``, ``.so.N``)."""
    return name.endswith(".so") or ".so." in name


def elf_dynamic(data):
    """Return (needed, run path, rpath, soname) of an ELF object, or None.

    Only well-formed 64-bit little-endian objects are read (``None``
    otherwise); an object without a dynamic section needs nothing.
    """
    try:
        return read_dynamic(data)
    except (ValueError, IndexError):
        return None


def read_dynamic(data):
    """:func:`elf_dynamic`, raising ``ValueError`` or ``IndexError`` if malformed."""
    if data[:4] != b"\x7fELF" or data[4:6] != b"\x02\x01":
        return None

    def number(at, size):
        return int.from_bytes(data[at : at + size], "little")

    loads, dynamic = [], None
    phoff, size, count = number(0x20, 8), number(0x36, 2), number(0x38, 2)
    for at in range(phoff, phoff + size * count, size):
        kind = number(at, 4)
        offset, vaddr = number(at + 8, 8), number(at + 16, 8)
        filesz = number(at + 32, 8)
        if kind == PT_LOAD:
            loads.append((vaddr, offset, filesz))
        elif kind == PT_DYNAMIC:
            dynamic = (offset, filesz)
    if dynamic is None:
        return (), None, None, None
    entries = []
    for at in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, value = number(at, 8), number(at + 8, 8)
        if tag == 0:
            break
        entries.append((tag, value))
    table = file_offset(loads, dict(entries).get(DT_STRTAB))
    if table is None:
        return None

    def string(offset):
        start = table + offset
        return data[start : data.index(b"\0", start)].decode(errors="replace")

    named = (DT_SONAME, DT_RPATH, DT_RUNPATH)
    values = {tag: string(v) for tag, v in entries if tag in named}
    needed = tuple(string(v) for tag, v in entries if tag == DT_NEEDED)
    return needed, values.get(DT_RUNPATH), values.get(DT_RPATH), values.get(DT_SONAME)


def file_offset(loads, address):
    """Return the file offset of the virtual *address*, from the PT_LOAD segments."""
    if address is None:
        return None
    for vaddr, offset, filesz in loads:
        if vaddr <= address < vaddr + filesz:
            return address - vaddr + offset
    return None


def expand_origin(entry, origin):
    """Return the run path *entry* with its leading ``$ORIGIN`` made *origin*.

    ``None`` for an entry that does not start with ``$ORIGIN``.
    """
    if not entry.startswith(ORIGINS):
        return None
    rest = entry.split("}", 1)[1] if entry.startswith("${") else entry[7:]
    return _os.path.normpath(origin + rest)


def origin_dirs(runpath, origin):
    """Return the ``$ORIGIN`` directories of the run path of an object in *origin*.

    Absolute entries are left out: the loader searches them alike for an
    original and its copy. Raises ``ValueError`` for an entry a copy could
    not match (``$LIB``, ``$PLATFORM``, relative to the working directory).
    """
    found = []
    for entry in runpath.split(":"):
        if not entry:
            continue
        if "$" in entry.replace("${ORIGIN}", "").replace("$ORIGIN", ""):
            raise ValueError(f"its run path {entry!r} names $LIB or $PLATFORM")
        folder = expand_origin(entry, origin)
        if folder is not None:
            found.append(folder)
        elif not entry.startswith("/"):
            raise ValueError(f"its run path {entry!r} is relative to the cwd")
    return found


def mapped_names():
    """Return the file names of what is mapped into this process (``/proc``)."""
    found = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "/" in line:
                    found.add(line.rsplit("/", 1)[1].strip())
    except OSError:
        pass
    return found
