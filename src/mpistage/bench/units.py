"""The quantities the bench's command lines read and print.

Times (``0.5ms``), sizes (``4MiB``), bandwidths (``35GB/s``, ``none``) and
lists of counts (``1,4,16``) are written the same way in every ``mpistage
bench`` verb and in the files they write: this module is the one grammar.
kB, MB, GB and TB are powers of 1000; KiB, MiB, GiB and TiB powers of 1024;
a bare number is seconds or bytes. A bad quantity raises :class:`UnitError`,
which is a :class:`~mpistage.StageError` (one line on the command line) and a
:class:`ValueError` (argparse's ``type=`` turns it into a usage error).
"""

import re as _re

from mpistage import StageError

NUMBER = _re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]([-+]?\d+))?\s*(.*?)\s*$")
TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
SIZE_UNITS = {"": 1, "b": 1}
for _power, _prefix in enumerate("kmgt", start=1):
    SIZE_UNITS.update({_prefix: 1000**_power, _prefix + "b": 1000**_power})
    SIZE_UNITS.update({_prefix + "i": 1024**_power, _prefix + "ib": 1024**_power})
UNLIMITED = ("none", "unlimited", "inf")
MB, GB, MIB = SIZE_UNITS["mb"], SIZE_UNITS["gb"], SIZE_UNITS["mib"]
US = TIME_UNITS["us"]


class UnitError(StageError, ValueError):
    """A quantity that is not written as the bench reads quantities."""


def quantity(text, units, per_second=False):
    """Return *text* (``'0.5ms'``, ``'4MiB'``) in base units, or ``None``.

    With *per_second* the unit may end in ``/s`` (``'35GB/s'``).
    """
    match = NUMBER.match(str(text))
    unit = match and match.group(3).lower()
    if unit and per_second:
        unit = unit.removesuffix("/s")
    if not match or unit not in units:
        return None
    mantissa, exponent = match.group(1), match.group(2) or 0
    return float(mantissa) * 10 ** int(exponent) * units[unit]


def parse_time(text, what="time"):
    """Parse a duration such as ``0.5ms``, ``500us`` or ``0`` into seconds."""
    seconds = quantity(text, TIME_UNITS)
    if seconds is None:
        raise UnitError(f"invalid {what}: {text!r} (use e.g. '0.5ms', '500us', '0')")
    return seconds


def parse_size(text, what="size"):
    """Parse a size or a rate such as ``4MiB`` or ``35GB/s`` into bytes."""
    size = quantity(text, SIZE_UNITS, per_second=True)
    if size is None:
        raise UnitError(f"invalid {what}: {text!r} (use e.g. '4MiB', '35GB/s')")
    return size


def parse_bandwidth(text, what="bandwidth"):
    """Parse a bandwidth such as ``100MB/s`` into bytes/s; ``None`` if unlimited.

    ``none``, ``unlimited``, ``inf`` and ``0`` mean no limit.
    """
    if str(text).strip().lower() in UNLIMITED:
        return None
    rate = quantity(text, SIZE_UNITS, per_second=True)
    if rate is None:
        raise UnitError(
            f"invalid {what}: {text!r} (use e.g. '100MB/s', '1GiB/s', 'none')"
        )
    return rate or None


def parse_counts(text, flag="--ranks"):
    """Parse ``1,4,16`` into a list of positive whole numbers."""
    try:
        counts = [int(x) for x in str(text).split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise UnitError(f"{flag} {text!r} must be positive whole numbers, e.g. 1,4,16")
    return counts


def format_time(seconds):
    """Format seconds the way :func:`parse_time` reads them back."""
    return f"{seconds * 1e3:g}ms"


def format_bandwidth(rate):
    """Format bytes/s like ``'1.074GB/s'``; ``None`` is ``'unlimited'``."""
    if not rate:
        return "unlimited"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if rate >= scale:
            return f"{rate / scale:.4g}{unit}/s"
    return f"{rate:.4g}B/s"
