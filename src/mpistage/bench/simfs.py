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
"""

import argparse
import errno
import hashlib
import itertools
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from ctypes.util import find_library
from pathlib import Path

STATS_FILE = ".simfs-stats.json"
RESET_FILE = ".simfs-reset"
DEFAULT_LATENCY = 0.0005
CACHE_TIMEOUT = 60.0
FS_TYPE = "fuse.simfs"
MAX_THREADS = 64

_VIRTUAL_PATHS = ("/" + STATS_FILE, "/" + RESET_FILE)
_VIRTUAL_FH_BASE = 1 << 48
_FUSE_CAP_AUTO_INVAL_DATA = 1 << 12
_PROG = "mpistage"


class SimFSError(Exception):
    """A user-facing simfs error: printed as one line, no traceback."""


# -- parsing -----------------------------------------------------------------

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


# -- availability --------------------------------------------------------------


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


def _import_mfusepy():
    """Import ``mfusepy`` bound to libfuse3, or raise :class:`SimFSError`."""
    if "FUSE_LIBRARY_PATH" not in os.environ:
        os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")
    try:
        import mfusepy
    except ImportError as exc:
        reason = "mfusepy not installed: pip install 'mpistage[bench]'"
        raise SimFSError(reason) from exc
    except OSError as exc:
        raise SimFSError(
            f"cannot load libfuse3 ({exc}): install with `apt-get install fuse3`"
        ) from exc
    return mfusepy


# -- the server ----------------------------------------------------------------


def _read_tgid(tid):
    """Return the process id of thread *tid* (``tid`` itself if unknown)."""
    try:
        with open(f"/proc/{tid}/status") as status:
            for line in status:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return tid


class OpStats:
    """Thread-safe operation counters, by type and by client process."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self):
        """Zero all counters (and forget the thread-to-process map)."""
        with self._lock:
            self._ops = Counter()
            self._bytes = 0
            self._per_pid = {}
            self._tgids = {}

    def _pid_of(self, tid):
        pid = self._tgids.get(tid)
        if pid is None:
            pid = self._tgids[tid] = _read_tgid(tid)
        return pid

    def record(self, op, tid, nbytes=0):
        """Count one *op* by thread *tid* that read *nbytes* bytes."""
        pid = self._pid_of(tid)
        with self._lock:
            self._ops[op] += 1
            self._bytes += nbytes
            entry = self._per_pid.setdefault(pid, {"ops": Counter(), "bytes": 0})
            entry["ops"][op] += 1
            entry["bytes"] += nbytes

    def snapshot(self):
        """Return the counters as a JSON-ready dict (see the module docstring)."""
        with self._lock:
            per_pid = {
                str(pid): {
                    "ops": dict(entry["ops"]),
                    "total": sum(entry["ops"].values()),
                    "bytes": entry["bytes"],
                }
                for pid, entry in sorted(self._per_pid.items())
            }
            return {
                "ops": dict(self._ops),
                "per_pid": per_pid,
                "total": sum(self._ops.values()),
                "bytes": self._bytes,
            }


class _Pipe:
    """A shared data pipe of *bandwidth* bytes/s (``None``: unlimited)."""

    def __init__(self, bandwidth):
        self.bandwidth = bandwidth
        self._lock = threading.Lock()
        self._free_at = 0.0

    def transfer(self, nbytes):
        """Sleep until *nbytes* went through the pipe after those queued before."""
        if not self.bandwidth or not nbytes:
            return
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = done = start + nbytes / self.bandwidth
        delay = done - time.monotonic()
        if delay > 0:
            time.sleep(delay)


_STAT_FIELDS = (
    "st_mode",
    "st_nlink",
    "st_uid",
    "st_gid",
    "st_rdev",
    "st_size",
    "st_blksize",
    "st_blocks",
)
_STATVFS_FIELDS = (
    "f_bsize",
    "f_frsize",
    "f_blocks",
    "f_bfree",
    "f_bavail",
    "f_files",
    "f_ffree",
    "f_favail",
    "f_flag",
    "f_namemax",
)


