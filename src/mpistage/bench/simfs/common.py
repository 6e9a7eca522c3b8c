"""What every part of simfs shares: names, availability, the error."""

import os
import shutil
from ctypes.util import find_library

from mpistage import StageError

STATS_FILE = ".simfs-stats.json"
RESET_FILE = ".simfs-reset"
DEFAULT_LATENCY = 0.0005
CACHE_TIMEOUT = 60.0
FS_TYPE = "fuse.simfs"
MAX_THREADS = 64
MOUNT_TIMEOUT = 10.0  # seconds a mount may take to come up


class SimFSError(StageError):
    """A user-facing simfs error: printed as one line, no traceback."""


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
