"""Shared data files: read once per job, one copy per node, mapped by every rank.

::

    from mpistage import data
    with data.read("/scratch/big.bin", comm=comm) as buf:  # a SharedBuffer
        digest = hashlib.sha256(buf.view).hexdigest()
    weights = data.load("/scratch/weights.npy", comm=comm)  # a read-only ndarray

Both calls are collective over *comm* and run the same steps on every rank
(see docs/data.md):

- arguments: every rank must pass the same ones (path, readers, io, and
  for ``load`` member, dtype, shape, order, offset); rank 0's are compared
  with each rank's before anything else, and a difference is one error;
- topology: *comm* → node communicators (real ones, or the emulated ones of
  ``MPISTAGE_EMULATE_NODES``) → the communicator of node leaders;
- open: *readers* ranks open the file, spread over the nodes; no other rank
  opens or stats it. Only a regular file is read (the open does not block
  on a FIFO). The first reader also finds where the array's bytes are (.npy
  header, .npz member); the other readers check that they opened the same
  file (inode, size, mtime);
- allocate: each node leader checks that its node has room (MemAvailable),
  then allocates the node's copy as an MPI shared-memory window, which the
  node's other ranks map;
- read: each reader reads one contiguous part into its node's copy;
- broadcast: the leaders pass the parts on to each other as raw chunks of
  :data:`mpistage.runtime.broadcast.CHUNK_SIZE` bytes, never pickled;
- view: every rank gets a read-only view of its node's copy.

Each step ends with an agreement of all ranks, so a bad input raises the same
one-line :class:`~mpistage.StageError` on every rank instead of hanging the
job. The node's memory is freed once no rank of the node holds a view of it
any more: at :meth:`SharedBuffer.close`, at a later call of this module on
the same ranks, or at interpreter exit, always before MPI is finalized.
"""

import atexit as _atexit
import os as _os
import sys as _sys
import time as _time

from mpistage import StageError

__all__ = ["SharedArray", "SharedBuffer", "load", "read"]  # noqa: F822 (lazy)

IO_METHODS = ("posix", "mpiio")
READ_SIZE = 64 << 20
MPIIO_HINTS = {
    "romio_cb_read": "enable",
    "romio_no_indep_rw": "true",
    "romio_ds_read": "disable",
    "cb_config_list": "*:*",
    "cb_buffer_size": str(16 << 20),
}

_SEGMENTS = []  # this rank's live node copies, in the order they were made
_PID = _os.getpid()  # a forked child never frees the parent's copies


# -- the public API -------------------------------------------------------------


def read(path, comm=None, *, readers=1, io="posix"):
    """Return the bytes of the file *path* as a :class:`SharedBuffer` (collective).

    *readers* ranks open and read the file (one by default), through plain
    reads (``io="posix"``) or MPI-IO collective reads (``io="mpiio"``).
    """
    job = _share(comm, path, readers, io, _whole, ())
    return SharedBuffer(job.segment, job.view, job.path, job.seconds)


def load(
    path,
    comm=None,
    *,
    member=None,
    dtype=None,
    shape=None,
    order="C",
    offset=0,
    readers=1,
    io="posix",
):
    """Return the array stored in *path* as a :class:`SharedArray` (collective).

    A ``.npy`` file; a stored member of a ``.npz`` file (*member*, with or
    without ``.npy``); or, given *dtype*, a raw file of *shape* (default:
    one dimension) in *order* from byte *offset* on. The result *is* a
    read-only ``numpy.ndarray`` on the node's copy.
    """
    locate = _locator(member, dtype, shape, order, offset)
    more = (("member", member), ("dtype", _dtype_name(dtype)), ("shape", shape))
    more += (("order", order), ("offset", offset))
    job = _share(comm, path, readers, io, locate, more)
    meta = job.layout.meta
    return _array_type().on_copy(job.segment, job.view, job.path, job.seconds, meta)


def __getattr__(name):
    if name == "SharedArray":
        return _array_type()
    raise AttributeError(f"module 'mpistage.data' has no attribute {name!r}")