def _stat_dict(path):
    """``lstat`` *path* into the dict mfusepy expects (times in ns)."""
    st = os.lstat(path)
    attrs = {key: getattr(st, key) for key in _STAT_FIELDS}
    attrs.update(
        st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns
    )
    return attrs


def _statvfs_dict(path):
    """``statvfs`` *path* into the dict mfusepy expects."""
    st = os.statvfs(path)
    return {key: getattr(st, key) for key in _STATVFS_FIELDS}


def _check_dir(path):
    """Raise ``ENOTDIR`` unless *path* is a directory."""
    if not stat.S_ISDIR(os.stat(path).st_mode):
        raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)


def _check_access(path, amode):
    """Raise ``ENOENT``/``EACCES`` unless *path* is accessible with *amode*."""
    if not os.path.lexists(path):
        raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    if not os.access(path, amode, follow_symlinks=False):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), path)


def _entry_mode(entry):
    """The file-type bits of a ``DirEntry`` (readdir only passes the type)."""
    if entry.is_symlink():
        return stat.S_IFLNK
    return stat.S_IFDIR if entry.is_dir(follow_symlinks=False) else stat.S_IFREG


class MirrorOps:
    """mfusepy operations: a read-only mirror of *src* behind a metadata queue.

    Used with ``mfusepy.FUSE(..., raw_fi=True)``. Only the operations defined
    here are registered; everything else gets ``ENOSYS`` from libfuse and the
    mount is read-only anyway.
    """

    use_ns = True

    def __init__(
        self, src, *, latency=DEFAULT_LATENCY, bandwidth=None, cache=False, context=None
    ):
        self.src = os.path.realpath(src)
        self.stats = OpStats()
        self._latency = latency
        self._cache = cache
        self._meta_lock = threading.Lock()
        self._pipe = _Pipe(bandwidth)
        self._context = context or (lambda: (0, 0, os.getpid()))
        self._handles = {}
        self._handles_lock = threading.Lock()
        self._next_handle = _VIRTUAL_FH_BASE
        self._next_dir = itertools.count(1)
        self._owners = {}
        self._config = {
            "src": self.src,
            "latency": latency,
            "bandwidth": bandwidth,
            "cache": cache,
        }

    # helpers

    def _real(self, path):
        return os.path.join(self.src, path.lstrip("/"))

    def _tid(self):
        return self._context()[2]

    def _owner(self, kind, handle):
        """The thread that opened *handle*: the kernel sends closes as pid 0."""
        return self._owners.pop((kind, handle), None) or self._tid()

    def _meta(self, op, func, *args):
        """Count *op*, then run ``func(*args)`` alone, after the latency."""
        self.stats.record(op, self._tid())
        with self._meta_lock:
            if self._latency > 0:
                time.sleep(self._latency)
            return func(*args)

    def _stats_json(self):
        data = self.stats.snapshot()
        data["config"] = self._config
        return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()

    def _add_handle(self, content):
        with self._handles_lock:
            handle = self._next_handle
            self._next_handle += 1
            self._handles[handle] = content
        return handle

    def _open_virtual(self, path, fi):
        if path == "/" + RESET_FILE:
            self.stats.reset()
            content = b""
        else:
            content = self._stats_json()
        fi.fh = self._add_handle(content)
        fi.direct_io = 1
        return 0

    @staticmethod
    def _virtual_attrs():
        now = time.time_ns()
        return {
            "st_mode": stat.S_IFREG | 0o444,
            "st_nlink": 1,
            "st_size": 0,
            "st_uid": os.getuid(),
            "st_gid": os.getgid(),
            "st_atime": now,
            "st_mtime": now,
            "st_ctime": now,
        }

    def _listing(self, path):
        """Return readdir entries of *path*, without the virtual files."""
        hidden = (STATS_FILE, RESET_FILE) if path == "/" else ()
        entries = [
            (".", {"st_mode": stat.S_IFDIR}, 0),
            ("..", {"st_mode": stat.S_IFDIR}, 0),
        ]
        with os.scandir(self._real(path)) as it:
            for entry in it:
                if entry.name not in hidden:
                    entries.append((entry.name, {"st_mode": _entry_mode(entry)}, 0))
        return entries

    def init_with_config(self, conn, config):
        """Drop FUSE_CAP_AUTO_INVAL_DATA: no hidden getattr before each read()."""
        if conn is not None:
            conn.want &= ~_FUSE_CAP_AUTO_INVAL_DATA

    # metadata operations (counted, serialized, delayed)

    def getattr(self, path, fh=None):
        """Attributes of *path* (also answers the kernel's lookups)."""
        if path in _VIRTUAL_PATHS:
            return self._virtual_attrs()
        return self._meta("getattr", _stat_dict, self._real(path))

    def open(self, path, fi):
        """Open *path* read-only; the file descriptor becomes ``fi.fh``."""
        if path in _VIRTUAL_PATHS:
            return self._open_virtual(path, fi)
        if fi.flags & os.O_ACCMODE != os.O_RDONLY:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        fi.fh = self._meta("open", os.open, self._real(path), os.O_RDONLY)
        self._owners[("file", fi.fh)] = self._tid()
        fi.keep_cache = int(self._cache)
        return 0

    def opendir(self, path):
        """Check that *path* is a directory; return a new directory handle."""
        self._meta("opendir", _check_dir, self._real(path))
        handle = next(self._next_dir)
        self._owners[("dir", handle)] = self._tid()
        return handle

    def readdir(self, path, fh):
        """List *path* with file types."""
        return self._meta("readdir", self._listing, path)

    def readlink(self, path):
        """Return the target of symlink *path*."""
        return self._meta("readlink", os.readlink, self._real(path))

    def access(self, path, amode):
        """Check access to *path*."""
        if path in _VIRTUAL_PATHS:
            return 0
        self._meta("access", _check_access, self._real(path), amode)
        return 0

    def statfs(self, path):
        """File system statistics of the source."""
        return self._meta("statfs", _statvfs_dict, self._real(path))

    # data and close operations (counted, not serialized)

    def read(self, path, size, offset, fi):
        """Read from an open file, at the simulated bandwidth."""
        if fi.fh >= _VIRTUAL_FH_BASE:
            return self._handles[fi.fh][offset : offset + size]
        data = os.pread(fi.fh, size, offset)
        self._pipe.transfer(len(data))
        self.stats.record("read", self._tid(), len(data))
        return data

    def release(self, path, fi):
        """Close an open file."""
        if fi.fh >= _VIRTUAL_FH_BASE:
            with self._handles_lock:
                self._handles.pop(fi.fh, None)
            return 0
        self.stats.record("release", self._owner("file", fi.fh))
        os.close(fi.fh)
        return 0

    def releasedir(self, path, fh):
        """Close an open directory."""
        self.stats.record("releasedir", self._owner("dir", fh))
        return 0


