"""The collective steps of :mod:`mpistage.data`, run by every rank.

arguments → topology → open → room → allocate → read → broadcast → view;
each step ends with an agreement of all ranks (see the package docstring).
"""

import os as _os
import time as _time

from mpistage import StageError
from mpistage.data.segments import Segment, sweep

IO_METHODS = ("posix", "mpiio")
MPIIO_HINTS = {
    "romio_cb_read": "enable",
    "romio_no_indep_rw": "true",
    "romio_ds_read": "disable",
    "cb_config_list": "*:*",
    "cb_buffer_size": str(16 << 20),
}


def share(comm, path, readers, io, locate, more):
    """Run the collective steps; return the finished :class:`Job`.

    *more* are the other arguments of the call, as (name, value) pairs,
    which every rank must pass alike too.
    """
    from mpistage.runtime.collective import attempt
    from mpistage.runtime.topology import discover

    path = attempt(comm, check_args, path, readers, io, comm.size)
    given = (("path", path), ("readers", readers), ("io", io)) + tuple(more)
    attempt(comm, same_everywhere, comm, tuple((k, repr(v)) for k, v in given))
    job = Job(comm, attempt(comm, discover, comm, True), path, readers, io)
    try:
        sweep(job.topo.node)
        run(job, locate)
    finally:
        job.close()
    return job


def run(job, locate):
    """Open, check, allocate, fill; set the job's segment and view."""
    from mpistage.runtime.collective import attempt

    attempt(job.comm, open_readers, job, locate)
    job.layout = job.comm.bcast(job.layout, root=0)
    attempt(job.comm, prepare, job)
    if job.io == "mpiio":
        job.split_readers()
        attempt(job.comm, open_mpiio, job)
    job.mark("open")
    if job.layout.length == 0:
        job.view = memoryview(b"").toreadonly()
        return
    job.segment = attempt(job.comm, Segment, job.topo.node, job.layout.length)
    job.mark("allocate")
    try:
        fill(job, job.segment)
    except StageError:
        job.segment.free()  # every rank got this error from the same agreement
        raise
    job.view = job.segment.readonly()


def fill(job, segment):
    """Readers fill their parts, leaders exchange them; then all ranks see all.

    A reader that leads its node (and reads with plain reads) reads its
    part as the leaders broadcast it, in one pass (:func:`spread`); other
    readers read theirs first.
    """
    from mpistage.runtime.collective import attempt

    with segment.memory() as memory:
        attempt(job.comm, read_part, job, memory)
        segment.sync()
        job.mark("read")
        attempt(job.comm, spread, job, memory)
        segment.sync()
        job.mark("broadcast")


def check_args(path, readers, io, ranks):
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


def same_everywhere(comm, given):
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


def dtype_name(dtype):
    """Return a name for *dtype* that is the same however it was spelled."""
    if dtype is None:
        return None
    try:
        import numpy

        return numpy.dtype(dtype).str
    except Exception:  # noqa: BLE001  (refused with its reason later)
        return repr(dtype)


class Job:
    """One collective read on one rank: communicators, role, file, layout."""

    def __init__(self, comm, topo, path, readers, io):
        self.comm, self.topo, self.path, self.io = comm, topo, path, io
        self.slots = reader_slots(topo, readers)
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
            free_comm(self.topo.node)  # else the segment owns it
        free_comm(self.topo.leaders)
        free_comm(self.rcomm)


def free_comm(comm):
    """Free *comm* unless it is ``None`` or the null communicator."""
    from mpi4py import MPI

    if comm is not None and comm != MPI.COMM_NULL:
        comm.Free()


def reader_slots(topo, readers):
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


def open_readers(job, locate):
    """Readers open the file; the first one also finds the data's layout."""
    if job.slot is None or (job.io == "mpiio" and job.slot != 0):
        return
    job.fd, job.size, job.identity = open_file(job.path)
    if job.slot == 0:
        job.layout = locate(job.path, job.fd, job.size)
        job.layout.identity = job.identity


def open_file(path):
    """Open the regular file *path* for reading; return (fd, size, identity)."""
    from mpistage.runtime.read import open_regular

    fd = open_regular(path, "data file")
    st = _os.fstat(fd)
    return fd, st.st_size, (st.st_ino, st.st_size, st.st_mtime_ns)


def prepare(job):
    """Other readers check they see the file the first saw; leaders check room."""
    if job.fd is not None and job.slot != 0:
        check_size(job, job.size)
        if job.identity != job.layout.identity:
            raise StageError(
                f"data file {job.path!r} is not the same file on every reader "
                "(it was replaced, or the path names another file on this node)"
            )
    if job.topo.is_leader:
        check_room(job.path, job.layout.length, job.topo.index)


def check_size(job, size):
    """Raise if the file no longer has the size the first reader saw."""
    if size != job.layout.size:
        changed(job, size)


def changed(job, size):
    """Raise: the file changed size (now *size* bytes) while being read."""
    raise StageError(
        f"data file {job.path!r} changed size while being read: "
        f"{job.layout.size} bytes, then {size}"
    )


