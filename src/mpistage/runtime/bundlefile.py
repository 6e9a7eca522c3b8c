"""The bundle file format, read side: header, manifest, and its checks.

Layout (all integers little-endian)::

    header    64 bytes: magic b"MPISTAGE", format version (u32), reserved (u32),
              manifest offset (u64), manifest length (u64),
              SHA-256 of the manifest (32 bytes)
    data      member contents, concatenated in manifest order
    manifest  UTF-8 JSON, see docs/bundle-format.md

A bundle is untrusted input. :func:`check` refuses a manifest whose shape is
wrong before any rank acts on it, so extraction may rely on its shape:

- a missing key, a root index out of range, an unknown member type;
- a value nested deeper than :data:`MAX_NESTING` (it could not be sent);
- a path that is absolute, climbs with ``..``, is deeper than
  :data:`MAX_DEPTH` components, or starts with :data:`RESERVED` (the names
  of mpistage's own files in a node's place);
- a ``dest`` in a bundle whose kind does not place roots (only environment
  bundles do);
- data outside the data section, or ranges that overlap or are out of
  manifest order (a small bundle could otherwise fill a whole device);
- a link that resolves, through the bundle's other links, to a place
  outside its root: later writers into the tree (Python's bytecode) follow
  links.

The writer is :mod:`mpistage.bundle.writer`.
"""

import struct as _struct
import sys as _sys

from mpistage import StageError

MAGIC = b"MPISTAGE"
FORMAT = 1
HEADER = _struct.Struct("<8sIIQQ32s")
HEADER_SIZE = 64
SUFFIX = ".mpistage"
KINDS = ("packages", "env")
MEMBER_TYPES = ("file", "dir", "link")
MAX_DEPTH = 128  # path components of a member below the node's place
MAX_NESTING = 16  # levels of lists and objects in the manifest
MAX_HOPS = 40  # links followed while resolving one, as Linux's limit
RESERVED = ".mpistage"  # top-level names of mpistage's own files


def python_tag():
    """Describe the running Python: what a bundle must match to be used."""
    from importlib.machinery import EXTENSION_SUFFIXES

    return {
        "implementation": _sys.implementation.name,
        "version": "{}.{}".format(*_sys.version_info[:2]),
        "cache_tag": _sys.implementation.cache_tag,
        "ext_suffix": EXTENSION_SUFFIXES[0],
    }


def python_mismatch(manifest, have=None):
    """Return why *manifest* does not fit the Python *have* (default: this one)."""
    want, have = manifest.get("python", {}), have or python_tag()
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
    if len(head) < HEADER_SIZE:
        raise StageError(f"bundle {name!r} is truncated: {size} bytes")
    magic, fmt, _, offset, length, digest = HEADER.unpack_from(head)
    if magic != MAGIC:
        raise StageError(f"{name!r} is not an mpistage bundle: bad magic {magic!r}")
    if fmt != FORMAT:
        raise StageError(f"bundle {name!r} has format {fmt}, expected {FORMAT}")
    if offset < HEADER_SIZE or offset + length != size:
        raise StageError(
            f"bundle {name!r} is truncated or padded: {size} bytes, "
            f"header says {offset + length}"
        )
    return offset, length, digest


def sha256(data=b""):
    """Return a SHA-256 hash object: OpenSSL's directly, else ``hashlib``'s.

    Rank 0 needs only SHA-256; ``_hashlib`` alone spares it ``hashlib`` and
    the modules it loads, some fifty operations on a shared file system.
    Both are mpistage's own copies (:func:`mpistage.own_module`): the
    program's ``sys.modules`` stays as plain python would have it.
    """
    from mpistage import own_module

    try:
        return own_module("_hashlib").openssl_sha256(data)
    except ImportError:
        return own_module("hashlib").sha256(data)


def load_manifest(raw, digest, name):
    """Decode the manifest bytes *raw* after checking them against *digest*."""
    from mpistage import lend, own_module

    json = own_module("json")
    if sha256(raw).digest() != digest:
        raise StageError(f"bundle {name!r} is corrupt: manifest checksum mismatch")
    try:
        with lend("json"):
            manifest = json.loads(bytes(raw))
    except ValueError as exc:
        raise StageError(f"bundle {name!r} is malformed: manifest: {exc}") from None
    except RecursionError:
        raise StageError(
            f"bundle {name!r} is malformed: manifest is nested too deeply"
        ) from None
    return manifest


def manifest_of(buf, name):
    """Validate an in-memory bundle *buf*; return its checked manifest."""
    offset, length, digest = parse_header(buf[:HEADER_SIZE], len(buf), name)
    raw = memoryview(buf)[offset : offset + length]
    return check(load_manifest(raw, digest, name), offset, name)