def mount_options(cache=False):
    """The libfuse3 mount options: read-only, kernel caches off unless *cache*."""
    timeout = CACHE_TIMEOUT if cache else 0
    options = {
        "ro": True,
        "fsname": "simfs",
        "subtype": "simfs",
        "attr_timeout": timeout,
        "entry_timeout": timeout,
        "negative_timeout": timeout,
        "max_threads": MAX_THREADS,
        "max_idle_threads": MAX_THREADS,
    }
    if cache:
        options["kernel_cache"] = True
    return options


def serve(
    src,
    mountpoint,
    *,
    latency=DEFAULT_LATENCY,
    bandwidth=None,
    cache=False,
    debug=False,
):
    """Mount the mirror of *src* at *mountpoint*; serve until it is unmounted.

    Runs multithreaded in the foreground of the calling process. SIGINT,
    SIGTERM and SIGHUP unmount and return.
    """
    _check_dirs(src, mountpoint)
    mfusepy = _import_mfusepy()
    ops = MirrorOps(
        src,
        latency=latency,
        bandwidth=bandwidth,
        cache=cache,
        context=mfusepy.fuse_get_context,
    )
    try:
        mfusepy.FUSE(
            ops,
            str(mountpoint),
            raw_fi=True,
            foreground=True,
            debug=debug,
            **mount_options(cache),
        )
    except RuntimeError as exc:
        raise SimFSError(f"fuse mount of {str(mountpoint)!r} failed ({exc})") from exc


