"""Staleness: does a bundle still match the files it was made from?

Rank 0 alone runs this, before the broadcast, so the originals are looked at
once per job, never once per rank. Modes:

- ``default``: the module names each root provides (one directory read),
  each bundled directory's mtime (a file added or removed changes it), and
  every member's size and mtime;
- ``strict``: also every file's SHA-256, which catches a change that kept
  size and mtime;
- ``trust`` (``--trust``): no check at all.

Directories are opened once each and their entries looked up relative to
the open directory, so a check costs two to three metadata operations per
member (a lookup and a getattr) instead of one per path component.
``__pycache__`` directories are not compared by mtime: Python adds
bytecode there as it runs, which does not make the bundled files stale.
"""

import os as _os

MODES = ("default", "strict", "trust")


class DirFds:
    """Open directories below one root, each opened once, relative to its parent."""

    def __init__(self, root):
        self.fds = {"": _os.open(root, _os.O_RDONLY | _os.O_DIRECTORY)}

    def fd(self, rel):
        """Return an open descriptor of the directory *rel* below the root."""
        if rel not in self.fds:
            parent = self.fd(_os.path.dirname(rel))
            flags = _os.O_RDONLY | _os.O_DIRECTORY
            self.fds[rel] = _os.open(_os.path.basename(rel), flags, dir_fd=parent)
        return self.fds[rel]

    def close(self):
        """Close every descriptor."""
        for fd in self.fds.values():
            _os.close(fd)


def differs(member, st):
    """Whether the stat result *st* no longer matches *member*."""
    if member["type"] == "dir":
        name = _os.path.basename(member["rel"])
        return name != "__pycache__" and st.st_mtime_ns != member["mtime_ns"]
    if member["type"] == "link":
        return False
    return st.st_size != member["size"] or st.st_mtime_ns != member["mtime_ns"]


def digest_differs(dirs, member):
    """Whether the original file's SHA-256 differs from the recorded one."""
    import hashlib

    parent = dirs.fd(_os.path.dirname(member["rel"]))
    fd = _os.open(_os.path.basename(member["rel"]), _os.O_RDONLY, dir_fd=parent)
    digest = hashlib.sha256()
    with open(fd, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest() != member["sha256"]


def check_member(dirs, member, strict):
    """Whether one member changed (missing counts as changed)."""
    try:
        parent = dirs.fd(_os.path.dirname(member["rel"]))
        st = _os.stat(
            _os.path.basename(member["rel"]), dir_fd=parent, follow_symlinks=False
        )
        if differs(member, st):
            return True
        return strict and member["type"] == "file" and digest_differs(dirs, member)
    except (FileNotFoundError, NotADirectoryError):
        return True


def changed(manifest, mode="default", limit=None):
    """Return original paths that changed since the bundle was made.

    Stops after *limit* changes (all when ``None``). Roots whose listing
    changed are reported as the root path itself.
    """
    if mode == "trust":
        return []
    found = []
    for index, root in enumerate(manifest["roots"]):
        if root_changed(root):
            found.append(root["path"])
        found += changed_members(manifest, index, mode == "strict", limit)
        if limit and len(found) >= limit:
            break
    return found


def root_changed(root):
    """Whether the module names a root provides changed, or it is gone.

    Absent names are answered from the recorded listing, so a module added
    to the root makes the bundle stale; other new files (a job's output next
    to its script) do not.
    """
    from mpistage.activate import module_names
    from mpistage.pack import listing

    try:
        return module_names(listing(root["path"])) != module_names(root["listing"])
    except OSError:
        return True


def changed_members(manifest, index, strict, limit):
    """Return the original paths of the changed members of root *index*."""
    from mpistage.bundle import original_path

    found = []
    try:
        dirs = DirFds(manifest["roots"][index]["path"])
    except OSError:
        return found
    try:
        for member in manifest["members"]:
            if member["root"] == index and check_member(dirs, member, strict):
                found.append(original_path(manifest, member))
                if limit and len(found) >= limit:
                    break
    finally:
        dirs.close()
    return found


class Background:
    """:func:`changed` in a thread, so rank 0's checks overlap the broadcast.

    The thread only looks at files; it makes no MPI calls.
    """

    def __init__(self, manifest, mode):
        import threading

        self.found, self.error = [], None
        self.thread = threading.Thread(target=self._run, args=(manifest, mode))
        self.thread.daemon = True
        self.thread.start()

    def _run(self, manifest, mode):
        try:
            self.found = changed(manifest, mode, limit=3)
        except BaseException as exc:  # handed to the main thread in result()
            self.error = exc

    def result(self):
        """Wait for the check; return the changed paths."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.found
