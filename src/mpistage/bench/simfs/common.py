"""What every part of simfs shares: names, units, availability, the error."""

import os
import re
import shutil
from ctypes.util import find_library

from mpistage import StageError

STATS_FILE = ".simfs-stats.json"
RESET_FILE = ".simfs-reset"
DEFAULT_LATENCY = 0.0005
CACHE_TIMEOUT = 60.0
FS_TYPE = "fuse.simfs"
MAX_THREADS = 64


class SimFSError(StageError):
    """A user-facing simfs error: printed as one line, no traceback."""


_NUMBER = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]([-+]?\d+))?\s*(.*?)\s*$")
_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_SIZE_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _SIZE_UNITS.update({_p: 1000**_i, _p + "b": 1000**_i})
    _SIZE_UNITS.update({_p + "i": 1024**_i, _p + "ib": 1024**_i})


def _split_number(text):
    """Split ``'0.5ms'`` into ``(0.5, 'ms')``; ``None`` if it is no number."""
    match = _NUMBER.match(str(text))
    if match is None:
        return None
    mantissa, exponent, unit = match.groups()
    value = float(mantissa) * 10 ** int(exponent or 0)
    return value, unit


def parse_latency(text):
    """Parse a latency like ``'0.5ms'``, ``'500us'``, ``'0.001s'`` or ``'0'``.

    Returns seconds as a float; a bare number is taken as seconds.
    """
    parts = _split_number(text)
    if parts is None or parts[1].lower() not in _TIME_UNITS:
        raise ValueError(f"invalid latency: {text!r} (use e.g. '0.5ms', '500us', '0')")
    value, unit = parts
    return value * _TIME_UNITS[unit.lower()]


def parse_bandwidth(text):
    """Parse a bandwidth like ``'100MB/s'`` or ``'1GiB/s'`` into bytes/s.

    ``'0'``, ``'none'`` and ``'unlimited'`` give ``None`` (no limit). kB, MB,
    GB, TB are powers of 1000; KiB, MiB, GiB, TiB powers of 1024; a bare number
    is bytes/s.
    """
    if str(text).strip().lower() in ("none", "unlimited", "inf"):
        return None
    parts = _split_number(text)
    unit = parts[1].lower().removesuffix("/s") if parts else None
    if parts is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"invalid bandwidth: {text!r} (use e.g. '100MB/s', '1GiB/s', 'none')"
        )
    value = parts[0] * _SIZE_UNITS[unit]
    return value or None


def format_latency(seconds):
    """Format seconds the way :func:`parse_latency` reads them back."""
    return f"{seconds * 1e3:g}ms"


def format_bandwidth(rate):
    """Format bytes/s like ``'1.074GB/s'``; ``None`` is ``'unlimited'``."""
    if not rate:
        return "unlimited"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if rate >= scale:
            return f"{rate / scale:.4g}{unit}/s"
    return f"{rate:.4g}B/s"


def fuse_available():
    """Return ``None`` if simfs can mount here, else a one-line reason.

    Checks ``/dev/fuse``, ``fusermount3``, the libfuse3 library and the
    ``mfusepy`` binding, and says how to install what is missing.
    """
    import importlib.util

    if not os.path.exists("/dev/fuse"):
        return (
            "FUSE not available: /dev/fuse missing (load the fuse module or "
            "run the container with --device /dev/fuse)"
        )
    if shutil.which("fusermount3") is None:
        return "fusermount3 not found: install with `apt-get install fuse3`"
    if find_library("fuse3") is None:
        return "libfuse3 not found: install with `apt-get install fuse3 libfuse3-3`"
    if importlib.util.find_spec("mfusepy") is None:
        return "mfusepy not installed: pip install 'mpistage[bench]'"
    return None


PROG = "mpistage"