# -- mounts --------------------------------------------------------------------


def _canonical(path):
    """Absolute, symlink-free *path*, without touching *path* itself.

    ``realpath`` on a live mountpoint would send a (counted) getattr.
    """
    path = os.path.abspath(path)
    head, tail = os.path.split(path)
    return os.path.join(os.path.realpath(head), tail)


def _unescape(field):
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_type(path):
    """Return the file system type mounted at *path*, or ``None``."""
    target = _canonical(path)
    found = None
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            sep = fields.index("-")
            if _unescape(fields[4]) == target:
                found = fields[sep + 1]
    return found


def _check_dirs(src, mountpoint):
    """Raise :class:`SimFSError` unless *src* and *mountpoint* can be used."""
    if not os.path.isdir(src):
        raise SimFSError(f"source directory does not exist: {str(src)!r}")
    if mount_type(mountpoint) == FS_TYPE:
        raise SimFSError(f"simfs is already mounted at {str(mountpoint)!r}")
    if not os.path.exists(mountpoint):
        raise SimFSError(f"mountpoint does not exist: {str(mountpoint)!r}")
    if not os.path.isdir(mountpoint):
        raise SimFSError(f"mountpoint is not a directory: {str(mountpoint)!r}")
    real_src, real_mp = os.path.realpath(src), os.path.realpath(mountpoint)
    if os.path.commonpath([real_src, real_mp]) == real_mp:
        raise SimFSError(
            f"source {str(src)!r} is inside mountpoint {str(mountpoint)!r}"
        )


