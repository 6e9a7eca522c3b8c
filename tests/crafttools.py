"""Bundles crafted byte by byte from the documented format (docs/bundle-format.md).

Digests are valid, so that only what a test means to be hostile is hostile.
"""

import hashlib
import json
from pathlib import Path

from mpistage.runtime import bundlefile


def craft(path, members, roots=None, kind="packages", raw=None, edit=None):
    """Write a bundle of *members* (dicts; file data under "data") to *path*.

    *edit*, if given, changes the manifest dict before it is encoded (to make
    offsets overlap, say); the digests stay valid.
    """
    roots = roots or [{"path": str(Path(path).parent / "site"), "listing": []}]
    data, listed = bytearray(), []
    for member in members:
        member = {"root": 0, "mode": 0o644, "mtime_ns": 0, **member}
        if member["type"] == "file":
            content = member.pop("data", b"x")
            offset = bundlefile.HEADER_SIZE + len(data)
            digest = hashlib.sha256(content).hexdigest()
            member.update(offset=offset, size=len(content), sha256=digest)
            data += content
        listed.append(member)
    manifest = {
        "format": 1,
        "kind": kind,
        "created_by": "test",
        "created": "now",
        "python": bundlefile.python_tag(),
        "packages": [],
        "roots": roots,
        "members": listed,
    }
    if edit is not None:
        edit(manifest)
    raw = json.dumps(manifest).encode() if raw is None else raw
    offset = bundlefile.HEADER_SIZE + len(data)
    digest = hashlib.sha256(raw).digest()
    header = bundlefile.HEADER.pack(
        bundlefile.MAGIC, bundlefile.FORMAT, 0, offset, len(raw), digest
    )
    Path(path).write_bytes(header.ljust(bundlefile.HEADER_SIZE, b"\0") + data + raw)
    return Path(path)