def original_path(manifest, member):
    """Return the absolute path *member* had when it was bundled."""
    return manifest["roots"][member["root"]]["path"] + "/" + member["rel"]


# -- the shape of a manifest ---------------------------------------------------


def check(manifest, data_end, name):
    """Return *manifest* if its shape is sound, else raise one clear error.

    *data_end* is where the data section ends (the manifest offset).
    """
    where = "manifest"
    try:
        expect(nesting(manifest) <= MAX_NESTING, "is nested too deeply")
        expect(isinstance(manifest, dict), "is not an object")
        kind = manifest.get("kind", "packages")
        expect(kind in KINDS, "has an unknown kind")
        expect(isinstance(manifest.get("python"), dict), "has no python tag")
        roots = manifest.get("roots")
        expect(isinstance(roots, list), "has no roots list")
        for index, root in enumerate(roots):
            where = f"root {index}"
            check_root(root, kind)
        where = "manifest"
        check_env(manifest, kind)
        members = manifest.get("members")
        expect(isinstance(members, list), "has no members list")
        bases, end = [base_of(root, i) for i, root in enumerate(roots)], None
        for index, member in enumerate(members):
            where = f"member {index}"
            check_member(member, len(roots), data_end)
            check_place(member, bases)
            end = check_range(member, end)
        where = "manifest"
        check_links(members, bases, kind)
    except ValueError as exc:
        raise StageError(f"bundle {name!r} is malformed: {where} {exc}") from None
    return manifest


def expect(condition, problem):
    """Raise ``ValueError(problem)`` unless *condition* holds."""
    if not condition:
        raise ValueError(problem)


def nesting(value):
    """Return how many levels of lists and dicts *value* has (no recursion)."""
    deepest, level = 0, [(value, 1)]
    while level:
        item, depth = level.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            if depth <= MAX_NESTING:
                level += [(sub, depth + 1) for sub in item]
    return deepest


def check_root(root, kind):
    """Check one root entry: an absolute path, a destination, a listing."""
    expect(isinstance(root, dict), "is not an object")
    path = root.get("path")
    expect(isinstance(path, str) and path.startswith("/"), "has no absolute path")
    expect("\0" not in path, "has a NUL in its path")
    dest = root.get("dest")
    if dest is not None:
        expect(kind == "env", f"has a dest, which a {kind} bundle may not have")
        expect(
            isinstance(dest, str) and (dest == "" or safe_rel(dest)), "has a bad dest"
        )
    check_listing(root.get("listing", []))
    identity = root.get("identity", [0, 0])
    expect(whole_numbers(identity) and len(identity) == 2, "has a bad identity")
    stdlib = root.get("stdlib", ["os.py", 0, 0, 0])
    expect(
        isinstance(stdlib, list)
        and len(stdlib) == 4
        and stdlib[0] in ("os.py", ".")
        and whole_numbers(stdlib[1:]),
        "has a bad stdlib stamp",
    )
    entries = root.get("entries")
    expect(entries is None or isinstance(entries, str), "has a bad entries digest")
    dists = root.get("dists", {})
    expect(isinstance(dists, dict), "has a bad dists")
    for name, identity in dists.items():
        good = safe_rel(name) and whole_numbers(identity) and len(identity) == 3
        expect(good, f"has bad dists entry {name[:80]!r}")
    partial = root.get("partial", {})
    expect(isinstance(partial, dict), "has a bad partial")
    for rel, info in partial.items():
        expect(safe_rel(rel) and isinstance(info, dict), f"has bad partial {rel!r}")
        expect(isinstance(info.get("mtime_ns"), int), f"has bad partial {rel!r}")
        check_listing(info.get("listing"))


def check_env(manifest, kind):
    """Check what a manifest says besides its roots and members.

    An environment bundle's ``env.watch`` names the directories whose
    change makes the bundle stale (:mod:`mpistage.runtime.envfresh`): each
    an absolute path, an mtime and a digest (or ``None``). ``packages`` and
    ``recorded`` are what ``mpistage inspect`` shows.
    """
    env = manifest.get("env", {})
    expect(isinstance(env, dict), "has a bad env")
    expect(not env or kind == "env", f"has an env, which a {kind} bundle may not have")
    for key in ("libraries", "missing", "watch"):
        expect(isinstance(env.get(key, []), list), f"has a bad env.{key}")
    for entry in env.get("watch", []):
        expect(
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and entry[0].startswith("/")
            and "\0" not in entry[0]
            and whole(entry[1])
            and (entry[2] is None or isinstance(entry[2], str)),
            f"has a bad env.watch entry {str(entry)[:80]!r}",
        )
    expect(isinstance(manifest.get("packages", []), list), "has a bad packages list")
    recorded = manifest.get("recorded", {})
    expect(isinstance(recorded, dict), "has a bad recorded")
    expect(isinstance(recorded.get("command", []), list), "has a bad recorded.command")


