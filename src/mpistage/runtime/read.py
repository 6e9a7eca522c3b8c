"""Step 2: rank 0 reads the bundle, once, sequentially, and checks it.

No other rank opens the file: on a shared file system that single open and
streaming read replaces one open, stat and read per rank per module. The
check happens here, on the one process that read the bytes from the file
system: the header, the manifest's digest and shape, the bundle's kind and
Python, and every member's SHA-256. MPI then delivers the bytes intact, so
the node leaders need not hash them again.
"""

import os as _os

from mpistage import StageError

READ_SIZE = 64 << 20


def open_regular(path, what="bundle"):
    """Open *path* for reading; refuse anything but a regular file.

    The open does not block (a FIFO nobody writes to would hang it), and
    the check is made on the open descriptor, so nothing can be swapped in
    between. Returns the descriptor.
    """
    import stat

    flags = _os.O_RDONLY | _os.O_CLOEXEC | _os.O_NONBLOCK
    try:
        fd = _os.open(path, flags)
    except OSError as exc:
        raise StageError(f"cannot read {what} {path!r}: {exc.strerror}") from None
    if not stat.S_ISREG(_os.fstat(fd).st_mode):
        _os.close(fd)
        raise StageError(f"cannot read {what} {path!r}: not a regular file")
    return fd


def read_bundle(path, fd=None):
    """Return the whole bundle at *path* (or open as *fd*) as a bytearray (rank 0)."""
    if fd is not None:
        return read_sized(fd, path)
    fd = open_regular(path)
    try:
        return read_sized(fd, path)
    finally:
        _os.close(fd)


def read_sized(fd, path):
    """Check the header first, then read the whole bundle.

    A file that is no bundle (a sparse terabyte of zeros, say) is refused
    by its first 64 bytes, before a buffer of its size is asked for.
    """
    from mpistage.runtime.bundlefile import HEADER_SIZE, parse_header

    size = _os.fstat(fd).st_size
    try:
        head = _os.pread(fd, HEADER_SIZE, 0)
    except OSError as exc:
        raise StageError(f"cannot read bundle {path!r}: {exc.strerror}") from None
    parse_header(head, size, path)
    return read_all(fd, size, path)


def read_all(fd, size, path):
    """Read *size* bytes from *fd* into one buffer."""
    try:
        buf = bytearray(size)
    except MemoryError:
        raise StageError(
            f"bundle {path!r} ({size} bytes) does not fit in memory"
        ) from None
    view, done = memoryview(buf), 0
    try:
        while done < size:
            n = _os.readv(fd, [view[done : done + READ_SIZE]])
            if n == 0:
                raise StageError(f"bundle {path!r} shrank while being read")
            done += n
    except OSError as exc:
        raise StageError(f"cannot read bundle {path!r}: {exc.strerror}") from None
    return buf


def read_checked(path, kind="packages", fd=None):
    """Read the bundle *path* (or open as *fd*); return (bytes, manifest), checked."""
    from mpistage.runtime.bundlefile import manifest_of, python_mismatch

    buf = read_bundle(path, fd)
    manifest = manifest_of(buf, path)
    check_kind(manifest, kind, path)
    if kind == "packages":
        mismatch = python_mismatch(manifest)
        if mismatch:
            raise StageError(f"bundle {path!r} is {mismatch}")
    verify(buf, manifest, path)
    return buf, manifest


def check_kind(manifest, kind, path):
    """Refuse an environment bundle for the runner, and the reverse."""
    have = manifest.get("kind", "packages")
    if have == kind:
        return
    if have == "env":
        raise StageError(
            f"{path!r} is an environment bundle: stage it with "
            "`mpistage stage` and run DIR/bin/python"
        )
    raise StageError(
        f"{path!r} is not an environment bundle: make one with "
        "`mpistage pack --env -o env.mpistage`"
    )


def verify(buf, manifest, path):
    """Check every file member's SHA-256 against the manifest."""
    from mpistage.runtime.bundlefile import sha256

    view = memoryview(buf)
    for member in manifest["members"]:
        if member["type"] != "file":
            continue
        data = view[member["offset"] : member["offset"] + member["size"]]
        if sha256(data).hexdigest() != member.get("sha256"):
            raise StageError(
                f"bundle {path!r} is corrupt: checksum mismatch in {member['rel']!r}"
            )


def read_manifest(path):
    """Read only the header and manifest of the bundle at *path*, checked."""
    from mpistage.runtime.bundlefile import (
        HEADER_SIZE,
        check,
        load_manifest,
        parse_header,
    )

    fd = open_regular(path, "bundle")
    try:
        with open(fd, "rb", closefd=False) as f:
            size = f.seek(0, 2)
            f.seek(0)
            offset, length, digest = parse_header(f.read(HEADER_SIZE), size, path)
            f.seek(offset)
            raw = f.read(length)
    except OSError as exc:
        raise StageError(f"cannot read bundle {path!r}: {exc.strerror}") from None
    finally:
        _os.close(fd)
    return check(load_manifest(raw, digest, path), offset, path)
