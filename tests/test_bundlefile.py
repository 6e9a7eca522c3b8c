"""The bundle file's read side, directly: header, manifest digest, the shape rules.

Every rule of ``check`` is tried on a manifest that breaks only that rule,
next to one that keeps it, so each refusal is for the rule's reason.
"""

import copy
import hashlib
import json

import pytest

from mpistage import StageError
from mpistage.runtime import bundlefile

DATA_END = 1000


def manifest(members=(), roots=None, kind="packages"):
    """A sound manifest with *members* (file data at increasing offsets)."""
    offset, listed = bundlefile.HEADER_SIZE, []
    for member in members:
        member = {"root": 0, "mode": 0o644, "mtime_ns": 0, **member}
        if member["type"] == "file":
            member.setdefault("size", 10)
            member.setdefault("offset", offset)
            offset = member["offset"] + member["size"]
        listed.append(member)
    return {
        "kind": kind,
        "python": bundlefile.python_tag(),
        "roots": roots or [{"path": "/site", "listing": []}],
        "members": listed,
    }


def refused(found, words):
    """Check that *found* is refused with a message holding *words*."""
    with pytest.raises(StageError) as info:
        bundlefile.check(found, DATA_END, "b.mpistage")
    message = str(info.value)
    assert message.startswith("bundle 'b.mpistage' is malformed: ")
    for word in words:
        assert word in message, message
    return message


def test_a_sound_manifest_passes():
    found = manifest(
        [
            {"rel": "pkg", "type": "dir"},
            {"rel": "pkg/a.py", "type": "file"},
            {"rel": "pkg/b.py", "type": "file"},
            {"rel": "pkg/c.py", "type": "link", "target": "a.py"},
        ]
    )
    assert bundlefile.check(copy.deepcopy(found), DATA_END, "b") == found


@pytest.mark.parametrize(
    "rel", ["/abs", "a/../b", "a//b", "./a", "a/.", "", None, "a\0b"]
)
def test_paths_must_be_plain_and_relative(rel):
    refused(manifest([{"rel": rel, "type": "dir"}]), ["bad path"])


def test_dest_only_in_environment_bundles():
    roots = [{"path": "/site", "listing": [], "dest": "lib"}]
    refused(manifest([], roots), ["has a dest, which a packages bundle"])
    env = manifest([], roots, kind="env")
    assert bundlefile.check(env, DATA_END, "b") is env
    env["roots"][0]["dest"] = "../up"
    refused(env, ["bad dest"])


@pytest.mark.parametrize("name", [".mpistage-owner", ".mpistage", ".mpistagex"])
def test_reserved_names_at_the_top(name):
    roots = [{"path": "/env", "listing": [], "dest": ""}]
    found = manifest([{"rel": name, "type": "file"}], roots, kind="env")
    refused(found, ["reserved for mpistage"])
    found["members"][0]["rel"] = f"lib/{name}"  # only the top is reserved
    bundlefile.check(found, DATA_END, "b")


def test_depth_is_bounded():
    deep = "/".join(["d"] * (bundlefile.MAX_DEPTH - 1))  # r0 makes one more
    bundlefile.check(manifest([{"rel": deep, "type": "dir"}]), DATA_END, "b")
    refused(manifest([{"rel": deep + "/x", "type": "dir"}]), ["too deep"])


def test_nesting_is_bounded():
    found = manifest()
    value = []
    for _ in range(bundlefile.MAX_NESTING):
        value = [value]
    found["created_by"] = value
    refused(found, ["nested too deeply"])
    found["created_by"] = value[0][0]
    bundlefile.check(found, DATA_END, "b")


def test_data_must_lie_in_the_data_section():
    refused(manifest([{"rel": "a", "type": "file", "size": DATA_END}]), ["outside"])
    refused(manifest([{"rel": "a", "type": "file", "offset": 3}]), ["bad offset"])


@pytest.mark.parametrize("second", [64, 70])  # the same bytes; inside the first
def test_data_ranges_are_disjoint(second):
    files = [
        {"rel": "a", "type": "file", "offset": 64, "size": 10},
        {"rel": "b", "type": "file", "offset": second, "size": 4},
    ]
    refused(manifest(files), ["'b' has data that overlaps or precedes"])


