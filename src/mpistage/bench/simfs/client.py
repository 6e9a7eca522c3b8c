"""The client side: a mount served by a separate process, and its counters."""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mpistage.bench.simfs.common import (
    DEFAULT_LATENCY,
    FS_TYPE,
    MOUNT_TIMEOUT,
    RESET_FILE,
    STATS_FILE,
    SimFSError,
    fuse_available,
)
from mpistage.bench.simfs.mount import (
    check_dirs,
    detached_log_path,
    mount_type,
    unmount_path,
)

POLL_INTERVAL = 0.02  # seconds between looks at a mount that is coming up
STOP_WAIT = 5.0  # seconds the server has to exit once unmounted
GIVE_UP_WAIT = 1.0  # the same, after a mount that failed
TERM_WAIT = 2.0  # seconds the server has to exit after SIGTERM


def read_stats(mountpoint):
    """Return the counters of the simfs mounted at *mountpoint*."""
    return json.loads(Path(mountpoint, STATS_FILE).read_bytes())


def reset_stats(mountpoint):
    """Reset the counters of the simfs mounted at *mountpoint*."""
    with open(Path(mountpoint, RESET_FILE), "rb"):
        pass


def meta_ops(counts):
    """Return the metadata operations (all but data reads) in *counts*."""
    ops = counts.get("ops", {})
    return sum(ops.values()) - ops.get("read", 0)


def read_ops(counts):
    """Return the data reads in *counts*."""
    return counts.get("ops", {}).get("read", 0)


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

    def mount(self, timeout=MOUNT_TIMEOUT, *, detach=False):
        """Start the server and wait until the mount is live; return self.

        With *detach* the server gets its own session and outlives this
        process (the CLI's background mode). Raises :class:`SimFSError`.
        """
        reason = fuse_available()
        if reason:
            raise SimFSError(reason)
        check_dirs(self.src, self.mountpoint)
        self._spawn(detach)
        try:
            self._wait_live(timeout)
        except BaseException:
            self.unmount(timeout=GIVE_UP_WAIT)
            raise
        return self

    def _spawn(self, detach):
        if detach:
            self.log_path = detached_log_path(self.mountpoint)
            fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        else:
            fd, self.log_path = tempfile.mkstemp(prefix="simfs-", suffix=".log")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root(), env.get("PYTHONPATH")) if p
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
                detail = last_line(self.log_path) or f"exit status {code}"
                raise SimFSError(f"simfs server failed: {detail}")
            if self.is_live():
                return
            if time.monotonic() > deadline:
                raise SimFSError(
                    f"simfs did not come up at {str(self.mountpoint)!r} "
                    f"within {timeout:g} s"
                )
            time.sleep(POLL_INTERVAL)

    def is_live(self):
        """True if simfs is mounted here and answers (no counted operation)."""
        if mount_type(self.mountpoint) != FS_TYPE:
            return False
        try:
            read_stats(self.mountpoint)
        except (OSError, ValueError):
            return False
        return True

    def unmount(self, timeout=STOP_WAIT):
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
                    process.wait(TERM_WAIT)
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


def package_root():
    """Return the directory that holds this mpistage, for the server to import."""
    import mpistage

    return os.path.dirname(os.path.dirname(os.path.abspath(mpistage.__file__)))


def last_line(path):
    """Return the last line of the log at *path* ('' when there is none)."""
    try:
        lines = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""
