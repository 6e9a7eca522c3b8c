"""What a staged directory holds: rank 0 lists the tree once and checks it.

The tree under a path (a checkpoint directory: shards, an index, tokenizer
files) is listed by one process, relative to directory descriptors opened
without following symlinks: a listing per directory and the ``lstat`` that
comes with it, no open of any file. Only regular files and directories are
taken. A symlink, a FIFO, a socket or a device anywhere below the path is
refused with one line: a link could lead the read anywhere (another user's
file, a file that is not the checkpoint's), and a copy of what it points to
would no longer be the same tree. The path itself may be reached through
symlinks (``/scratch`` is often one): it is resolved once.

The files, in the order of the listing (names sorted, a directory's files
before its subdirectories), make one stream of bytes: file *i* holds the
stream's bytes ``[offsets[i], offsets[i] + size)``. That stream is what
travels (:mod:`mpistage.data.stream`); each leader cuts it back into files.
"""

import os as _os

from mpistage import StageError

DIR_FLAGS = _os.O_RDONLY | _os.O_DIRECTORY | _os.O_NOFOLLOW | _os.O_CLOEXEC
FILE_FLAGS = _os.O_RDONLY | _os.O_NOFOLLOW | _os.O_NONBLOCK | _os.O_CLOEXEC


class Entry:
    """One regular file of the tree: where it is, what it was when listed."""

    __slots__ = ("rel", "size", "mode", "mtime_ns", "ino", "offset")

    def __init__(self, rel, st, offset):
        self.rel, self.size, self.mode = rel, st.st_size, st.st_mode & 0o777
        self.mtime_ns, self.ino, self.offset = st.st_mtime_ns, st.st_ino, offset

    def __getstate__(self):
        return tuple(getattr(self, k) for k in self.__slots__)

    def __setstate__(self, state):
        for key, value in zip(self.__slots__, state, strict=True):
            setattr(self, key, value)

    def identity(self):
        """What an open descriptor of this file must still show."""
        return (self.ino, self.size, self.mtime_ns)


class Tree:
    """The listed tree: its path, directories, files and the stream's size.

    *single* is true when the path is one file, not a directory: the
    tree is then that file alone, named by its base name.
    """

    def __init__(self, path, dirs, files, single=False, name=None):
        self.path, self.dirs, self.files, self.single = path, dirs, files, single
        self.size = sum(entry.size for entry in files)
        self.name = name or base_name(path)

    def source(self, entry):
        """The path of *entry*'s original, for messages."""
        return self.path if self.single else f"{self.path}/{entry.rel}"


def base_name(path):
    """The name of *path*'s copy below its place: the path's last name, as given.

    As given, not resolved: ``/scratch/ckpt`` may be a link to
    ``/lustre/x/ckpt-final``, and the user knows it as ``ckpt``.
    """
    return _os.path.basename(_os.path.abspath(path).rstrip("/")) or "root"


def list_tree(path, include=None, names=None):
    """List the regular files below *path* (rank 0); return the :class:`Tree`.

    *include*, if given, is a list of glob patterns: only files that match
    one, or lie below a directory that matches one, are taken (the rules of
    ``mpistage pack --exclude``: a pattern without ``/`` matches a name at
    any depth, ``*`` never crosses ``/``, ``**`` spans directories).
    *names*, if given instead, are the only files taken, each directly in
    *path* and each one required: nothing is listed, each is looked at
    once (:func:`mpistage.data.tensors`, a checkpoint's shards).
    """
    import stat

    real = _os.path.realpath(path)
    try:
        st = _os.stat(real)
    except OSError as exc:
        reason = exc.strerror
        raise StageError(f"cannot read data directory {path!r}: {reason}") from None
    name = base_name(path)
    if stat.S_ISREG(st.st_mode):
        entry = Entry(_os.path.basename(real), st, 0)
        return Tree(real, [], [entry], single=True, name=name)
    if not stat.S_ISDIR(st.st_mode):
        raise StageError(f"cannot read data directory {path!r}: not a directory")
    if names is not None:
        return Tree(real, [], named(real, names), name=name)
    dirs, files = walk(real, include)
    if not files:
        what = f" matching {list(include)!r}" if include else ""
        raise StageError(f"data directory {path!r} holds no files{what}")
    return Tree(real, dirs, files, name=name)


def named(top, names):
    """The entries of the files *names* directly in *top*, each one required."""
    import stat

    fd, files, offset = open_dir(top, ""), [], 0
    try:
        for name in names:
            try:
                st = _os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError as exc:
                where = f"{top}/{name}"
                raise StageError(
                    f"cannot read data file {where!r}: {reason(exc)}"
                ) from None
            if not stat.S_ISREG(st.st_mode):
                refuse_kind(f"{top}/{name}", st)
            files.append(Entry(name, st, offset))
            offset += st.st_size
    finally:
        _os.close(fd)
    return files


