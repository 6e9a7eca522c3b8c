"""Which libraries a C extension needs from beside itself (``$ORIGIN``).

A wheel's extension finds the libraries auditwheel grafted into it
(``numpy.libs/``, ``scipy.libs/``) through a ``DT_RUNPATH`` (or older
``DT_RPATH``) such as ``$ORIGIN/../numpy.libs``. When the live reader
serves an extension, those libraries must be in the node's copy at the same
relative place, or the dynamic loader would not find them there.

This reads the ``DT_NEEDED`` names and the run paths from the ELF bytes the
reader has in memory: the ELF header, the program headers, the ``PT_DYNAMIC``
segment and its string table, with :mod:`struct` alone (the runtime may not
use pyelftools). Only ``$ORIGIN`` entries are returned: the loader searches
every other directory in a rank as in plain python, and the same way for
the copy as for the original. Reading exactly what an extension needs, and
not its package's whole ``*.libs`` directory, keeps the reader's work to
what plain python would load, and also covers libraries elsewhere in the
tree (``$ORIGIN/../../other/lib``).
"""

import struct as _struct

PT_LOAD, PT_DYNAMIC = 1, 2
DT_NULL, DT_NEEDED, DT_STRTAB, DT_RPATH, DT_RUNPATH = 0, 1, 5, 15, 29
ORIGINS = ("$ORIGIN", "${ORIGIN}")


class Layout:
    """The struct formats of one ELF class (32/64-bit) and byte order."""

    def __init__(self, data):
        if data[:4] != b"\x7fELF" or data[4] not in (1, 2) or data[5] not in (1, 2):
            raise ValueError("not an ELF file")
        end = "<" if data[5] == 1 else ">"
        wide = data[4] == 2
        self.header = _struct.Struct(
            end + ("16xHHIQQQIHHHHHH" if wide else "16xHHIIIIIHHHHHH")
        )
        self.phdr = _struct.Struct(end + ("IIQQQQQQ" if wide else "IIIIIIII"))
        self.dyn = _struct.Struct(end + ("qQ" if wide else "iI"))
        self.wide = wide


def program_headers(data, layout):
    """Yield (type, offset, vaddr, filesz) of each program header."""
    fields = layout.header.unpack_from(data)
    phoff, phentsize, phnum = fields[4], fields[8], fields[9]
    for index in range(phnum):
        raw = layout.phdr.unpack_from(data, phoff + index * phentsize)
        if layout.wide:
            kind, _flags, offset, vaddr, _paddr, filesz = raw[:6]
        else:
            kind, offset, vaddr, _paddr, filesz = raw[:5]
        yield kind, offset, vaddr, filesz


def file_offset(segments, address):
    """Map a virtual *address* to its file offset through the PT_LOAD segments."""
    for offset, vaddr, filesz in segments:
        if vaddr <= address < vaddr + filesz:
            return address - vaddr + offset
    raise ValueError(f"address {address:#x} is in no loaded segment")


def dynamic_entries(data):
    """Return the ``(tag, value)`` pairs of the ELF *data*'s dynamic section."""
    layout = Layout(data)
    headers = list(program_headers(data, layout))
    segments = [(o, v, s) for kind, o, v, s in headers if kind == PT_LOAD]
    dynamic = [(o, s) for kind, o, _v, s in headers if kind == PT_DYNAMIC]
    if not dynamic:
        return [], segments
    offset, size = dynamic[0]
    entries = []
    for at in range(offset, offset + size, layout.dyn.size):
        tag, value = layout.dyn.unpack_from(data, at)
        if tag == DT_NULL:
            break
        entries.append((tag, value))
    return entries, segments


def c_string(data, at):
    """Return the NUL-terminated string at *at* in *data*."""
    end = data.index(b"\0", at)
    return bytes(data[at:end]).decode("utf-8", "surrogateescape")


def needs(data):
    """Return (needed names, run path entries) of the ELF *data*.

    The run path is ``DT_RUNPATH``, or ``DT_RPATH`` when there is none (the
    loader ignores ``DT_RPATH`` then). Anything that is not a well-formed
    ELF file needs nothing.
    """
    try:
        entries, segments = dynamic_entries(data)
        strtab = [v for t, v in entries if t == DT_STRTAB]
        if not strtab:
            return [], []
        base = file_offset(segments, strtab[0])
        names = [c_string(data, base + v) for t, v in entries if t == DT_NEEDED]
        runpath = [c_string(data, base + v) for t, v in entries if t == DT_RUNPATH]
        rpath = [c_string(data, base + v) for t, v in entries if t == DT_RPATH]
    except (ValueError, IndexError, _struct.error):
        return [], []
    paths = [p for text in (runpath or rpath) for p in text.split(":") if p]
    return names, paths


def origin_dirs(data, folder):
    """Return (needed names, ``$ORIGIN`` directories) of an object in *folder*."""
    import os

    names, paths = needs(data)
    dirs = []
    for path in paths:
        if any(path.startswith(o) for o in ORIGINS):
            rest = path.split("}", 1)[1] if path.startswith("${") else path[7:]
            dirs.append(os.path.normpath(folder + rest))
    return [n for n in names if "/" not in n], dirs
