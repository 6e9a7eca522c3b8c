"""Mount management: what is mounted where, and unmounting it."""

import hashlib
import os
import re
import shutil
import subprocess
import tempfile

from mpistage.bench.simfs.common import FS_TYPE, SimFSError

MOUNTINFO_MOUNT_POINT = 4  # field 5 of a /proc/self/mountinfo line (proc(5))
LOG_DIGEST = 12  # hex digits of the mount point's hash in a log's name


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
            if _unescape(fields[MOUNTINFO_MOUNT_POINT]) == target:
                found = fields[sep + 1]
    return found


def check_dirs(src, mountpoint):
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


def detached_log_path(mountpoint):
    """Where a background server for *mountpoint* logs (removed on unmount)."""
    digest = hashlib.sha1(_canonical(mountpoint).encode()).hexdigest()[:LOG_DIGEST]
    return os.path.join(tempfile.gettempdir(), f"simfs-{digest}.log")
