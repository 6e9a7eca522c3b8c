"""Where an array's bytes are in its file: whole file, ``.npy``, ``.npz`` member, raw.

The first reader of :mod:`mpistage.data` runs one of these on the open file
and broadcasts the :class:`DataSpan`; no other rank looks at the file's
header. Headers are untrusted: any problem in one is one clear error.
"""

import os as _os

from mpistage import StageError

ZIP_LOCAL_MAGIC = b"PK\x03\x04"  # a zip member's local file header starts so
ZIP_LOCAL_SIZE = 30  # bytes of that header before the name and the extra field
ZIP_LENGTHS = slice(26, 30)  # where it keeps the name's and extra field's lengths


class DataSpan:
    """Where the data is in the file, and what array it makes (if any)."""

    def __init__(self, start, length, size, meta=None):
        self.start, self.length, self.size, self.meta = start, length, size, meta
        self.identity = None


def whole(path, fd, size):
    """The whole file, as bytes."""
    return DataSpan(0, size, size)


def locator(member, dtype, shape, order, offset):
    """Return the function that finds the array in the file (on the first reader)."""

    def locate(path, fd, size):
        if dtype is not None:
            return raw(path, size, dtype, shape, order, offset)
        if shape is not None:
            raise StageError("shape= needs dtype= (a raw file)")
        if member is not None or path.endswith(".npz"):
            return npz(path, fd, size, member)
        return npy(path, fd, 0, size, size)

    return locate


def raw(path, size, dtype, shape, order, offset):
    """A raw file of *dtype* items from byte *offset* on."""
    import math

    import numpy

    try:
        dtype = numpy.dtype(dtype)
    except TypeError as exc:
        raise StageError(f"dtype={dtype!r}: {one_line(exc)}") from None
    check_items(f"dtype={str(dtype)!r}", dtype)
    if order not in ("C", "F"):
        raise StageError(f"order={order!r}: use 'C' or 'F'")
    if not 0 <= offset <= size:
        raise StageError(f"offset={offset!r} is outside {path!r} ({size} bytes)")
    have = size - offset
    if shape is None:
        shape = (have // max(1, dtype.itemsize),)
    shape = (shape,) if isinstance(shape, int) else tuple(map(int, shape))
    need = math.prod(shape) * dtype.itemsize
    if need != have:
        raise StageError(
            f"raw file {path!r} has {have} bytes after offset {offset}; "
            f"shape {shape} of {dtype} needs {need}"
        )
    return DataSpan(offset, need, size, (dtype, shape, order == "F"))


def npy(path, fd, base, end, size):
    """The .npy stored in bytes [base, end) of the file."""
    import math

    from numpy.lib import format as fmt

    with open(fd, "rb", closefd=False) as f:
        f.seek(base)
        try:
            version = fmt.read_magic(f)
            shape, fortran, dtype = header_reader(fmt, version)(f)
        except Exception as exc:  # noqa: BLE001  (numpy raises several kinds)
            raise StageError(f"{path!r} is no .npy file: {one_line(exc)}") from None
        start = f.tell()
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape):
        raise StageError(f"{path!r} is no .npy file: bad shape {shape!r}")
    if dtype.hasobject:
        raise StageError(
            f"{path!r} holds Python objects (dtype {dtype}), which only "
            "numpy.load(allow_pickle=True) reads"
        )
    check_items(f"{path!r}", dtype)
    length = math.prod(shape) * dtype.itemsize
    if start + length > end:
        raise StageError(
            f"{path!r} is truncated: its array needs {length} bytes after the "
            f"header, {max(0, end - start)} are there"
        )
    return DataSpan(start, length, size, (dtype, shape, fortran))


def check_items(what, dtype):
    """Refuse a dtype whose items have no bytes: no buffer can hold them."""
    if dtype.itemsize == 0:
        raise StageError(f"{what}: items of dtype {dtype} have no bytes to share")


def header_reader(fmt, version):
    """Return the numpy function that reads a header of format *version*."""
    public = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}
    if version in public:
        return public[version]
    return lambda f: fmt._read_array_header(f, version)


def npz(path, fd, size, member):
    """The .npy of a stored (uncompressed) member of a .npz file."""
    import struct
    import zipfile

    with open(fd, "rb", closefd=False) as f:
        try:
            with zipfile.ZipFile(f) as archive:
                info = member_info(path, archive, member)
        except zipfile.BadZipFile as exc:
            raise StageError(f"{path!r} is no .npz file: {exc}") from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise StageError(
            f"member {member!r} of {path!r} is compressed: mpistage.data reads "
            "stored members only (numpy.savez, not numpy.savez_compressed)"
        )
    local = _os.pread(fd, ZIP_LOCAL_SIZE, info.header_offset)
    if len(local) != ZIP_LOCAL_SIZE or not local.startswith(ZIP_LOCAL_MAGIC):
        raise StageError(f"{path!r} is no .npz file: bad header of {member!r}")
    names, extra = struct.unpack("<HH", local[ZIP_LENGTHS])
    base = info.header_offset + ZIP_LOCAL_SIZE + names + extra
    label = f"{path}[{member}]"
    return npy(label, fd, base, base + info.file_size, size)


def member_info(path, archive, member):
    """Return the ZipInfo of *member* (with or without ``.npy``)."""
    names = [n.removesuffix(".npy") for n in archive.namelist()]
    if member is None:
        raise StageError(f"{path!r} holds {names!r}: choose one with member=")
    for name in (member, f"{member}.npy"):
        try:
            return archive.getinfo(name)
        except KeyError:
            pass
    raise StageError(f"{path!r} has no member {member!r}; it holds {names!r}")


def one_line(exc):
    """Return the message of *exc* on one line."""
    return " ".join(str(exc).split())