class SharedBuffer:
    """The bytes of one file: this node's read-only copy, in MPI shared memory.

    :attr:`view` is a read-only memoryview (format ``'B'``) of memory that
    every rank of the node maps. :meth:`close` is collective; ``with``
    closes at the end of the block. Views taken from :attr:`view` stay
    valid after that: the node's memory is freed only once no rank of the
    node holds any view of it. :attr:`seconds` holds this rank's time in
    each step (open, allocate, read, broadcast).
    """

    def __init__(self, segment, view, path, seconds):
        self._segment, self._view = segment, view
        self.path, self.nbytes, self.seconds = path, len(view), dict(seconds)
        self.closed = False

    @property
    def view(self):
        """The read-only memoryview of this node's copy."""
        self._check_open()
        return self._view

    def __len__(self):
        return self.nbytes

    def __buffer__(self, flags):
        """Export :attr:`view` (Python 3.12+: ``memoryview(buf)``, ``bytes(buf)``)."""
        return self.view.__buffer__(flags)

    def close(self):
        """Let go of the node's copy; collective over the ranks of the node.

        The memory is freed here if no rank of the node holds a view of it
        any more, else as soon as none does. Calling it again does nothing.
        """
        if self.closed:
            return
        segment = self._forget()
        if segment is not None:
            _sweep(segment.node)

    def __enter__(self):
        self._check_open()
        return self

    def __exit__(self, exc_type, exc, tb):
        # An exception may be this rank's alone: a collective call now could
        # wait forever for the other ranks, so only let go locally.
        if exc_type is None:
            self.close()
        else:
            self._forget()

    def __repr__(self):
        state = "closed" if self.closed else "open"
        name = type(self).__name__
        return f"<{name} {self.path!r} {self.nbytes} bytes, {state}>"

    def _forget(self):
        """Drop this object's references to the copy; return its segment."""
        segment, self._segment, self._view = self._segment, None, None
        self.closed = True
        return segment

    def _check_open(self):
        if self.closed:
            raise ValueError(f"the shared copy of {self.path!r} is closed")


_ARRAY_TYPE = []  # the SharedArray class, made with numpy on first use


def _array_type():
    """Return :class:`SharedArray`, a ``numpy.ndarray`` subclass (imports numpy)."""
    if not _ARRAY_TYPE:
        _ARRAY_TYPE.append(_make_array_type())
    return _ARRAY_TYPE[0]


def _make_array_type():
    """Define :class:`SharedArray` on top of ``numpy.ndarray``."""
    import numpy

    class SharedArray(numpy.ndarray):
        """An array stored in one file: this node's read-only copy, an ndarray.

        It *is* a read-only ``numpy.ndarray`` on the node's shared memory:
        ``numpy.asarray``, ``.shape``, indexing and methods work as on any
        array. Results of arithmetic are ordinary arrays of their own.
        :meth:`close` (collective) and ``with`` let go of the copy; the
        memory is freed once no rank of the node holds any view of it
        (this array, its slices, ``numpy.asarray`` of it) any more.
        :attr:`path` and :attr:`seconds` are those of :class:`SharedBuffer`.
        """

        @classmethod
        def on_copy(cls, segment, view, path, seconds, meta):
            """Return the array of *meta* (dtype, shape, Fortran order) on *view*."""
            dtype, shape, fortran = meta
            # frombuffer keeps the read-only memoryview as the base: numpy then
            # refuses ``flags.writeable = True``.
            flat = numpy.frombuffer(view, dtype)
            array = flat.reshape(shape, order="F" if fortran else "C").view(cls)
            array.flags.writeable = False
            array._copy = _Copy(segment, path, seconds)
            return array

        def __array_finalize__(self, obj):
            self._copy = getattr(obj, "_copy", None)

        def __array_wrap__(self, array, context=None, return_scalar=False):
            if return_scalar:
                return array[()]
            return array.view(numpy.ndarray)

        @property
        def path(self):
            """The data file's path."""
            return self._copy.path if self._copy else None

        @property
        def seconds(self):
            """This rank's seconds in each step (open, allocate, read, broadcast)."""
            return dict(self._copy.seconds) if self._copy else {}

        @property
        def closed(self):
            """Whether :meth:`close` was called."""
            return self._copy is None or self._copy.closed

        @property
        def array(self):
            """The same array, as a plain ``numpy.ndarray``."""
            return self.view(numpy.ndarray)

        def close(self):
            """Let go of the node's copy; collective over the ranks of the node."""
            if self._copy is not None:
                self._copy.close()

        def __enter__(self):
            return self

        def __exit__(self, exc_type, exc, tb):
            if self._copy is not None:
                self._copy.leave(exc_type is None)

    SharedArray.__module__, SharedArray.__qualname__ = __name__, "SharedArray"
    return SharedArray