def walk(top, include):
    """Return (directories, files) below *top*, each directory listed once.

    A loop, not a recursion: the tree chooses the depth. A directory is
    kept only when a file below it is.
    """
    dirs, files, pending, offset = [], [], [""], 0
    while pending:
        rel = pending.pop(0)
        subdirs, found = listing(top, rel)
        for entry_rel, st in found:
            if wanted(entry_rel, include):
                files.append(Entry(entry_rel, st, offset))
                offset += st.st_size
        pending[:0] = subdirs
        if rel:
            dirs.append(rel)
    kept = {parent for entry in files for parent in parents(entry.rel)}
    return [d for d in dirs if d in kept], files


def listing(top, rel):
    """List the directory *rel* below *top*: (subdirectories, [(file, stat)])."""
    import stat

    where = f"{top}/{rel}" if rel else top
    fd = open_dir(top, rel)
    try:
        with _os.scandir(fd) as entries:
            found = sorted((e.name, e.stat(follow_symlinks=False)) for e in entries)
    except OSError as exc:
        raise StageError(f"cannot list {where!r}: {exc.strerror}") from None
    finally:
        _os.close(fd)
    subdirs, files = [], []
    for name, st in found:
        child = f"{rel}/{name}" if rel else name
        if stat.S_ISDIR(st.st_mode):
            subdirs.append(child)
        elif stat.S_ISREG(st.st_mode):
            files.append((child, st))
        else:
            refuse_kind(f"{top}/{child}", st)
    return subdirs, files


def refuse_kind(path, st):
    """Raise: *path* is neither a regular file nor a directory."""
    import stat

    if stat.S_ISLNK(st.st_mode):
        raise StageError(
            f"{path!r} is a symlink: a staged directory holds regular files only "
            "(a Hugging Face cache snapshot links into blobs/: download with "
            "--local-dir, or give the files)"
        )
    raise StageError(f"{path!r} is not a regular file")


def open_dir(top, rel):
    """Open the directory *rel* below *top*, one component at a time, no symlink."""
    fd = _os.open(top, DIR_FLAGS)
    done = top
    try:
        for name in rel.split("/") if rel else ():
            done = f"{done}/{name}"
            fd, old = _os.open(name, DIR_FLAGS, dir_fd=fd), fd
            _os.close(old)
    except OSError as exc:
        _os.close(fd)
        raise StageError(f"cannot read {done!r}: {reason(exc)}") from None
    return fd


def open_file(tree, entry):
    """Open *entry*'s original for reading, checked against its listing; return fd.

    Every directory on the way and the file itself are opened without
    following a symlink; the open descriptor must show the inode, size and
    time the listing saw, else the tree changed under the read.
    """
    parent, _, name = entry.rel.rpartition("/")
    folder = _os.path.dirname(tree.path) if tree.single else tree.path
    where = tree.source(entry)
    dir_fd = open_dir(folder, parent)
    try:
        fd = _os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise StageError(f"cannot read data file {where!r}: {reason(exc)}") from None
    finally:
        _os.close(dir_fd)
    check_same(fd, tree, entry)
    return fd


def check_same(fd, tree, entry):
    """Raise (closing *fd*) unless *fd* is still the file *entry* was listed as."""
    st = _os.fstat(fd)
    if (st.st_ino, st.st_size, st.st_mtime_ns) != entry.identity():
        _os.close(fd)
        raise changed(tree, entry)


def changed(tree, entry):
    """The error of a file that changed while the tree was read."""
    return StageError(
        f"data file {tree.source(entry)!r} changed while being read "
        "(replaced, written or resized since it was listed)"
    )


def reason(exc):
    """Say why an open failed; a symlink where a file or directory was listed."""
    import errno

    if exc.errno == errno.ELOOP:
        return "is a symlink (replaced since it was listed)"
    return exc.strerror or str(exc)


def wanted(rel, include):
    """Whether the file *rel* is taken under the patterns *include*."""
    if include is None:
        return True
    from mpistage.bundle.globs import excludes  # the one glob rule (rank 0)

    return any(excludes(pattern, rel) for pattern in include)


def parents(rel):
    """The directories *rel* lies below, nearest last (``a/b/c`` → ``a``, ``a/b``)."""
    parts = rel.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def check_include(include):
    """Return *include* as a list of glob strings, or ``None``; refuse anything else."""
    if include is None:
        return None
    if isinstance(include, str):
        include = [include]
    try:
        include = list(include)
    except TypeError:
        raise StageError(f"include={include!r}: give glob patterns") from None
    if not include or not all(isinstance(p, str) and p.strip("/") for p in include):
        raise StageError(f"include={include!r}: give non-empty glob patterns")
    return include