def test_data_ranges_follow_manifest_order():
    files = [
        {"rel": "a", "type": "file", "offset": 80, "size": 10},
        {"rel": "b", "type": "file", "offset": 64, "size": 10},
    ]
    refused(manifest(files), ["overlaps or precedes"])
    files[1]["offset"] = 90
    bundlefile.check(manifest(files), DATA_END, "b")


INSIDE = {
    "sibling": ("pkg/l", "a.py"),
    "up and down": ("pkg/l", "../pkg/a.py"),
    "dangling": ("pkg/l", "no/such/thing"),
    "through a link inside": ("pkg/m", "l/../a.py"),
}
OUTSIDE = {
    "absolute": ("pkg/l", "/etc/passwd"),
    "climbing": ("pkg/l", "../../x"),
    "to another root": ("pkg/l", "../../r1/x"),
    "through a link going up": ("d/a/b/m", "../../../up/../../../../x"),
    "a loop": ("pkg/l", "l"),
}


def with_link(rel, target, more=()):
    members = [{"rel": "pkg/a.py", "type": "file"}, *more]
    return manifest([*members, {"rel": rel, "type": "link", "target": target}])


@pytest.mark.parametrize("case", sorted(INSIDE))
def test_links_inside_their_root_pass(case):
    rel, target = INSIDE[case]
    more = [{"rel": "pkg/l", "type": "link", "target": "."}] if rel == "pkg/m" else []
    bundlefile.check(with_link(rel, target, more), DATA_END, "b")


@pytest.mark.parametrize("case", sorted(OUTSIDE))
def test_links_leaving_their_root_are_refused(case):
    rel, target = OUTSIDE[case]
    more = [{"rel": "up", "type": "link", "target": "d/a/b"}]
    refused(with_link(rel, target, more), [repr(rel), "does not resolve inside"])


def test_a_link_inside_that_the_kernel_follows_outside():
    # Lexically d/a/b/l/../../../.. is the root; l leads to the root first.
    more = [{"rel": "d/a/b/l", "type": "link", "target": "../../.."}]
    refused(with_link("pkg/x", "../d/a/b/l/../../../../out", more), ["'pkg/x'"])


def test_environment_links_may_cross_roots():
    roots = [
        {"path": "/env", "listing": [], "dest": ""},
        {"path": "/base/lib", "listing": [], "dest": "lib"},
    ]
    members = [
        {"rel": "bin/python", "type": "link", "target": "../lib/python3"},
        {"rel": "python3", "type": "file", "root": 1},
    ]
    bundlefile.check(manifest(members, roots, kind="env"), DATA_END, "b")
    members[0]["target"] = "../../outside"
    refused(manifest(members, roots, kind="env"), ["does not resolve inside"])


def whole(found):
    """Return a whole bundle (header, no data, the manifest) for *found*."""
    raw = json.dumps(found).encode()
    digest = hashlib.sha256(raw).digest()
    header = bundlefile.HEADER.pack(
        bundlefile.MAGIC, bundlefile.FORMAT, 0, bundlefile.HEADER_SIZE, len(raw), digest
    )
    return bytearray(header.ljust(bundlefile.HEADER_SIZE, b"\0") + raw)


def test_manifest_of_a_whole_bundle():
    found = manifest([{"rel": "d", "type": "dir"}])
    assert bundlefile.manifest_of(whole(found), "b") == found


@pytest.mark.parametrize(
    "spoil, words",
    [
        (lambda b: b.__setitem__(0, 0), ["not an mpistage bundle", "bad magic"]),
        (lambda b: b.__setitem__(slice(8, 9), b"\x07"), ["format 7, expected 1"]),
        (lambda b: b.__setitem__(-2, ord(" ")), ["manifest checksum mismatch"]),
        (lambda b: b.extend(b"xx"), ["truncated or padded"]),
        (lambda b: b.__delitem__(slice(10, None)), ["truncated"]),
    ],
)
def test_header_and_digest_are_checked(spoil, words):
    buf = whole(manifest())
    spoil(buf)
    with pytest.raises(StageError) as info:
        bundlefile.manifest_of(buf, "b")
    for word in words:
        assert word in str(info.value)


def test_json_too_deep_to_parse_is_one_error():
    raw = b"[" * 100_000 + b"]" * 100_000
    digest = hashlib.sha256(raw).digest()
    with pytest.raises(StageError, match="nested too deeply"):
        bundlefile.load_manifest(raw, digest, "b")