class _Copy:
    """What a :class:`SharedArray` and the views made from it share: the copy."""

    def __init__(self, segment, path, seconds):
        self.segment, self.path, self.seconds = segment, path, dict(seconds)
        self.closed = False

    def close(self):
        """Let go of the copy (collective on the node); the memory goes unused."""
        self.leave(True)

    def leave(self, collective):
        """Forget the segment; free unused copies if *collective*."""
        if self.closed:
            return
        segment, self.segment, self.closed = self.segment, None, True
        if segment is not None and collective:
            _sweep(segment.node)


# -- the steps, run by every rank -----------------------------------------------


def _share(comm, path, readers, io, locate, more):
    """Run the collective steps; return the finished :class:`_Job`.

    *more* are the other arguments of the call, as (name, value) pairs,
    which every rank must pass alike too.
    """
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    from mpistage import load_runtime

    load_runtime(comm)
    from mpistage.runtime.collective import attempt
    from mpistage.runtime.topology import discover

    path = attempt(comm, _check_args, path, readers, io, comm.size)
    given = (("path", path), ("readers", readers), ("io", io)) + tuple(more)
    attempt(comm, _same_everywhere, comm, tuple((k, repr(v)) for k, v in given))
    job = _Job(comm, attempt(comm, discover, comm), path, readers, io)
    try:
        _sweep(job.topo.node)
        _run(job, locate)
    finally:
        job.close()
    return job


def _run(job, locate):
    """Open, check, allocate, fill; set the job's segment and view."""
    from mpistage.runtime.collective import attempt

    attempt(job.comm, _open, job, locate)
    job.layout = job.comm.bcast(job.layout, root=0)
    attempt(job.comm, _prepare, job)
    if job.io == "mpiio":
        job.split_readers()
        attempt(job.comm, _open_mpiio, job)
    job.mark("open")
    if job.layout.length == 0:
        job.view = memoryview(b"").toreadonly()
        return
    job.segment = attempt(job.comm, _Segment, job.topo.node, job.layout.length)
    job.mark("allocate")
    try:
        _fill(job, job.segment)
    except StageError:
        job.segment.free()  # every rank got this error from the same agreement
        raise
    job.view = job.segment.readonly()


def _fill(job, segment):
    """Readers fill their parts, leaders exchange them; then all ranks see all."""
    from mpistage.runtime.collective import attempt

    with segment.memory() as memory:
        attempt(job.comm, _read_part, job, memory)
        segment.sync()
        job.mark("read")
        _spread(job, memory)
        segment.sync()
        job.mark("broadcast")


def _check_args(path, readers, io, ranks):
    """Check the arguments (every rank, the same way); return the path as str."""
    try:
        path = _os.fspath(path)
    except TypeError:
        raise StageError(f"path {path!r} is no str or os.PathLike") from None
    if isinstance(readers, bool) or not isinstance(readers, int):
        raise StageError(f"readers={readers!r} must be a whole number")
    if not 1 <= readers <= ranks:
        raise StageError(
            f"readers={readers!r} must be from 1 to the number of ranks ({ranks})"
        )
    if io not in IO_METHODS:
        raise StageError(f"io={io!r}: use 'posix' or 'mpiio'")
    return path