def unmount_path(mountpoint):
    """Unmount *mountpoint*: ``fusermount3 -u``, then lazily if it is busy."""
    attempts = (["fusermount3", "-u"], ["fusermount3", "-uz"], ["umount", "-l"])
    errors = []
    for command in attempts:
        if mount_type(mountpoint) is None:
            return
        if shutil.which(command[0]) is None:
            continue
        done = subprocess.run(
            [*command, str(mountpoint)],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        errors.append(done.stderr.strip())
    if mount_type(mountpoint) is not None:
        detail = next((e for e in reversed(errors) if e), "no unmount tool worked")
        raise SimFSError(f"cannot unmount {str(mountpoint)!r}: {detail}")


def read_stats(mountpoint):
    """Return the counters of the simfs mounted at *mountpoint*."""
    return json.loads(Path(mountpoint, STATS_FILE).read_bytes())


def reset_stats(mountpoint):
    """Reset the counters of the simfs mounted at *mountpoint*."""
    with open(Path(mountpoint, RESET_FILE), "rb"):
        pass


def detached_log_path(mountpoint):
    """Where a background server for *mountpoint* logs (removed on unmount)."""
    digest = hashlib.sha1(_canonical(mountpoint).encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"simfs-{digest}.log")


def _last_line(path):
    try:
        lines = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


class SimFS:
    """A simfs mount served by a separate process.

    ``with SimFS(src, mnt, latency=0.005) as fs: ...; fs.stats()`` mounts on
    entry and unmounts on exit. *latency* is in seconds, *bandwidth* in
    bytes/s (``None``: unlimited), *cache* turns the kernel caches on.
    """

    def __init__(
        self, src, mountpoint, latency=DEFAULT_LATENCY, bandwidth=None, cache=False
    ):
        self.src = Path(src)
        self.mountpoint = Path(mountpoint)
        self.latency = float(latency)
        self.bandwidth = bandwidth
        self.cache = cache
        self.process = None
        self.log_path = None

    def __repr__(self):
        return (
            f"SimFS({str(self.src)!r}, {str(self.mountpoint)!r}, "
            f"latency={self.latency!r}, bandwidth={self.bandwidth!r}, "
            f"cache={self.cache!r})"
        )

    def __enter__(self):
        return self.mount()

    def __exit__(self, *exc_info):
        self.unmount()

    def server_command(self):
        """The command line that serves this mount in the foreground."""
        command = [
            sys.executable,
            "-m",
            "mpistage.bench.simfs",
            "serve",
            str(self.src),
            str(self.mountpoint),
            "--latency",
            f"{self.latency!r}s",
        ]
        if self.bandwidth:
            command += ["--bandwidth", f"{float(self.bandwidth)!r}"]
        return command + (["--cache"] if self.cache else [])

    def mount(self, timeout=10.0, *, detach=False):
        """Start the server and wait until the mount is live; return self.

        With *detach* the server gets its own session and outlives this
        process (the CLI's background mode). Raises :class:`SimFSError`.
        """
        reason = fuse_available()
        if reason:
            raise SimFSError(reason)
        _check_dirs(self.src, self.mountpoint)
        self._spawn(detach)
        try:
            self._wait_live(timeout)
        except BaseException:
            self.unmount(timeout=1.0)
            raise
        return self

    def _spawn(self, detach):
        if detach:
            self.log_path = detached_log_path(self.mountpoint)
            fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        else:
            fd, self.log_path = tempfile.mkstemp(prefix="simfs-", suffix=".log")
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, env.get("PYTHONPATH")) if p
        )
        with os.fdopen(fd, "w") as log:
            self.process = subprocess.Popen(
                self.server_command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=detach,
            )

    def _wait_live(self, timeout):
        deadline = time.monotonic() + timeout
        while True:
            code = self.process.poll()
            if code is not None:
                detail = _last_line(self.log_path) or f"exit status {code}"
                raise SimFSError(f"simfs server failed: {detail}")
            if self.is_live():
                return
            if time.monotonic() > deadline:
                raise SimFSError(
                    f"simfs did not come up at {str(self.mountpoint)!r} "
                    f"within {timeout:g} s"
                )
            time.sleep(0.02)

    def is_live(self):
        """True if simfs is mounted here and answers (no counted operation)."""
        if mount_type(self.mountpoint) != FS_TYPE:
            return False
        try:
            read_stats(self.mountpoint)
        except (OSError, ValueError):
            return False
        return True

    def unmount(self, timeout=5.0):
        """Unmount and stop the server; safe to call more than once."""
        try:
            if mount_type(self.mountpoint) == FS_TYPE:
                unmount_path(self.mountpoint)
        finally:
            self._stop_server(timeout)

    def _stop_server(self, timeout):
        process, self.process = self.process, None
        if process is not None:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.terminate()  # libfuse unmounts on SIGTERM
                try:
                    process.wait(2.0)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        if self.log_path:
            Path(self.log_path).unlink(missing_ok=True)
            self.log_path = None

    def stats(self):
        """Return the operation counters (see the module docstring)."""
        return read_stats(self.mountpoint)

    def reset(self):
        """Reset the operation counters."""
        reset_stats(self.mountpoint)


# -- command line --------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors become :class:`SimFSError`."""

    def error(self, message):
        raise SimFSError(message)


