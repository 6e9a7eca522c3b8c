"""Staleness: does a bundle still match the files it was made from?

Rank 0 alone runs this, after reading the bundle and before the broadcast,
so the originals are looked at once per job, never once per rank. Its cost
is O(distributions + directories), not O(files), in the default mode:

- ``default``: each root's module names (one directory read), each bundled
  distribution's identity (inode, size and mtime of its ``RECORD``), each
  bundled directory's mtime (a file added, removed or replaced changes it),
  and the size and mtime of every file that no installed distribution owns
  (the user's own source, ``--path`` trees). pip and conda replace files and
  directories; they never edit a file in place, so a distribution whose
  ``RECORD`` and directories are unchanged is unchanged;
- ``files``: the size and mtime of every file too;
- ``strict``: also every file's SHA-256, which catches a change that kept
  size and mtime;
- ``trust`` (``--trust``): no check at all.

Bytecode in ``__pycache__`` is never compared: Python writes there as it
runs, and a cached file is only used when its source is unchanged.
Directories are looked up relative to the root's open descriptor, so a
check costs one lookup per path component.
"""

import os as _os

MODES = ("default", "files", "strict", "trust")


def changed(manifest, mode="default", limit=3):
    """Return up to *limit* original paths that changed since the bundle was made.

    A root whose module names changed, or that is gone, is reported as the
    root path itself.
    """
    if mode == "trust":
        return []
    found = []
    for index in range(len(manifest["roots"])):
        found += changed_in_root(manifest, index, mode, limit - len(found))
        if len(found) >= limit:
            break
    return found[:limit]


def changed_in_root(manifest, index, mode, limit):
    """Return the changed paths of root *index*."""
    root = manifest["roots"][index]
    try:
        fd = _os.open(root["path"], _os.O_RDONLY | _os.O_DIRECTORY | _os.O_CLOEXEC)
    except OSError:
        return [root["path"]]
    try:
        if listing_changed(fd, root):
            return [root["path"]]
        found = [d for d in changed_dists(fd, root)][:limit]
        for member in members_to_check(manifest, index, mode):
            if len(found) >= limit:
                break
            if member_changed(fd, member, mode == "strict"):
                found.append(root["path"] + "/" + member["rel"])
        return found
    finally:
        _os.close(fd)


def listing_changed(fd, root):
    """Whether the module names the root provides differ from the recorded ones."""
    from mpistage.runtime.roots import module_names

    with _os.scandir(fd) as entries:
        now = [e.name + "/" if e.is_dir() else e.name for e in entries]
    return module_names(now) != module_names(root.get("listing", []))


def changed_dists(fd, root):
    """Yield the paths of bundled distributions whose ``RECORD`` changed."""
    for name, identity in root.get("dists", {}).items():
        try:
            st = _os.stat(f"{name}/RECORD", dir_fd=fd, follow_symlinks=False)
        except OSError:
            yield f"{root['path']}/{name}"
            continue
        if [st.st_ino, st.st_size, st.st_mtime_ns] != identity:
            yield f"{root['path']}/{name}"


def members_to_check(manifest, index, mode):
    """Yield the members of root *index* that *mode* compares one by one."""
    for member in manifest["members"]:
        if member["root"] != index or "__pycache__" in member["rel"].split("/"):
            continue
        if member["type"] == "dir" or mode != "default" or not member.get("owned"):
            yield member


def member_changed(fd, member, strict):
    """Whether one member changed (missing counts as changed)."""
    try:
        st = _os.stat(member["rel"], dir_fd=fd, follow_symlinks=False)
    except OSError:
        return True
    if member["type"] == "dir":
        return st.st_mtime_ns != member["mtime_ns"]
    if member["type"] == "link":
        return False
    if st.st_size != member["size"] or st.st_mtime_ns != member["mtime_ns"]:
        return True
    return strict and digest(fd, member["rel"]) != member.get("sha256")


def digest(fd, rel):
    """Return the SHA-256 of the file *rel* below the directory *fd*."""
    import hashlib

    sha = hashlib.sha256()
    with open(_os.open(rel, _os.O_RDONLY | _os.O_CLOEXEC, dir_fd=fd), "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def stale_message(path, found):
    """Return the one-line error for a stale bundle."""
    return (
        f"bundle {path!r} is stale: {', '.join(map(repr, found))} changed since "
        "it was made; rebuild it, or run with --trust to use it anyway"
    )
