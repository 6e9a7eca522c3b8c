"""simfs: a simulated shared file system for startup benchmarks.

Why: starting Python on thousands of MPI ranks is slow because every rank
sends the same thousands of ``stat``/``open``/``listdir`` calls to one shared
metadata server (a Lustre MDS, a GPFS manager, an NFS server), which answers
them one at a time. A laptop or CI node has a fast local disk that hides this
completely. simfs brings it back, so the benefit of staging imports
node-locally can be measured anywhere FUSE works.

What: a read-only FUSE mirror (``mfusepy`` on libfuse3) of a source directory:

* Every metadata operation -- ``getattr`` (which also answers the kernel's
  LOOKUPs, as libfuse's high-level API turns a lookup into a getattr),
  ``open``, ``opendir``, ``readdir``, ``readlink``, ``access`` and ``statfs``
  -- is served one at a time under a single global lock, after sleeping for a
  configurable latency (default 0.5 ms) while holding the lock. Concurrent
  clients therefore queue exactly like on a busy metadata server.
* Data reads are not under that lock. With a bandwidth they share one
  simulated pipe of that many bytes/s (each read reserves its slot on the
  pipe, then sleeps until its transfer is done); by default they are free.
* The kernel attribute, entry and negative caches are off (mount options
  ``attr_timeout=0,entry_timeout=0,negative_timeout=0``) so every path
  resolution reaches the server, like on a shared file system with many
  writers. ``cache=True`` turns them on (60 s) and adds ``kernel_cache``.
* The server is multithreaded (``max_threads=64``), so it is the lock, not
  libfuse, that serializes the metadata operations.
* Every operation is counted by type and by client process, plus the bytes
  read per process. The kernel reports the calling *thread*; simfs maps it to
  its process through ``/proc/<tid>/status``. ``release``/``releasedir`` are
  counted but neither delayed nor locked; the kernel sends them
  asynchronously after ``close()`` (as pid 0), so they are charged to the
  process that opened the file and may show up a moment later.
* libfuse's automatic data invalidation is turned off, so a ``read()`` inside
  the known file size costs no hidden ``getattr``.

What a call costs with the caches off (measured on Linux 6.x, libfuse 3.14):
``stat("a/b")`` is 3 getattr (one lookup per component, then the getattr
itself) and ``stat(MOUNTPOINT)`` 1; a missing name costs a getattr per
component looked up; ``os.open("a/b")`` is 2 getattr + open, and its
``close`` a release; ``read`` is one read per kernel request, plus a getattr
when it asks past the cached size (Python's ``readall`` does, twice for small
files); ``os.listdir("a")`` is 2 getattr (lookup + glibc's fstat) + opendir +
readdir + releasedir; ``os.readlink`` is 1 getattr + readlink.

The counters are read through two virtual files at the mount root, which are
not counted, not delayed and not listed by ``readdir``:

* ``MOUNTPOINT/.simfs-stats.json``: generated when opened, shaped
  ``{"ops": {"getattr": n, ...}, "per_pid": {"<pid>": {"ops": {...},
  "total": n, "bytes": n}}, "total": n, "bytes": n, "config": {...}}``.
* ``MOUNTPOINT/.simfs-reset``: opening it resets all counters.

:class:`SimFS` wraps both (``stats()``, ``reset()``) and runs the server in a
separate process, ``python -m mpistage.bench.simfs serve SRC MOUNTPOINT
[--latency 0.5ms] [--bandwidth 1GB/s] [--cache]``, in the foreground there.
``mfusepy`` is imported only inside the server, so this module imports
without it; :func:`fuse_available` tells whether FUSE can be used here.

The package is split by job: :mod:`.server` (the FUSE mirror and its
counters), :mod:`.mount` (what is mounted where, unmounting),
:mod:`.client` (:class:`SimFS`, reading and resetting counters) and
:mod:`.cli` (the command line).
"""

from mpistage.bench.simfs.cli import cli_simfs, cli_stats, cli_unmount, main
from mpistage.bench.simfs.client import SimFS, meta_ops, read_ops, read_stats
from mpistage.bench.simfs.common import FS_TYPE, STATS_FILE, SimFSError, fuse_available
from mpistage.bench.simfs.mount import detached_log_path, mount_type, unmount_path

__all__ = [
    "FS_TYPE",
    "STATS_FILE",
    "SimFS",
    "SimFSError",
    "cli_simfs",
    "cli_stats",
    "cli_unmount",
    "detached_log_path",
    "fuse_available",
    "main",
    "meta_ops",
    "mount_type",
    "read_ops",
    "read_stats",
    "unmount_path",
]
