"""The testbed a benchmark runs on: a temporary tree, its mount, the launcher.

A benchmark puts its files below ``source/`` (what the simulated shared file
system mirrors), reads them through ``mnt/`` (where simfs mounts it) and
launches ``mpiexec``. :class:`Testbed` makes and removes that tree; the
start-up sweep (:class:`mpistage.bench.sweep.StartupTestbed`) and the data
benchmark (:class:`mpistage.bench.data.DataTestbed`) add what they mount.
"""

import os as _os
import sys as _sys

from mpistage.node.place import RAM_DISK


class Testbed:
    """A temporary ``source/`` and ``mnt/``, and the ``mpiexec`` to launch with."""

    def __init__(self, prefix):
        import tempfile

        self.work = tempfile.mkdtemp(prefix=prefix)
        self.source = _os.path.join(self.work, "shared")
        self.mount = _os.path.join(self.work, "mnt")
        self.job_dir = _os.path.join(self.work, "job")  # where jobs start: empty
        for folder in (self.source, self.mount, self.job_dir):
            _os.makedirs(folder)
        self.mpiexec = find_mpiexec()

    def close(self):
        """Remove the temporary tree (unmount first)."""
        import shutil

        shutil.rmtree(self.work, ignore_errors=True)


def find_mpiexec():
    """Return the ``mpiexec`` beside this Python (the MPICH wheel's), or on PATH."""
    import shutil

    mpiexec = _os.path.join(_os.path.dirname(_sys.executable), "mpiexec")
    return mpiexec if _os.path.exists(mpiexec) else shutil.which("mpiexec")


def local_base():
    """Return node-local RAM disk when present, else ``None`` (the temp directory)."""
    return RAM_DISK if _os.path.isdir(RAM_DISK) else None


def progress(line):
    """Print one progress line to stderr."""
    print(line, file=_sys.stderr, flush=True)