def check_room(path, need, node):
    """Refuse a copy larger than this node's free memory, before allocating it."""
    room, what = node_room()
    if room is not None and need > room:
        raise StageError(
            f"data file {path!r} needs {size_text(need)}, more than the "
            f"{size_text(room)} of {what} on node {node}"
        )


def node_room():
    """Return (bytes, what) a node copy may take: MemAvailable, or /dev/shm's room.

    MPICH backs shared windows with files in /dev/shm, a tmpfs that may be
    smaller than the memory; touching a page past its limit kills with SIGBUS.
    """
    from mpistage.node.place import RAM_DISK

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
        st = _os.statvfs(RAM_DISK)
        rooms.append((st.f_bavail * st.f_frsize, f"free space in {RAM_DISK}"))
    except OSError:
        pass
    return min(rooms, default=(None, None))


def size_text(n):
    """Format a byte count for a message."""
    return f"{n} bytes ({n / 2**30:.1f} GiB)"


def open_mpiio(job):
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
    check_size(job, job.file.Get_size())


def read_part(job, memory):
    """Read this reader's part into its node's copy; check the size after.

    A reader whose part is read as it is broadcast (:func:`streams`)
    reads it in :func:`spread` instead.
    """
    if job.slot is None or streams(job):
        return
    lo, hi = job.part()
    if job.io == "mpiio":
        read_mpiio(job, memory, lo, hi)
        check_size(job, job.file.Get_size())
    else:
        read_posix(job, memory, lo, hi)
        check_size(job, _os.fstat(job.fd).st_size)


def streams(job):
    """Whether this rank reads its part while the leaders broadcast it.

    A reader that leads its node, with plain reads, when there are other
    nodes to send to.
    """
    return (
        job.slot is not None
        and job.io == "posix"
        and job.topo.is_leader
        and job.topo.count > 1
    )


def read_posix(job, memory, lo, hi):
    """Read [lo, hi) into the node's copy with plain reads."""
    base = job.layout.start
    read_posix_into(job, memory[lo - base : hi - base], lo)


def read_mpiio(job, memory, lo, hi):
    """Read [lo, hi) with ``Read_at_all``; every reader makes as many calls."""
    from mpi4py import MPI

    from mpistage.runtime import read

    base, step = job.layout.start, max(1, int(read.READ_SIZE))
    widest = max(b - a for a, b in map(job.part, range(len(job.slots))))
    short = False
    for offset in range(0, widest, step):
        a, b = min(hi, lo + offset), min(hi, lo + offset + step)
        status = MPI.Status()
        job.file.Read_at_all(a, [memory[a - base : b - base], MPI.BYTE], status)
        short |= status.Get_count(MPI.BYTE) != b - a
    if short:  # only now: raising between collective calls would hang the rest
        changed(job, job.file.Get_size())


def spread(job, memory):
    """Leaders: send each part from its reader's node to every other node.

    Each part goes in one pass (:func:`mpistage.runtime.broadcast.stream`):
    pieces land straight in every node's copy; a part whose reader leads
    its node is sent piece by piece as it is read, and such readers all
    start reading at once, each on a thread of its own.
    """
    from mpistage.runtime.broadcast import stream

    if not job.topo.is_leader or job.topo.count == 1:
        return
    base = job.layout.start
    ahead = Ahead(job, memory) if streams(job) else None
    try:
        for slot, (node, _) in enumerate(job.slots):
            lo, hi = job.part(slot)

            def place(start, end, lo=lo):
                return memory[lo - base + start : lo - base + end]

            mine = ahead is not None and slot == job.slot
            fill = ahead.wait if mine else None
            stream(job.topo.leaders, hi - lo, fill, (), place, root=node)
        if ahead is not None:
            check_size(job, _os.fstat(job.fd).st_size)
    finally:
        if ahead is not None:
            ahead.stop()


class Ahead:
    """A leader's own part, read ahead on a thread while other parts travel."""

    def __init__(self, job, memory):
        from mpistage.runtime.broadcast import Worker
        from mpistage.runtime.bulk import spans

        self.lo, hi = job.part()
        base = job.layout.start
        self.worker = Worker(lambda start, view: read_posix_into(job, view, start))
        self.tickets = {}
        for start, end in spans(hi - self.lo):
            view = memory[self.lo - base + start : self.lo - base + end]
            self.tickets[start] = self.worker.submit(self.lo + start, view)

    def wait(self, start, view):
        """The piece at *start* of this part is read (else raise why not)."""
        from mpistage.runtime.broadcast import wait_ticket

        wait_ticket(self.tickets.pop(start, None))
        if self.worker.error is not None:
            raise self.worker.error

    def stop(self):
        """Stop reading: the thread has ended on return."""
        self.worker.stop()


def read_posix_into(job, view, offset):
    """Read the file's bytes at *offset* into all of *view*.

    In reads of at most ``read.READ_SIZE`` bytes; a file that ends early
    changed while being read.
    """
    from mpistage.runtime import read

    step, done = max(1, int(read.READ_SIZE)), 0
    while done < len(view):
        n = _os.preadv(job.fd, [view[done : done + step]], offset + done)
        if n == 0:
            changed(job, _os.fstat(job.fd).st_size)
        done += n
