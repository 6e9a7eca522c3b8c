"""Staleness: does a bundle still match the files it was made from?

Rank 0 alone runs this, after reading the bundle and before the broadcast,
so the originals are looked at once per job, never once per rank. Its cost
is O(distributions + directories), not O(files), in the default mode:

- ``default``: for each root the bundle holds, its own identity (inode),
  the set of its ``.pth`` files, each bundled distribution's identity
  (inode, size and mtime of its ``RECORD``), the mtime of each directory
  the bundle holds whole or in part (a file added, removed or replaced by
  rename changes it), the inode of each member directly in the root (a
  rename-replace there changes only that), and the size and mtime of every
  file that no installed distribution owns (the user's own source,
  ``--path`` trees). pip and conda replace files and directories; they
  never edit a file in place, so a distribution whose ``RECORD`` and
  directories are unchanged is unchanged. The standard library changes
  only with the interpreter: its roots are checked by their own mtime (not
  the inode of each member), the identity of ``os.py`` (``lib-dynload``:
  of the directory) and the mtime of its bundled directories. What this
  misses is an edit in place of an installed file, or of a standard library
  file, that leaves its directory alone;
- ``files``: the size and mtime of every file too;
- ``strict``: also every file's SHA-256, which catches a change that kept
  size and mtime;
- ``trust`` (``--trust``): no check at all.

In every mode but ``trust``, each root's listing is read again and the
manifest's copy replaced before it is broadcast, so a module added next to
the bundled ones (or a directory a job created beside its script) is found
where it is, not reported absent, and does not make the bundle stale.
Bytecode in ``__pycache__`` is never compared: Python writes there as it
runs, and a cached file is only used when its source is unchanged. Nor
does bytecode appearing make a directory changed: a directory whose mtime
moved is compared by its entries (name and inode, ``__pycache__`` left
out), so the first plain run of a program, which writes ``__pycache__``
beside the sources, leaves its bundle fresh. The staged copy's own
bytecode, if the bundle has any, came with the sources it was made from,
and Python checks it against the staged source, never the original.
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
    held = any(m["root"] == index for m in manifest["members"])
    try:
        fd = _os.open(root["path"], _os.O_RDONLY | _os.O_DIRECTORY | _os.O_CLOEXEC)
    except OSError:
        root["listing"] = []
        return [root["path"]] if held else []
    try:
        recorded = root.get("listing", [])
        refresh_listing(fd, root)
        if stamp_changed(fd, root) or (held and root_changed(fd, root)):
            return [root["path"]]
        if not held:
            return []
        found = pth_changed(root, recorded) + list(changed_dists(fd, root))
        dirs = PathFds(fd)
        try:
            for member in members_to_check(manifest, index, mode):
                if len(found) >= limit:
                    break
                if member_changed(fd, member, mode == "strict", dirs):
                    found.append(root["path"] + "/" + member["rel"])
            found += partial_changed(manifest, index, dirs, limit - len(found))
        finally:
            dirs.close()
        return found[:limit]
    finally:
        _os.close(fd)


def refresh_listing(fd, root):
    """Replace the root's recorded listing with what it holds now."""
    from mpistage.runtime.roots import listing

    root["listing"] = listing(fd)


def stamp_changed(fd, root):
    """Whether a standard library root's identity file changed."""
    if not root.get("stdlib"):
        return False
    name, *identity = root["stdlib"]
    try:
        st = _os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return True
    return [st.st_ino, st.st_size, st.st_mtime_ns] != identity


def root_changed(fd, root):
    """Whether a bundled root was replaced (inode), or a stdlib root changed (mtime).

    A standard library root changes only with the interpreter, so its own
    mtime stands for every add, remove and rename among its entries; a
    site-packages directory changes with every install.
    """
    if "identity" not in root:
        return False
    st = _os.fstat(fd)
    ino, mtime_ns = root["identity"]
    if st.st_ino != ino:
        return True
    return bool(root.get("stdlib")) and dir_changed(
        st, mtime_ns, root.get("entries"), lambda: _os.dup(fd)
    )


def dir_changed(st, mtime_ns, entries, opener):
    """Whether a directory changed: its mtime moved, and not only by bytecode.

    *entries* is the digest recorded when the bundle was made (``None`` in
    older bundles: then the mtime alone decides); *opener* returns a
    readable descriptor of the directory, which this closes.
    """
    if st.st_mtime_ns == mtime_ns:
        return False
    if entries is None:
        return True
    from mpistage.runtime.roots import entries_digest

    try:
        fd = opener()
    except OSError:
        return True
    try:
        return entries_digest(fd) != entries
    finally:
        _os.close(fd)