def _same_everywhere(comm, given):
    """Raise unless every rank of *comm* passed the arguments rank 0 passed.

    *given* holds (name, repr of the value) pairs, the same on all ranks
    of a correct program. A collective call with other arguments on some
    ranks would mix files or hang.
    """
    theirs = comm.bcast(given if comm.rank == 0 else None, root=0)
    for (name, value), (_, first) in zip(given, theirs, strict=True):
        if value != first:
            raise StageError(
                f"the ranks' arguments differ: {name}={first} on rank 0, "
                f"{name}={value} on rank {comm.rank}; every rank must pass the same"
            )


def _dtype_name(dtype):
    """Return a name for *dtype* that is the same however it was spelled."""
    if dtype is None:
        return None
    try:
        import numpy

        return numpy.dtype(dtype).str
    except Exception:  # noqa: BLE001  (refused with its reason later)
        return repr(dtype)


class _Job:
    """One collective read on one rank: communicators, role, file, layout."""

    def __init__(self, comm, topo, path, readers, io):
        self.comm, self.topo, self.path, self.io = comm, topo, path, io
        self.slots = _reader_slots(topo, readers)
        here = (topo.index, topo.node.rank)
        self.slot = self.slots.index(here) if here in self.slots else None
        self.fd = self.size = self.layout = self.segment = self.view = None
        self.identity = None
        self.rcomm = self.file = None
        self.seconds, self.last = {}, _time.perf_counter()

    def mark(self, step):
        """Note the seconds since the previous mark as *step*'s."""
        now = _time.perf_counter()
        self.seconds[step], self.last = now - self.last, now

    def part(self, slot=None):
        """Return the file offsets [lo, hi) that reader *slot* reads."""
        slot = self.slot if slot is None else slot
        start, length, k = self.layout.start, self.layout.length, len(self.slots)
        return start + slot * length // k, start + (slot + 1) * length // k

    def split_readers(self):
        """Make the communicator of the readers, for MPI-IO (collective)."""
        from mpi4py import MPI

        color = MPI.UNDEFINED if self.slot is None else 0
        self.rcomm = self.comm.Split(color, self.slot or 0)

    def close(self):
        """Close the file and free the communicators this job made."""
        if self.fd is not None:
            _os.close(self.fd)
        if self.file is not None:
            self.file.Close()
        if self.segment is None:
            _free_comm(self.topo.node)  # else the segment owns it
        _free_comm(self.topo.leaders)
        _free_comm(self.rcomm)


def _free_comm(comm):
    """Free *comm* unless it is ``None`` or the null communicator."""
    from mpi4py import MPI

    if comm is not None and comm != MPI.COMM_NULL:
        comm.Free()


def _reader_slots(topo, readers):
    """Return the (node index, node rank) of each reader: nodes first, then ranks.

    Reader 0 is rank 0 of *comm*, the leader of node 0; with no more readers
    than nodes every reader is a node leader.
    """
    import itertools

    sizes = topo.leaders.allgather(topo.node.size) if topo.is_leader else None
    sizes = topo.node.bcast(sizes, root=0)
    slots = (
        (node, rank)
        for rank in range(max(sizes))
        for node, size in enumerate(sizes)
        if rank < size
    )
    return list(itertools.islice(slots, readers))


def _open(job, locate):
    """Readers open the file; the first one also finds the data's layout."""
    if job.slot is None or (job.io == "mpiio" and job.slot != 0):
        return
    job.fd, job.size, job.identity = _open_file(job.path)
    if job.slot == 0:
        job.layout = locate(job.path, job.fd, job.size)
        job.layout.identity = job.identity


def _open_file(path):
    """Open the regular file *path* for reading; return (fd, size, identity)."""
    from mpistage.runtime.read import open_regular

    fd = open_regular(path, "data file")
    st = _os.fstat(fd)
    return fd, st.st_size, (st.st_ino, st.st_size, st.st_mtime_ns)


def _prepare(job):
    """Other readers check they see the file the first saw; leaders check room."""
    if job.fd is not None and job.slot != 0:
        _check_size(job, job.size)
        if job.identity != job.layout.identity:
            raise StageError(
                f"data file {job.path!r} is not the same file on every reader "
                "(it was replaced, or the path names another file on this node)"
            )
    if job.topo.is_leader:
        _check_room(job.path, job.layout.length, job.topo.index)


