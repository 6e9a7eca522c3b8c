"""The collective steps of :func:`mpistage.data.staged_dir`, run by every rank.

arguments → topology → list (rank 0) → place (leaders) → stream → path;
each step ends with an agreement of all ranks, so a bad tree is one
:class:`~mpistage.StageError` on every rank, and a failure after the
places exist removes them first.

- list: rank 0 lists the tree and checks it (:mod:`~mpistage.data.trees`);
  no other rank touches the path;
- place: each node leader makes its node's place by the rules of every
  copy (:func:`mpistage.node.place.make_root`: per user, 0700, in the
  first usable candidate, /dev/shm by default, with room for the tree),
  guarded from the start (:mod:`mpistage.node.cleanup`);
- stream: the files travel as one stream (:func:`mpistage.data.stream.
  carry`): rank 0 reads each file once, every leader writes each piece
  straight into its files;
- path: every rank of a node learns the path of the same tree in its
  node's copy, ``<place>/<name of the path>``.
"""

import atexit as _atexit
import os as _os
import time as _time

from mpistage import StageError

WRITE_FLAGS = _os.O_WRONLY | _os.O_CREAT | _os.O_EXCL | _os.O_NOFOLLOW | _os.O_CLOEXEC
COPIES = []  # this rank's staged directories not yet removed, oldest first
PID = _os.getpid()  # a forked child never removes its parent's copies


def stage(comm, path, include):
    """Stage the tree at *path* once per node; return its :class:`StagedDir`."""
    from mpistage.data.steps import same_everywhere
    from mpistage.data.trees import check_include
    from mpistage.runtime.collective import attempt

    path = attempt(comm, fspath, path)
    include = attempt(comm, check_include, include)
    given = (("path", repr(path)), ("include", repr(include)))
    attempt(comm, same_everywhere, comm, given)
    return stage_agreed(comm, path, include)


def for_program(comm, folders):
    """Stage each of *folders* for a program (``--data``); return the copies.

    ``MPISTAGE_DATA_DIR`` gets their node-local paths, in the order given,
    ``:``-separated: the program reads the copies from there.
    """
    from mpistage import data

    copies = [data.staged_dir(folder, comm) for folder in folders]
    _os.environ["MPISTAGE_DATA_DIR"] = _os.pathsep.join(c.path for c in copies)
    return copies


def stage_agreed(comm, path, include=None, names=None, place=None):
    """:func:`stage`, the arguments agreed already (*names*: rank 0's only).

    *place* says where each node's copy goes (default: a :class:`JobPlace`).
    """
    from mpistage.runtime.collective import attempt
    from mpistage.runtime.topology import discover

    job = Job(comm, attempt(comm, discover, comm, True), place or JobPlace())
    try:
        job.run(path, include, names)
    except BaseException:
        job.free(job.topo.node)
        raise
    finally:
        job.free(job.topo.leaders)
    return StagedDir(job)


def fspath(path):
    """*path* as a ``str``, or one line."""
    try:
        return _os.fspath(path)
    except TypeError:
        raise StageError(f"path {path!r} is no str or os.PathLike") from None


class Job:
    """One staging of a tree, on one rank: communicators, the tree, the place."""

    def __init__(self, comm, topo, place):
        self.comm, self.topo, self.place = comm, topo, place
        self.tree = self.root = self.local = self.size = None
        self.seconds, self.last = {}, _time.perf_counter()

    def mark(self, step):
        """Note the seconds since the previous mark as *step*'s."""
        now = _time.perf_counter()
        self.seconds[step], self.last = now - self.last, now

    def run(self, path, include, names=None):
        """List, make the places, stream the files, learn the node's path."""
        from mpistage.data.trees import list_tree
        from mpistage.runtime.collective import attempt

        topo = self.topo
        listed = attempt(
            self.comm, lambda: self.first and list_tree(path, include, names)
        )
        self.tree = topo.leaders.bcast(listed, root=0) if topo.is_leader else None
        self.mark("list")
        try:
            attempt(self.comm, self.make_place)
            self.mark("place")
            attempt(self.comm, self.send)
            self.mark("stream")
        except StageError:
            self.discard()
            raise
        found = self.root and (f"{self.root.path}/{self.tree.name}", self.tree.size)
        self.local, self.size = topo.node.bcast(found, root=0)

    @property
    def first(self):
        """Whether this rank reads the tree (rank 0 of the communicator)."""
        return self.comm.rank == 0

    def make_place(self):
        """A leader: make its node's place (:attr:`place`'s), :attr:`root`.

        Kept at once, not returned: when another leader fails, the
        agreement raises here too, and the place made must be discarded.
        """
        if self.topo.is_leader:
            self.root = self.place.make(self.tree, self.topo.index, Room(self.tree))

    def send(self):
        """Leaders: the stream from rank 0's reads into every node's files."""
        from mpistage.data.stream import carry

        if not self.topo.is_leader:
            return
        sink = Sink(self.root, self.tree)
        source = Source(self.tree) if self.first else None
        try:
            sink.prepare()
            carry(
                self.topo.leaders,
                self.tree.size,
                source.fill if source else None,
                sink.drain,
            )
            if source is not None:
                source.finish()
            sink.finish()
            self.place.done(self.root, self.tree)
        finally:
            if source is not None:
                source.close()
            sink.close()

    def discard(self):
        """Take this node's place away after a failure (the leader; agreed)."""
        if self.root is not None:
            self.place.discard(self.root)
            self.root = None

    def free(self, comm):
        """Free one of this job's communicators (the node's stays, for the end)."""
        from mpistage.data.steps import free_comm

        free_comm(comm)