def pth_changed(root, recorded):
    """Return the ``.pth`` files added to or removed from the root since bundling.

    They run at every interpreter start and change ``sys.path``.
    """
    before = {e for e in recorded if e.endswith(".pth")}
    now = {e for e in root["listing"] if e.endswith(".pth")}
    return [f"{root['path']}/{name}" for name in sorted(before ^ now)]


def partial_changed(manifest, index, dirs, limit):
    """Return the directories held only in part whose recorded listing changed."""
    if limit <= 0:
        return []
    members = {m["rel"] for m in manifest["members"] if m["root"] == index}
    root, found = manifest["roots"][index], []
    for rel, info in sorted(root.get("partial", {}).items()):
        if rel in members:
            continue  # a directory member: checked with the members
        try:
            st = dirs.stat(rel)
            changed = dir_changed(
                st, info["mtime_ns"], info.get("entries"), lambda r=rel: dirs.reopen(r)
            )
        except OSError:
            changed = True
        if changed:
            found.append(f"{root['path']}/{rel}")
            if len(found) >= limit:
                break
    return found


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
    """Yield the members of root *index* that *mode* compares one by one.

    The default mode compares directories and, outside the standard
    library (whose root's mtime and ``os.py`` stand for its files), the
    files no distribution owns and the members directly in the root.
    """
    stdlib = bool(manifest["roots"][index].get("stdlib"))
    for member in manifest["members"]:
        if member["root"] != index or "__pycache__" in member["rel"].split("/"):
            continue
        if mode != "default" or member["type"] == "dir":
            yield member
        elif not stdlib and (not member.get("owned") or "ino" in member):
            yield member


def member_changed(fd, member, strict, dirs=None):
    """Whether one member changed (missing counts as changed)."""
    try:
        st = (
            dirs.stat(member["rel"])
            if dirs
            else _os.stat(member["rel"], dir_fd=fd, follow_symlinks=False)
        )
    except OSError:
        return True
    if "ino" in member and st.st_ino != member["ino"]:
        return True
    if member["type"] == "dir":
        opener = lambda: reopen(fd, member, dirs)  # noqa: E731
        return dir_changed(st, member["mtime_ns"], member.get("entries"), opener)
    if member["type"] == "link":
        return False
    if st.st_size != member["size"] or st.st_mtime_ns != member["mtime_ns"]:
        return True
    return strict and digest(fd, member["rel"]) != member.get("sha256")


def reopen(fd, member, dirs):
    """Return a readable descriptor of the directory *member* (to list it)."""
    if dirs:
        return dirs.reopen(member["rel"])
    return _os.open(member["rel"], PathFds.LISTABLE, dir_fd=fd)


class PathFds:
    """``O_PATH`` descriptors of a root's directories, each looked up once.

    A stat relative to its parent's descriptor costs one lookup and one
    getattr on the shared file system, however deep the directory.
    """

    FLAGS = getattr(_os, "O_PATH", _os.O_RDONLY) | _os.O_DIRECTORY | _os.O_CLOEXEC
    LISTABLE = _os.O_RDONLY | _os.O_DIRECTORY | _os.O_CLOEXEC | _os.O_NOFOLLOW

    def __init__(self, root_fd):
        self.fds = {"": root_fd}
        self.own = []

    def fd(self, rel):
        """Return a descriptor of the directory *rel* below the root.

        Missing ones on the way are opened from their parent, in a loop.
        """
        if rel not in self.fds:
            parent, done = self.fds[""], ""
            for name in rel.split("/"):
                done = f"{done}/{name}" if done else name
                if done not in self.fds:
                    flags = self.FLAGS | _os.O_NOFOLLOW
                    self.fds[done] = _os.open(name, flags, dir_fd=parent)
                    self.own.append(self.fds[done])
                parent = self.fds[done]
        return self.fds[rel]

    def stat(self, rel):
        """``lstat`` *rel*, relative to its parent's descriptor."""
        parent, _, name = rel.rpartition("/")
        return _os.stat(name, dir_fd=self.fd(parent), follow_symlinks=False)

    def reopen(self, rel):
        """Open the directory *rel* for listing; the caller closes it."""
        parent, _, name = rel.rpartition("/")
        return _os.open(name, self.LISTABLE, dir_fd=self.fd(parent))

    def close(self):
        """Close the descriptors this opened."""
        for fd in self.own:
            _os.close(fd)


def digest(fd, rel):
    """Return the SHA-256 of the file *rel* below the directory *fd*."""
    from mpistage.runtime.bundlefile import sha256

    sha = sha256()
    flags = _os.O_RDONLY | _os.O_CLOEXEC | _os.O_NONBLOCK  # a FIFO must not hang
    with open(_os.open(rel, flags, dir_fd=fd), "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def stale_message(path, found):
    """Return the one-line error for a stale bundle."""
    return (
        f"bundle {path!r} is stale: {', '.join(map(repr, found))} changed since "
        "it was made; rebuild it, or run with --trust to use it anyway"
    )