def _check_size(job, size):
    """Raise if the file no longer has the size the first reader saw."""
    if size != job.layout.size:
        _changed(job, size)


def _changed(job, size):
    """Raise: the file changed size (now *size* bytes) while being read."""
    raise StageError(
        f"data file {job.path!r} changed size while being read: "
        f"{job.layout.size} bytes, then {size}"
    )


def _check_room(path, need, node):
    """Refuse a copy larger than this node's free memory, before allocating it."""
    room, what = _node_room()
    if room is not None and need > room:
        raise StageError(
            f"data file {path!r} needs {_size(need)}, more than the {_size(room)} "
            f"of {what} on node {node}"
        )


def _node_room():
    """Return (bytes, what) a node copy may take: MemAvailable, or /dev/shm's room.

    MPICH backs shared windows with files in /dev/shm, a tmpfs that may be
    smaller than the memory; touching a page past its limit kills with SIGBUS.
    """
    rooms = []
    try:
        with open("/proc/meminfo") as f:
            kib = next(
                line.split()[1] for line in f if line.startswith("MemAvailable:")
            )
        rooms.append((int(kib) * 1024, "free memory (MemAvailable)"))
    except (OSError, StopIteration, ValueError):
        pass  # no /proc (not Linux): nothing to check against
    try:
        st = _os.statvfs("/dev/shm")
        rooms.append((st.f_bavail * st.f_frsize, "free space in /dev/shm"))
    except OSError:
        pass
    return min(rooms, default=(None, None))


def _size(n):
    """Format a byte count for a message."""
    return f"{n} bytes ({n / 2**30:.1f} GiB)"


def _open_mpiio(job):
    """Readers open the file with MPI-IO and the aggregator hints (collective)."""
    if job.slot is None:
        return
    from mpi4py import MPI

    info = MPI.Info.Create()
    try:
        for key, value in {**MPIIO_HINTS, "cb_nodes": str(job.rcomm.size)}.items():
            info.Set(key, value)
        job.file = MPI.File.Open(job.rcomm, job.path, MPI.MODE_RDONLY, info)
    except MPI.Exception as exc:
        reason = exc.Get_error_string().splitlines()[0]
        raise StageError(f"cannot read data file {job.path!r}: {reason}") from None
    finally:
        info.Free()
    _check_size(job, job.file.Get_size())


def _read_part(job, memory):
    """Read this reader's part into its node's copy; check the size after."""
    if job.slot is None:
        return
    lo, hi = job.part()
    if job.io == "mpiio":
        _read_mpiio(job, memory, lo, hi)
        _check_size(job, job.file.Get_size())
    else:
        _read_posix(job, memory, lo, hi)
        _check_size(job, _os.fstat(job.fd).st_size)


def _read_posix(job, memory, lo, hi):
    """Read [lo, hi) with plain reads of at most :data:`READ_SIZE` bytes."""
    base, step, done = job.layout.start, max(1, int(READ_SIZE)), lo
    while done < hi:
        end = min(hi, done + step)
        n = _os.preadv(job.fd, [memory[done - base : end - base]], done)
        if n == 0:
            _changed(job, _os.fstat(job.fd).st_size)
        done += n


def _read_mpiio(job, memory, lo, hi):
    """Read [lo, hi) with ``Read_at_all``; every reader makes as many calls."""
    from mpi4py import MPI

    base, step = job.layout.start, max(1, int(READ_SIZE))
    widest = max(b - a for a, b in map(job.part, range(len(job.slots))))
    short = False
    for offset in range(0, widest, step):
        a, b = min(hi, lo + offset), min(hi, lo + offset + step)
        status = MPI.Status()
        job.file.Read_at_all(a, [memory[a - base : b - base], MPI.BYTE], status)
        short |= status.Get_count(MPI.BYTE) != b - a
    if short:  # only now: raising between collective calls would hang the rest
        _changed(job, job.file.Get_size())