class JobPlace:
    """The copy of one job: a fresh node's place, guarded, removed at the end.

    Made by the rules of every copy (:func:`mpistage.node.place.make_root`:
    the first usable candidate, per user, 0700, with room for the tree,
    reaping this user's copies of dead jobs there first), guarded on every
    exit path from the moment it exists (:func:`mpistage.node.cleanup.guard`).
    :class:`~mpistage.data.command.TargetPlace` is the other kind of place.
    """

    def make(self, tree, node, room):
        """Create, guard and record this node's place; return it."""
        from mpistage.node.cleanup import guard
        from mpistage.node.place import job_tag, make_root, write_owner
        from mpistage.runtime.stage import reap

        tag = job_tag()
        root = make_root(tag, node, room, reap=reap)
        guard(root)
        write_owner(root, tag)
        return root

    def done(self, root, tree):
        """The tree is in *root*."""

    def discard(self, root):
        """Remove *root* after a failure."""
        self.release(root)

    def release(self, root):
        """Remove *root*: the end of the copy (no MPI needed)."""
        from mpistage.node.cleanup import release

        release(root)


class Room:
    """What a tree takes in its place: whole blocks per file and directory."""

    what = "the directory's files"  # as a refusal names it

    def __init__(self, tree):
        self.sizes = [entry.size for entry in tree.files]
        self.dirs = len(tree.dirs) + 1
        self.inodes = len(self.sizes) + self.dirs

    def bytes(self, block):
        """The bytes the tree takes on a file system of *block* bytes."""
        block = max(1, block)
        return block * (sum(-(-size // block) for size in self.sizes) + self.dirs)


def overlapping(files, offsets, start, end):
    """Yield (entry, lo, hi): the part [lo, hi) of the stream in each file.

    *offsets* are the files' offsets in the stream, in order (made once).
    """
    import bisect

    index = max(0, bisect.bisect_right(offsets, start) - 1)
    for entry in files[index:]:
        if entry.offset >= end:
            return
        lo, hi = max(start, entry.offset), min(end, entry.offset + entry.size)
        if lo < hi:
            yield entry, lo, hi


class Source:
    """Rank 0's side of the stream: each file opened once, read in order."""

    def __init__(self, tree):
        self.tree, self.files = tree, [e for e in tree.files if e.size]
        self.offsets = [entry.offset for entry in self.files]
        self.entry = self.fd = None

    def fill(self, start, view):
        """Put the stream's bytes from *start* on into *view*."""
        from mpistage.data.stream import read_into
        from mpistage.data.trees import changed

        end = start + len(view)
        for entry, lo, hi in overlapping(self.files, self.offsets, start, end):
            fd = self.open(entry)
            part = view[lo - start : hi - start]
            try:
                whole = read_into(fd, part, lo - entry.offset)
            except OSError as exc:
                where = self.tree.source(entry)
                raise StageError(
                    f"cannot read data file {where!r}: {exc.strerror}"
                ) from None
            if not whole:
                raise changed(self.tree, entry)

    def open(self, entry):
        """The descriptor of *entry*; the file before it is checked and closed."""
        from mpistage.data.trees import open_file

        if self.entry is not entry:
            self.finish()
            self.fd, self.entry = open_file(self.tree, entry), entry
        return self.fd

    def finish(self):
        """Check that the file read last is still what was listed; close it."""
        from mpistage.data.trees import check_same

        if self.fd is not None:
            fd, self.fd = self.fd, None
            check_same(fd, self.tree, self.entry)
            _os.close(fd)

    def close(self):
        """Close what is open (after a failure)."""
        if self.fd is not None:
            _os.close(self.fd)
            self.fd = None


class Sink:
    """A leader's side of the stream: the tree's files in its node's place."""

    def __init__(self, root, tree):
        self.root, self.tree = root, tree
        self.files = [e for e in tree.files if e.size]
        self.offsets = [entry.offset for entry in self.files]
        self.top = self.entry = self.fd = None
        self.left = 0

    def prepare(self):
        """Make the tree's directories, and its empty files, before any byte."""
        from mpistage.node.place import DIR_FLAGS

        if self.tree.single:
            self.top = _os.dup(self.root.fd)
        else:
            _os.mkdir(self.tree.name, 0o700, dir_fd=self.root.fd)
            self.top = _os.open(self.tree.name, DIR_FLAGS, dir_fd=self.root.fd)
        for rel in self.tree.dirs:
            parent, name = self.parent(rel)
            try:
                _os.mkdir(name, 0o700, dir_fd=parent)
            finally:
                self.close_parent(parent)
        for entry in self.tree.files:
            if not entry.size:
                self.done(self.create(entry), entry)

    def drain(self, start, view):
        """Write the stream's bytes *view* (from *start* on) into their files."""
        from mpistage.data.stream import write_from

        end = start + len(view)
        for entry, lo, hi in overlapping(self.files, self.offsets, start, end):
            if self.entry is not entry:
                self.fd, self.entry, self.left = self.create(entry), entry, entry.size
            write_from(self.fd, view[lo - start : hi - start], lo - entry.offset)
            self.left -= hi - lo
            if not self.left:
                fd, self.fd, self.entry = self.fd, None, None
                self.done(fd, entry)

    def create(self, entry):
        """Create *entry*'s file in the copy, never through a symlink; return fd."""
        parent, name = self.parent(entry.rel)
        try:
            return _os.open(name, WRITE_FLAGS, 0o600, dir_fd=parent)
        finally:
            self.close_parent(parent)

    def done(self, fd, entry):
        """Give a written file its original's mode (no write bits) and time."""
        try:
            _os.fchmod(fd, (entry.mode | 0o400) & 0o555)
            _os.utime(fd, ns=(entry.mtime_ns, entry.mtime_ns))
        finally:
            _os.close(fd)

    def parent(self, rel):
        """Open the directory *rel* lies in (below the copy's top); (fd, name)."""
        from mpistage.node.place import DIR_FLAGS

        folder, _, name = rel.rpartition("/")
        if self.tree.single:
            return self.top, self.tree.name  # the name given, not the link's target
        if not folder:
            return self.top, name
        fd = _os.open(folder.split("/")[0], DIR_FLAGS, dir_fd=self.top)
        for part in folder.split("/")[1:]:
            fd, old = _os.open(part, DIR_FLAGS, dir_fd=fd), fd
            _os.close(old)
        return fd, name

    def close_parent(self, fd):
        """Close a directory :meth:`parent` opened (not the top)."""
        if fd != self.top:
            _os.close(fd)

    def finish(self):
        """Check that every file was written whole."""
        if self.fd is not None:
            raise StageError(f"the stream ended inside {self.entry.rel!r}")

    def close(self):
        """Close what is open."""
        for fd in (self.fd, self.top):
            if fd is not None:
                _os.close(fd)
        self.fd = self.top = None


class StagedDir:
    """A tree staged on this rank's node: :attr:`path`, the node-local copy.

    ``with staged_dir(...) as local:`` gives :attr:`path` (a ``str``); the
    object is also ``os.PathLike``. :meth:`close` is collective over the
    ranks of the node: they wait for each other, then the leader removes
    the copy. Memory maps of its files stay valid after that (a file of a
    RAM disk lives while mapped); opening them by name does not.
    """

    def __init__(self, job):
        self.path, self.seconds = job.local, dict(job.seconds)
        self.nbytes = job.size
        self._node, self._root, self._place = job.topo.node, job.root, job.place
        self.closed = False
        COPIES.append(self)

    def __fspath__(self):
        return self.path

    def __enter__(self):
        if self.closed:
            raise ValueError(f"the staged copy {self.path!r} is removed")
        return self.path

    def __exit__(self, exc_type, exc, tb):
        # An exception may be this rank's alone: a collective call now could
        # wait forever for the other ranks. The copy then goes at exit.
        if exc_type is None:
            self.close()
        else:
            self.closed = True

    def close(self):
        """Remove the node's copy once every rank of the node is here (collective)."""
        if self in COPIES:
            COPIES.remove(self)
            self.remove(wait=True)
        self.closed = True

    def remove(self, wait):
        """Wait for the node's ranks (if *wait*), then the leader removes the copy."""
        from mpistage.runtime.collective import barrier

        if wait:
            barrier(self._node)
        if self._root is not None:
            self._place.release(self._root)
        self._root = None
        if wait:
            self._node.Free()

    def __repr__(self):
        state = "removed" if self.closed else "staged"
        return f"<StagedDir {self.path!r}, {state}>"


def remove_all():
    """At exit, remove every copy left, node by node, in the order made.

    Collective on each node while MPI runs (the ranks of a node may still
    use the files); after ``MPI_Finalize`` each leader removes its own.
    """
    import sys

    mpi = sys.modules.get("mpi4py.MPI")
    if not COPIES or _os.getpid() != PID:
        return
    running = mpi is not None and not mpi.Is_finalized()
    for copy in list(COPIES):
        COPIES.remove(copy)
        copy.remove(wait=running)


_atexit.register(remove_all)
