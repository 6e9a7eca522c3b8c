"""``SharedArray``: what :func:`mpistage.data.load` returns, a numpy array.

The class is made on first use, when numpy is imported: ``import
mpistage.data`` itself never imports numpy.
"""

ARRAY_TYPE = []  # the SharedArray class, made with numpy on first use


def array_type():
    """Return :class:`SharedArray`, a ``numpy.ndarray`` subclass (imports numpy)."""
    if not ARRAY_TYPE:
        ARRAY_TYPE.append(make_array_type())
    return ARRAY_TYPE[0]


def make_array_type():
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
            array._copy = Copy(segment, path, seconds)
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

    SharedArray.__module__, SharedArray.__qualname__ = "mpistage.data", "SharedArray"
    return SharedArray


class Copy:
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
            from mpistage.data.segments import sweep

            sweep(segment.node)


# -- the steps, run by every rank -----------------------------------------------
