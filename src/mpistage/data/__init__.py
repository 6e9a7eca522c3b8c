"""Shared data files: read once per job, one copy per node, mapped by every rank.

::

    from mpistage import data
    with data.read("/scratch/big.bin", comm=comm) as buf:  # a SharedBuffer
        digest = hashlib.sha256(buf).hexdigest()  # bytes-like, read-only
    weights = data.load("/scratch/weights.npy", comm=comm)  # a read-only ndarray
    with data.staged_dir("/scratch/model", comm=comm) as local:  # a node-local path
        model = from_pretrained(local)
    tensors = data.tensors("/scratch/model", comm=comm)  # safetensors, as arrays

``staged_dir`` and ``tensors`` copy directories and safetensors
checkpoints into a node's place (:mod:`~mpistage.data.dirs`,
:mod:`~mpistage.data.weights`). ``read`` and ``load``, the two calls
described here, are collective over *comm* and run the same steps on every rank
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
- broadcast: the leaders pass the parts on to each other on the bulk path
  (:func:`mpistage.runtime.bulk.bcast`), as raw pieces of
  :func:`mpistage.runtime.bulk.step` bytes, never pickled;
- view: every rank gets a read-only view of its node's copy.

Each step ends with an agreement of all ranks, so a bad input raises the same
one-line :class:`~mpistage.StageError` on every rank instead of hanging the
job. The node's memory is freed once no rank of the node holds a view of it
any more: at :meth:`SharedBuffer.close`, at a later call of this module on
the same ranks, or at interpreter exit, always before MPI is finalized.
"""

import sys as _sys

__all__ = [  # noqa: F822 (lazy)
    "SharedArray",
    "SharedBuffer",
    "StagedDir",
    "load",
    "read",
    "staged_dir",
    "tensors",
]


NODE_MODULES = ("__init__", "launch", "place", "cleanup")

# -- the public API -------------------------------------------------------------


def read(path, comm=None, *, readers=1, io="posix"):
    """Return the bytes of the file *path* as a :class:`SharedBuffer` (collective).

    *readers* ranks open and read the file (one by default), through plain
    reads (``io="posix"``) or MPI-IO collective reads (``io="mpiio"``).
    """
    comm = _load(comm)
    from mpistage.data import layouts, steps

    job = steps.share(comm, path, readers, io, layouts.whole, ())
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
    comm = _load(comm)
    from mpistage.data import arrays, layouts, steps

    locate = layouts.locator(member, dtype, shape, order, offset)
    more = (("member", member), ("dtype", steps.dtype_name(dtype)), ("shape", shape))
    more += (("order", order), ("offset", offset))
    job = steps.share(comm, path, readers, io, locate, more)
    meta = job.layout.meta
    array = arrays.array_type()
    return array.on_copy(job.segment, job.view, job.path, job.seconds, meta)


def staged_dir(path, comm=None, *, include=None):
    """Stage the directory *path* once per node; return a :class:`StagedDir`.

    Collective. Rank 0 reads every file below *path* (those matching the
    glob patterns *include*, if given) once, the files travel as one stream
    to each node leader, which writes them into the node's copy. ``with
    staged_dir(path) as local:`` gives on every rank the node-local path
    of the same tree; the copy is removed when the block ends.
    """
    comm = _load(comm)
    from mpistage import preload

    preload(comm, "mpistage.node", NODE_MODULES)  # the leaders' place rules
    from mpistage.data import dirs

    return dirs.stage(comm, path, include)


def tensors(path, comm=None, *, framework="np"):
    """Return the tensors of a safetensors checkpoint, one copy per node (collective).

    *path* is a ``.safetensors`` file, or a directory with an index
    (``model.safetensors.index.json``; or one ``model.safetensors``). The
    files are staged once per node, their headers checked on rank 0, and
    every rank gets a :class:`~mpistage.data.weights.Tensors` dict of
    read-only numpy arrays (``framework="pt"``: torch tensors) that view
    the node's copy.
    """
    comm = _load(comm)
    from mpistage import preload

    preload(comm, "mpistage.node", NODE_MODULES)
    from mpistage.data import weights

    return weights.load(comm, path, framework)


def _load(comm):
    """Return *comm* (default: world); load this package's steps on its ranks.

    Rank 0 reads the modules of this package and of the runtime and
    broadcasts them (:func:`mpistage.preload`): the other ranks import them
    from memory, never from the shared file system.
    """
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    from mpistage import load_runtime, preload

    load_runtime(comm)
    preload(comm, __name__)
    return comm


def __getattr__(name):
    if name == "SharedArray":
        from mpistage.data.arrays import array_type

        return array_type()
    if name == "StagedDir":
        from mpistage.data.dirs import StagedDir

        return StagedDir
    if name in ("IO_METHODS", "MPIIO_HINTS"):
        from mpistage.data import steps

        return getattr(steps, name)
    raise AttributeError(f"module 'mpistage.data' has no attribute {name!r}")


def _exporting():
    """The base of :class:`SharedBuffer`: one that exports a buffer (before 3.12)."""
    if _sys.version_info >= (3, 12):
        return object  # __buffer__ does it
    from mpistage.data.exports import exporter

    return exporter()


class SharedBuffer(_exporting()):
    """The bytes of one file: this node's read-only copy, in MPI shared memory.

    It is bytes-like: ``bytes(buf)``, ``hashlib.sha256(buf)``,
    ``numpy.frombuffer(buf)`` read the copy, read-only, on every supported
    Python. :attr:`view` is a read-only memoryview (format ``'B'``) of memory
    that every rank of the node maps. :meth:`close` is collective; ``with``
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

    def _export(self):
        """What the buffer slot exports before Python 3.12 (:mod:`.exports`)."""
        return self.view

    def close(self):
        """Let go of the node's copy; collective over the ranks of the node.

        The memory is freed here if no rank of the node holds a view of it
        any more, else as soon as none does. Calling it again does nothing.
        """
        if self.closed:
            return
        segment = self._forget()
        if segment is not None:
            from mpistage.data.segments import sweep

            sweep(segment.node)

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