def _spread(job, memory):
    """Leaders: send each part from its reader's node to every other node."""
    from mpistage.runtime.broadcast import chunks

    if not job.topo.is_leader or job.topo.count == 1:
        return
    base = job.layout.start
    for slot, (node, _) in enumerate(job.slots):
        lo, hi = job.part(slot)
        chunks(job.topo.leaders, memory[lo - base : hi - base], root=node)


# -- where the bytes are: whole file, .npy, .npz member, raw --------------------


class _Layout:
    """Where the data is in the file, and what array it makes (if any)."""

    def __init__(self, start, length, size, meta=None):
        self.start, self.length, self.size, self.meta = start, length, size, meta
        self.identity = None


def _whole(path, fd, size):
    """The whole file, as bytes."""
    return _Layout(0, size, size)


def _locator(member, dtype, shape, order, offset):
    """Return the function that finds the array in the file (on the first reader)."""

    def locate(path, fd, size):
        if dtype is not None:
            return _raw(path, size, dtype, shape, order, offset)
        if shape is not None:
            raise StageError("shape= needs dtype= (a raw file)")
        if member is not None or path.endswith(".npz"):
            return _npz(path, fd, size, member)
        return _npy(path, fd, 0, size, size)

    return locate


def _raw(path, size, dtype, shape, order, offset):
    """A raw file of *dtype* items from byte *offset* on."""
    import math

    import numpy

    try:
        dtype = numpy.dtype(dtype)
    except TypeError as exc:
        raise StageError(f"dtype={dtype!r}: {_one_line(exc)}") from None
    if order not in ("C", "F"):
        raise StageError(f"order={order!r}: use 'C' or 'F'")
    if not 0 <= offset <= size:
        raise StageError(f"offset={offset!r} is outside {path!r} ({size} bytes)")
    have = size - offset
    if shape is None:
        shape = (have // max(1, dtype.itemsize),)
    shape = (shape,) if isinstance(shape, int) else tuple(map(int, shape))
    need = math.prod(shape) * dtype.itemsize
    if need != have:
        raise StageError(
            f"raw file {path!r} has {have} bytes after offset {offset}; "
            f"shape {shape} of {dtype} needs {need}"
        )
    return _Layout(offset, need, size, (dtype, shape, order == "F"))


def _npy(path, fd, base, end, size):
    """The .npy stored in bytes [base, end) of the file."""
    import math

    from numpy.lib import format as fmt

    with open(fd, "rb", closefd=False) as f:
        f.seek(base)
        try:
            version = fmt.read_magic(f)
            shape, fortran, dtype = _header_reader(fmt, version)(f)
        except Exception as exc:  # noqa: BLE001  (numpy raises several kinds)
            raise StageError(f"{path!r} is no .npy file: {_one_line(exc)}") from None
        start = f.tell()
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape):
        raise StageError(f"{path!r} is no .npy file: bad shape {shape!r}")
    if dtype.hasobject:
        raise StageError(
            f"{path!r} holds Python objects (dtype {dtype}), which only "
            "numpy.load(allow_pickle=True) reads"
        )
    length = math.prod(shape) * dtype.itemsize
    if start + length > end:
        raise StageError(
            f"{path!r} is truncated: its array needs {length} bytes after the "
            f"header, {max(0, end - start)} are there"
        )
    return _Layout(start, length, size, (dtype, shape, fortran))


def _header_reader(fmt, version):
    """Return the numpy function that reads a header of format *version*."""
    public = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}
    if version in public:
        return public[version]
    return lambda f: fmt._read_array_header(f, version)


def _npz(path, fd, size, member):
    """The .npy of a stored (uncompressed) member of a .npz file."""
    import struct
    import zipfile

    with open(fd, "rb", closefd=False) as f:
        try:
            with zipfile.ZipFile(f) as archive:
                info = _member(path, archive, member)
        except zipfile.BadZipFile as exc:
            raise StageError(f"{path!r} is no .npz file: {exc}") from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise StageError(
            f"member {member!r} of {path!r} is compressed: mpistage.data reads "
            "stored members only (numpy.savez, not numpy.savez_compressed)"
        )
    local = _os.pread(fd, 30, info.header_offset)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise StageError(f"{path!r} is no .npz file: bad header of {member!r}")
    names, extra = struct.unpack("<HH", local[26:30])
    base = info.header_offset + 30 + names + extra
    label = f"{path}[{member}]"
    return _npy(label, fd, base, base + info.file_size, size)


