"""The simfs server: a read-only FUSE mirror behind one metadata queue.

Run in its own process (``python -m mpistage.bench.simfs serve SRC MNT``);
``mfusepy`` is imported only here.
"""

import errno
import itertools
import json
import os
import stat
import threading
import time
from collections import Counter

from mpistage.bench.simfs.common import (
    CACHE_TIMEOUT,
    DEFAULT_LATENCY,
    MAX_THREADS,
    RESET_FILE,
    STATS_FILE,
    SimFSError,
)
from mpistage.bench.simfs.mount import check_dirs

_VIRTUAL_PATHS = ("/" + STATS_FILE, "/" + RESET_FILE)
_VIRTUAL_FH_BASE = 1 << 48
_FUSE_CAP_AUTO_INVAL_DATA = 1 << 12
_PROG = "mpistage"


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
    "st_ino",
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
        _uid, _gid, tid = self._context()  # fuse_get_context(): the calling thread
        return tid

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
                    entries.append(
                        (
                            entry.name,
                            {"st_mode": _entry_mode(entry), "st_ino": entry.inode()},
                            0,
                        )
                    )
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
        "use_ino": True,  # the source's inode numbers, stable across mounts
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
    check_dirs(src, mountpoint)
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