def whole(value):
    """Whether *value* is an int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_listing(listing):
    """Check a directory listing: a list of names."""
    expect(isinstance(listing, list), "has a bad listing")
    expect(all(isinstance(e, str) for e in listing), "has a bad listing entry")


def whole_numbers(value):
    """Whether *value* is a list of integers."""
    return isinstance(value, list) and all(whole(v) for v in value)


def base_of(root, index):
    """Return the components of root *index*'s directory below the node's place."""
    dest = root.get("dest", f"r{index}")
    return dest.split("/") if dest else []


def check_member(member, roots, data_end):
    """Check one member: its root, a safe relative path, its type and data."""
    expect(isinstance(member, dict), "is not an object")
    expect(safe_rel(member.get("rel")), f"has a bad path {member.get('rel')!r}")
    root = member.get("root")
    expect(isinstance(root, int) and 0 <= root < roots, f"has bad root {root!r}")
    kind = member.get("type")
    expect(kind in MEMBER_TYPES, f"has unknown type {kind!r}")
    for key in ("mode", "mtime_ns"):
        expect(whole(member.get(key)), f"has no whole-number {key}")
    expect(0 <= member["mode"] < 1 << 32, "has a bad mode")
    expect(-(1 << 63) <= member["mtime_ns"] < 1 << 63, "has a bad mtime_ns")
    ino = member.get("ino", 0)
    expect(whole(ino) and 0 <= ino < 1 << 64, "has a bad ino")
    if kind == "link":
        target = member.get("target")
        expect(
            isinstance(target, str) and target and "\0" not in target, "has no target"
        )
    if kind == "file":
        offset, size = member.get("offset"), member.get("size")
        expect(whole(offset) and whole(size), "has no offset")
        expect(isinstance(member.get("sha256", ""), str), "has a bad sha256")
        expect(HEADER_SIZE <= offset and 0 <= size, "has a bad offset")
        expect(offset + size <= data_end, "has data outside the data section")


def check_place(member, bases):
    """Check where *member* lands: not too deep, not on a reserved name."""
    parts = bases[member["root"]] + member["rel"].split("/")
    expect(
        len(parts) <= MAX_DEPTH,
        f"{member['rel'][:60]!r}... is too deep ({len(parts)} levels, "
        f"at most {MAX_DEPTH})",
    )
    expect(
        not parts[0].startswith(RESERVED),
        f"{member['rel']!r} uses a name reserved for mpistage ({RESERVED}*)",
    )


def check_range(member, end):
    """Check that a file's data follows the previous file's; return its end."""
    if member["type"] != "file":
        return end
    expect(
        end is None or member["offset"] >= end,
        f"{member['rel']!r} has data that overlaps or precedes the previous "
        "file's (data ranges must be disjoint and in manifest order)",
    )
    return member["offset"] + member["size"]


def check_links(members, bases, kind):
    """Check that every link resolves inside its root, through the other links.

    A runner bundle's root is its own directory (``r<i>``); an environment's
    roots merge into one prefix, the staging directory.
    """
    links = {}
    for member in members:
        if member["type"] == "link":
            path = "/".join(bases[member["root"]] + member["rel"].split("/"))
            links[path] = member["target"]
    for member in members:
        if member["type"] == "link":
            base = bases[member["root"]] if kind == "packages" else []
            parts = base + member["rel"].split("/")
            if not resolves_inside(parts[:-1], member["target"], links, len(base)):
                raise ValueError(
                    f"member {member['rel']!r} links to {member['target']!r}, "
                    "which does not resolve inside its root"
                )


def resolves_inside(parent, target, links, floor):
    """Whether *target*, read in directory *parent*, stays *floor* levels deep.

    Resolution follows the bundle's own *links* as the kernel would, at most
    :data:`MAX_HOPS` of them; an absolute target is outside by definition.
    """
    done, todo, hops = list(parent), target.split("/"), 0
    while todo:
        part = todo.pop(0)
        if target.startswith("/") or hops > MAX_HOPS:
            return False
        if part in ("", "."):
            continue
        if part == "..":
            if len(done) <= floor:
                return False
            done.pop()
            continue
        path = "/".join(done + [part])
        if path in links:
            hops += 1
            target = links[path]
            todo = target.split("/") + todo
            continue
        done.append(part)
    return True


def safe_rel(rel):
    """Whether *rel* is a plain relative path that stays below its root."""
    if not isinstance(rel, str) or not rel or "\0" in rel or rel.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in rel.split("/"))
