"""Step 2 of the runner: rank 0 reads the bundle, once, sequentially.

No other rank opens the file: on a shared file system that single open and
streaming read replaces one open, stat and read per rank per module.
"""

import os as _os

from mpistage.errors import StageError


def read_bundle(path):
    """Return the whole bundle at *path* as a bytearray (rank 0 only)."""
    try:
        fd = _os.open(path, _os.O_RDONLY | getattr(_os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise StageError(f"cannot read bundle {path!r}: {exc.strerror}") from None
    try:
        return read_all(fd, _os.fstat(fd).st_size, path)
    finally:
        _os.close(fd)


def read_all(fd, size, path):
    """Read *size* bytes from *fd* into one buffer."""
    buf = bytearray(size)
    view, done = memoryview(buf), 0
    try:
        while done < size:
            n = _os.readv(fd, [view[done : done + (64 << 20)]])
            if n == 0:
                raise StageError(f"bundle {path!r} shrank while being read")
            done += n
    except OSError as exc:
        raise StageError(f"cannot read bundle {path!r}: {exc.strerror}") from None
    return buf