def _latency_arg(text):
    try:
        return parse_latency(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bandwidth_arg(text):
    try:
        return parse_bandwidth(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _run(parser, argv, action):
    """Parse *argv* and run *action*; user errors become one line, status 1."""
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help
            return exc.code if isinstance(exc.code, int) else 0
        return action(args) or 0
    except SimFSError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 1


def _simfs_parser():
    parser = _Parser(
        prog="mpistage bench simfs",
        description="Mount a read-only mirror of SRC at MOUNTPOINT "
        "that serves metadata operations one at a time.",
    )
    parser.add_argument("src", metavar="SRC", help="directory to mirror")
    parser.add_argument("mountpoint", metavar="MOUNTPOINT", help="existing directory")
    parser.add_argument(
        "--latency",
        type=_latency_arg,
        default=DEFAULT_LATENCY,
        help="delay per metadata operation (default: 0.5ms)",
    )
    parser.add_argument(
        "--bandwidth",
        type=_bandwidth_arg,
        default=None,
        help="shared data bandwidth, e.g. 1GB/s (default: unlimited)",
    )
    parser.add_argument(
        "--cache",
        action="store_true",
        help="turn the kernel attribute/entry/negative caches on",
    )
    parser.add_argument(
        "--foreground",
        action="store_true",
        help="serve in this process until unmounted (Ctrl-C)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="seconds to wait for the mount (default: 10)",
    )
    return parser


def _describe(args):
    bandwidth = format_bandwidth(args.bandwidth)
    caches = "on" if args.cache else "off"
    return (
        f"latency {format_latency(args.latency)}, bandwidth {bandwidth}, "
        f"kernel caches {caches}"
    )


def _mount_action(args):
    if args.foreground:
        reason = fuse_available()
        if reason:
            raise SimFSError(reason)
        serve(
            args.src,
            args.mountpoint,
            latency=args.latency,
            bandwidth=args.bandwidth,
            cache=args.cache,
        )
        return 0
    fs = SimFS(
        args.src,
        args.mountpoint,
        latency=args.latency,
        bandwidth=args.bandwidth,
        cache=args.cache,
    )
    fs.mount(timeout=args.timeout, detach=True)
    mnt = str(args.mountpoint)
    print(
        f"simfs: {str(args.src)!r} mirrored at {mnt!r} ({_describe(args)}), "
        f"server pid {fs.process.pid}, log {fs.log_path}"
    )
    print(f"  stats:   mpistage bench stats {mnt}   (or: cat {mnt}/{STATS_FILE})")
    print(f"  reset:   mpistage bench stats --reset {mnt}")
    print(f"  unmount: mpistage bench unmount {mnt}")
    return 0


def cli_simfs(argv):
    """``mpistage bench simfs SRC MOUNTPOINT [--latency] [--bandwidth] [--cache]``.

    Mounts in the background by default, or serves in the foreground with
    ``--foreground``. Returns the exit status.
    """
    return _run(_simfs_parser(), argv, _mount_action)


def _unmount_action(args):
    kind = mount_type(args.mountpoint)
    if kind is None:
        raise SimFSError(f"nothing is mounted at {args.mountpoint!r}")
    if kind != FS_TYPE:
        raise SimFSError(f"not a simfs mount: {args.mountpoint!r} (type {kind!r})")
    unmount_path(args.mountpoint)
    Path(detached_log_path(args.mountpoint)).unlink(missing_ok=True)
    return 0


def cli_unmount(argv):
    """``mpistage bench unmount MOUNTPOINT``: unmount a simfs; exit status."""
    parser = _Parser(
        prog="mpistage bench unmount",
        description="Unmount a simfs mount (its server then exits).",
    )
    parser.add_argument("mountpoint", metavar="MOUNTPOINT")
    return _run(parser, argv, _unmount_action)


def _stats_action(args):
    if mount_type(args.mountpoint) != FS_TYPE:
        raise SimFSError(f"not a simfs mount: {args.mountpoint!r}")
    try:
        data = read_stats(args.mountpoint)
    except (OSError, ValueError) as exc:
        raise SimFSError(f"cannot read stats of {args.mountpoint!r}: {exc}") from exc
    print(json.dumps(data, indent=2, sort_keys=True))
    if args.reset:
        reset_stats(args.mountpoint)
    return 0


def cli_stats(argv):
    """``mpistage bench stats [--reset] MOUNTPOINT``: print the counters as JSON."""
    parser = _Parser(
        prog="mpistage bench stats",
        description="Print the operation counters of a simfs mount.",
    )
    parser.add_argument("mountpoint", metavar="MOUNTPOINT")
    parser.add_argument(
        "--reset", action="store_true", help="reset the counters after printing them"
    )
    return _run(parser, argv, _stats_action)


def _cli_serve(argv):
    return cli_simfs([*argv, "--foreground"])


_COMMANDS = {
    "serve": _cli_serve,
    "mount": cli_simfs,
    "unmount": cli_unmount,
    "stats": cli_stats,
}


def main(argv=None):
    """``python -m mpistage.bench.simfs {serve,mount,unmount,stats} ...``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in _COMMANDS:
        names = ", ".join(_COMMANDS)
        print(f"{_PROG}: error: expected a command: {names}", file=sys.stderr)
        return 1
    return _COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