def _member(path, archive, member):
    """Return the ZipInfo of *member* (with or without ``.npy``)."""
    names = [n.removesuffix(".npy") for n in archive.namelist()]
    if member is None:
        raise StageError(f"{path!r} holds {names!r}: choose one with member=")
    for name in (member, f"{member}.npy"):
        try:
            return archive.getinfo(name)
        except KeyError:
            pass
    raise StageError(f"{path!r} has no member {member!r}; it holds {names!r}")


def _one_line(exc):
    """Return the message of *exc* on one line."""
    return " ".join(str(exc).split())


# -- the node copies: MPI shared-memory windows ---------------------------------


class _Segment:
    """One node's copy: an MPI shared-memory window, allocated by the leader.

    The leader allocates all the bytes, the other ranks none; every rank
    maps the leader's memory (``Shared_query(0)``). The window owns the node
    communicator: both are freed together, collectively on the node.
    """

    def __init__(self, node, size):
        from mpi4py import MPI

        self.node, self.alive = node, None
        self.win = MPI.Win.Allocate_shared(size if node.rank == 0 else 0, 1, comm=node)
        self.win.Lock_all(MPI.MODE_NOCHECK)  # for Sync: load/store access only
        _SEGMENTS.append(self)

    def memory(self):
        """Return a writable memoryview of the node's copy (for filling it)."""
        return memoryview(self.win.Shared_query(0)[0])

    def readonly(self):
        """Return a read-only view that keeps this copy in use while it lives.

        The view exports a ctypes block at the window's address; a weak
        reference to the block tells :func:`_sweep` when no view is left.
        """
        import ctypes
        import weakref

        buf, _ = self.win.Shared_query(0)
        block = type("SharedBlock", (ctypes.c_ubyte * len(buf),), {})
        block = block.from_address(buf.address)
        self.alive = weakref.ref(block)
        return memoryview(block).cast("B").toreadonly()

    def in_use(self):
        """Whether some view of this copy still lives on this rank."""
        return self.alive is not None and self.alive() is not None

    def sync(self):
        """Make the node's writes visible to all its ranks (collective, sleeping)."""
        from mpistage.runtime.collective import barrier

        self.win.Sync()
        barrier(self.node)
        self.win.Sync()

    def free(self):
        """Free the window and the node communicator (collective on the node)."""
        _SEGMENTS.remove(self)
        self.win.Unlock_all()
        self.win.Free()
        self.node.Free()


def _sweep(node):
    """Free the copies that no rank of *node* uses any more (collective on it).

    Only copies made on a communicator congruent to *node* are considered:
    exactly those ranks are here, and each holds the same list of them.
    """
    from array import array

    from mpi4py import MPI

    from mpistage.runtime.collective import wait

    same = (MPI.IDENT, MPI.CONGRUENT)
    mine = [s for s in _SEGMENTS if s.node.Compare(node) in same]
    if not mine:
        return
    unused = array("i", [not s.in_use() for s in mine])
    wait(node.Iallreduce(MPI.IN_PLACE, [unused, MPI.INT], op=MPI.MIN))
    for segment, free in zip(mine, unused, strict=True):
        if free:
            segment.free()


@_atexit.register
def _free_all():
    """At exit, free every copy left, in the order they were made (collective).

    It runs before mpi4py finalizes MPI (mpi4py does that after the atexit
    handlers), and only if MPI still runs.
    """
    mpi = _sys.modules.get("mpi4py.MPI")
    if not _SEGMENTS or mpi is None or mpi.Is_finalized() or _os.getpid() != _PID:
        return
    for segment in list(_SEGMENTS):
        segment.free()
