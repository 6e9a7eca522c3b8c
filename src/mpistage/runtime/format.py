"""The bundle file format: one file, random access, a JSON manifest.

Layout (all integers little-endian)::

    header    64 bytes: magic b"MPISTAGE", format version (u32), reserved (u32),
              manifest offset (u64), manifest length (u64),
              SHA-256 of the manifest (32 bytes)
    data      member contents, concatenated in manifest order
    manifest  UTF-8 JSON, see docs/bundle-format.md

Readers need only the header and the manifest to find any member, so
``mpistage inspect`` reads a few kilobytes, and the runner can read the whole
file in one sequential pass. Writing is atomic: a temporary file in the same
directory, renamed over the target when complete.
"""

import hashlib as _hashlib
import json as _json
import os as _os
import struct as _struct
import sys as _sys

MAGIC = b"MPISTAGE"
FORMAT = 1
HEADER = _struct.Struct("<8sIIQQ32s")
HEADER_SIZE = 64
SUFFIX = ".mpistage"
_COPY = 1 << 20


def python_tag():
    """Describe the running Python: what a bundle must match to be used."""
    from importlib.machinery import EXTENSION_SUFFIXES

    return {
        "implementation": _sys.implementation.name,
        "version": "{}.{}".format(*_sys.version_info[:2]),
        "cache_tag": _sys.implementation.cache_tag,
        "ext_suffix": EXTENSION_SUFFIXES[0],
    }


def python_mismatch(manifest):
    """Return why *manifest* does not fit the running Python, or ``None``."""
    want, have = manifest.get("python", {}), python_tag()
    for key in ("implementation", "version", "ext_suffix"):
        if want.get(key) != have[key]:
            return (
                f"built for Python {want.get('version')!r} "
                f"({want.get('ext_suffix')!r}), this is Python {have['version']!r} "
                f"({have['ext_suffix']!r}); repack it with this Python"
            )
    return None


def parse_header(head, size, name):
    """Check the 64-byte header; return (manifest offset, length, digest)."""
    from mpistage.errors import StageError

    if len(head) < HEADER_SIZE:
        raise StageError(f"bundle {name!r} is truncated: {size} bytes")
    magic, fmt, _, offset, length, digest = HEADER.unpack_from(head)
    if magic != MAGIC:
        raise StageError(f"{name!r} is not an mpistage bundle: bad magic {magic!r}")
    if fmt != FORMAT:
        raise StageError(f"bundle {name!r} has format {fmt}, expected {FORMAT}")
    if offset + length != size:
        raise StageError(
            f"bundle {name!r} is truncated or padded: {size} bytes, "
            f"header says {offset + length}"
        )
    return offset, length, digest


def load_manifest(raw, digest, name):
    """Decode the manifest bytes *raw* after checking them against *digest*."""
    from mpistage.errors import StageError

    if _hashlib.sha256(raw).digest() != digest:
        raise StageError(f"bundle {name!r} is corrupt: manifest checksum mismatch")
    return _json.loads(bytes(raw))


def manifest_of(buf, name):
    """Validate an in-memory bundle *buf* and return its manifest."""
    offset, length, digest = parse_header(buf[:HEADER_SIZE], len(buf), name)
    return load_manifest(memoryview(buf)[offset : offset + length], digest, name)


def read_manifest(path):
    """Read only the header and manifest of the bundle at *path*."""
    with open(path, "rb") as f:
        size = _os.fstat(f.fileno()).st_size
        offset, length, digest = parse_header(f.read(HEADER_SIZE), size, path)
        f.seek(offset)
        return load_manifest(f.read(length), digest, path)


def original_path(manifest, member):
    """Return the absolute path *member* had when it was bundled."""
    return _os.path.join(manifest["roots"][member["root"]]["path"], member["rel"])


class BundleWriter:
    """Write a bundle atomically: members are streamed, the manifest comes last.

    Use as a context manager; on an exception the temporary file is removed
    and the target is left untouched.
    """

    def __init__(self, path):
        self.path = _os.path.abspath(path)
        import tempfile

        from mpistage.errors import StageError

        try:
            fd, self._tmp = tempfile.mkstemp(
                dir=_os.path.dirname(self.path), prefix=".mpistage-", suffix=".tmp"
            )
        except OSError as exc:
            raise StageError(f"cannot write bundle {path!r}: {exc.strerror}") from None
        self._file = _os.fdopen(fd, "wb")
        self._file.write(bytes(HEADER_SIZE))
        self.members = []

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is not None:
            self._file.close()
            _os.unlink(self._tmp)

    def add(self, root, rel, path, data=None):
        """Add the file, directory or symlink at *path* as *rel* under *root*.

        *data*, when given, replaces the file's content (a relocated script
        or binary); its mode and mtime still come from *path*.
        """
        st = _os.lstat(path)
        member = {"rel": rel, "root": root, "mode": st.st_mode & 0o7777}
        member["mtime_ns"] = st.st_mtime_ns
        if _os.path.islink(path):
            member.update(type="link", target=_os.readlink(path), size=0)
        elif _os.path.isdir(path):
            member.update(type="dir", size=0)
        elif data is not None:
            member.update(type="file", **self._write(data))
        else:
            member.update(type="file", **self._copy(path))
        self.members.append(member)

    def add_link(self, root, rel, target):
        """Add a symlink *rel* under *root* pointing to *target*."""
        member = {"rel": rel, "root": root, "mode": 0o777, "mtime_ns": 0}
        self.members.append(dict(member, type="link", target=target, size=0))

    def _write(self, data):
        digest = _hashlib.sha256(data).hexdigest()
        offset = self._file.tell()
        self._file.write(data)
        return {"offset": offset, "size": len(data), "sha256": digest}

    def _copy(self, path):
        offset, digest, size = self._file.tell(), _hashlib.sha256(), 0
        with open(path, "rb") as src:
            while chunk := src.read(_COPY):
                digest.update(chunk)
                self._file.write(chunk)
                size += len(chunk)
        return {"offset": offset, "size": size, "sha256": digest.hexdigest()}

    def finish(self, manifest):
        """Append *manifest* (plus the members), fill the header, rename."""
        manifest = dict(manifest, format=FORMAT, members=self.members)
        raw = _json.dumps(manifest, separators=(",", ":")).encode()
        offset = self._file.tell()
        self._file.write(raw)
        self._file.seek(0)
        digest = _hashlib.sha256(raw).digest()
        self._file.write(HEADER.pack(MAGIC, FORMAT, 0, offset, len(raw), digest))
        self._file.flush()
        _os.fsync(self._file.fileno())
        self._file.close()
        _os.chmod(self._tmp, 0o644)
        _os.replace(self._tmp, self.path)
        return manifest
