"""A base class that lets a Python class export a buffer before Python 3.12.

Python 3.12 lets a class be bytes-like with a ``__buffer__`` method (PEP
688). Before, only a C type can fill the buffer slot, and the types of the
standard library that could wrap the node's copy either cannot be
subclassed (``memoryview``, ``pickle.PickleBuffer``, mpi4py's ``buffer``)
or export it writable (ctypes arrays). :func:`exporter` makes one small C
type, once, with ``PyType_FromSpec`` through ctypes: its buffer slot calls
the object's ``_export()`` and passes that object's buffer on, so the
consumer holds the read-only memoryview ``_export()`` returns, exactly as
with ``__buffer__``. ``bytes(buf)``, ``hashlib.sha256(buf)`` and
``numpy.frombuffer(buf)`` then work on Python 3.10 and 3.11 too.

The slot runs Python code that must not raise (ctypes cannot pass an
exception out of a callback): a request it cannot serve ends with status
-1. A writable request is then refused as unwritable by whoever asked;
``memoryview(buf)`` of a closed one raises ``SystemError`` (``ValueError``
on 3.12 and later).
"""

import ctypes as _ctypes

PY_BF_GETBUFFER = 1  # the slot's number (Include/typeslots.h)
TPFLAGS = (1 << 10) | (1 << 18)  # Py_TPFLAGS_BASETYPE | Py_TPFLAGS_DEFAULT
MADE = []  # the type and what it needs to stay alive, once made


class Slot(_ctypes.Structure):
    """``PyType_Slot``: a slot number and its function."""

    _fields_ = [("slot", _ctypes.c_int), ("pfunc", _ctypes.c_void_p)]


class Spec(_ctypes.Structure):
    """``PyType_Spec``: what ``PyType_FromSpec`` makes a type of."""

    _fields_ = [
        ("name", _ctypes.c_char_p),
        ("basicsize", _ctypes.c_int),
        ("itemsize", _ctypes.c_int),
        ("flags", _ctypes.c_uint),
        ("slots", _ctypes.POINTER(Slot)),
    ]


GETBUFFER = _ctypes.PYFUNCTYPE(
    _ctypes.c_int, _ctypes.py_object, _ctypes.c_void_p, _ctypes.c_int
)


def exporter():
    """Return the base type whose instances export ``self._export()``'s buffer."""
    if not MADE:
        MADE.append(make())
    return MADE[0][0]


def make():
    """Make the type; return it with the objects its slot refers to."""
    api = _ctypes.pythonapi
    get_buffer = api.PyObject_GetBuffer
    get_buffer.argtypes = (_ctypes.py_object, _ctypes.c_void_p, _ctypes.c_int)
    get_buffer.restype = _ctypes.c_int

    def slot(obj, view, flags):
        try:
            return get_buffer(obj._export(), view, flags)
        except BaseException:  # noqa: BLE001 (no exception may leave a slot)
            return -1

    callback = GETBUFFER(slot)
    slots = (Slot * 2)(Slot(PY_BF_GETBUFFER, _ctypes.cast(callback, _ctypes.c_void_p)))
    spec = Spec(b"mpistage.data.Exporter", 0, 0, TPFLAGS, slots)
    from_spec = api.PyType_FromSpec
    from_spec.argtypes = (_ctypes.POINTER(Spec),)
    from_spec.restype = _ctypes.py_object
    return from_spec(_ctypes.byref(spec)), callback, slots, spec
