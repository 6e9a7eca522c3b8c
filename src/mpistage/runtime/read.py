"""Step 2: rank 0 reads the bundle, once, sequentially, piece by piece, and checks it.

No other rank opens the file: on a shared file system that single open and
streaming read replaces one open, stat and read per rank per module. The
check happens here, on the one process that read the bytes from the file
system. First the header and the manifest, which the header places at a
known offset (:func:`open_bundle`): the manifest's digest and shape, the
bundle's kind and Python. Those are all the leaders need to make the
node's copy's files. Then the data, piece by piece as the broadcast sends
it (:meth:`Bundle.fill`), each piece hashed as it is read
(:class:`Checksums`), so that every member's SHA-256 is checked in the same
one pass over the bytes. MPI then delivers the bytes intact, so the node
leaders need not hash them again; nothing is run from a copy before rank
0's verdict is agreed.
"""

import os as _os

from mpistage import StageError

READ_SIZE = 64 << 20  # bytes one read asks for at most
CORRUPT = "is corrupt"  # in the message of a bundle whose bytes are not its own


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


class Bundle:
    """Rank 0's open bundle: its checked manifest, and its data read on demand.

    *base* is where the bundle starts in the file (a self-extracting one's
    bytes follow a script); offsets are the bundle's own. :attr:`span` is
    the (start, end) of the file members' data, what the broadcast sends.
    """

    def __init__(self, path, fd, base, size, manifest, digest):
        self.path, self.fd, self.base, self.size = path, fd, base, size
        self.manifest, self.digest = manifest, digest
        files = [m for m in manifest["members"] if m["type"] == "file"]
        start = files[0]["offset"] if files else 0
        self.span = (start, max([m["offset"] + m["size"] for m in files] or [0]))

    def fill(self, offset, view):
        """Read the bundle's bytes at *offset* into all of *view*."""
        view, done = memoryview(view).cast("B"), 0
        try:
            while done < len(view):
                chunk = view[done : done + READ_SIZE]
                n = _os.preadv(self.fd, [chunk], self.base + offset + done)
                if n == 0:
                    raise StageError(f"bundle {self.path!r} shrank while being read")
                done += n
        except OSError as exc:
            raise StageError(
                f"cannot read bundle {self.path!r}: {exc.strerror}"
            ) from None

    def close(self):
        """Close the file (it was opened here, or handed over)."""
        if self.fd is not None:
            _os.close(self.fd)
            self.fd = None


def open_bundle(path, kind="packages", fd=None, base=0):
    """Open the bundle *path* (or take *fd*); return its :class:`Bundle`, checked.

    Only the header and the manifest are read now, the header first: a
    file that is no bundle (a sparse terabyte of zeros, say) is refused by
    its first 64 bytes. The descriptor belongs to the result, or is closed
    on an error.
    """
    from mpistage.runtime.bundlefile import python_mismatch

    fd = open_regular(path) if fd is None else fd
    try:
        manifest, digest, size = read_head(fd, base, path)
        check_kind(manifest, kind, path)
        if kind == "packages":
            mismatch = python_mismatch(manifest)
            if mismatch:
                raise StageError(f"bundle {path!r} is {mismatch}")
    except BaseException:
        _os.close(fd)
        raise
    return Bundle(path, fd, base, size, manifest, digest)


def read_head(fd, base, path):
    """Read and check the header and the manifest; return (manifest, digest, size).

    *digest* is the manifest's SHA-256 (hex) that the header holds: the
    bundle's identity. *size* is the bundle's, from *base* on.
    """
    from mpistage.runtime.bundlefile import (
        HEADER_SIZE,
        check,
        load_manifest,
        parse_header,
    )

    try:
        size = _os.fstat(fd).st_size - base
        head = exactly(fd, base, min(HEADER_SIZE, max(0, size)), path)
        offset, length, digest = parse_header(head, size, path)
        raw = exactly(fd, base + offset, length, path)
    except OSError as exc:
        raise StageError(f"cannot read bundle {path!r}: {exc.strerror}") from None
    manifest = check(load_manifest(raw, digest, path), offset, path)
    return manifest, digest.hex(), size


def exactly(fd, offset, length, path):
    """Return the *length* bytes at *offset* of *fd*; refuse a file cut short."""
    buf, done = bytearray(length), 0
    view = memoryview(buf)
    while done < length:
        n = _os.preadv(fd, [view[done : done + READ_SIZE]], offset + done)
        if n == 0:
            raise StageError(f"bundle {path!r} shrank while being read")
        done += n
    return buf


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


class Checksums:
    """File members' SHA-256s, computed from the pieces as they pass.

    Pieces come in order (:meth:`update`); a member's hash is compared as
    soon as its last byte has passed, so a mismatch stops the broadcast
    early. :meth:`verdict` at the end checks that every member was seen.
    With *index* and *count*, the members are shared out among *count*
    checkers (the node leaders, each of which sees every byte) by
    :func:`shares`, and this one checks share *index* only: the hashing,
    the slowest part of the one pass, is spread over the nodes.
    """

    def __init__(self, manifest, path, index=0, count=1):
        self.path = path
        files = [m for m in manifest["members"] if m["type"] == "file"]
        owners = shares([m["size"] for m in files], count)
        mine = [owner == index for owner in owners]
        self.files = [m for m, keep in zip(files, mine, strict=True) if keep]
        self.next, self.hash = 0, None

    def update(self, start, view):
        """Hash the piece *view*, the bundle's bytes from *start* on."""
        from mpistage.runtime.bundlefile import sha256

        end = start + len(view)
        while self.next < len(self.files):
            member = self.files[self.next]
            offset, stop = member["offset"], member["offset"] + member["size"]
            if offset > end or (offset == end and stop > end):
                return
            self.hash = self.hash or sha256()
            lo, hi = max(offset, start), min(stop, end)
            if hi > lo:
                self.hash.update(view[lo - start : hi - start])
            if stop > end:
                return
            self.compare(member)

    def compare(self, member):
        """The member's last byte has passed: raise unless its hash is its own."""
        digest, self.hash = self.hash.hexdigest(), None
        self.next += 1
        if digest != member.get("sha256"):
            raise StageError(
                f"bundle {self.path!r} {CORRUPT}: checksum mismatch in "
                f"{member['rel']!r}"
            )

    def verdict(self, end):
        """After the last piece (the data ends at *end*): raise unless all matched."""
        self.update(end, b"")
        if self.next != len(self.files):
            raise StageError(f"bundle {self.path!r} shrank while being read")


SHARE_FLOOR = 1 << 16  # bytes a member counts for at least, when sharing out
READ_WEIGHT = 0.25  # reading a byte, against hashing it: what rank 0 has to do


def shares(sizes, count):
    """Return which of *count* checkers hashes each member of *sizes* bytes.

    The largest first, each to the checker with the least work so far;
    checker 0 (rank 0) starts with the reading of every byte, so it takes
    less hashing. Every leader computes the same from the same manifest.
    """
    loads, owners = [0.0] * count, [0] * len(sizes)
    loads[0] = READ_WEIGHT * sum(sizes) if count > 1 else 0.0
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        least = loads.index(min(loads))
        owners[i] = least
        loads[least] += max(sizes[i], SHARE_FLOOR)
    return owners


def read_manifest(path):
    """Read only the header and manifest of the bundle at *path*, checked."""
    fd = open_regular(path, "bundle")
    try:
        return read_head(fd, 0, path)[0]
    finally:
        _os.close(fd)
