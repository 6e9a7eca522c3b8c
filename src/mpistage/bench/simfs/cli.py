"""The command line of simfs: ``mpistage bench simfs|unmount|stats``."""

import argparse
import json
import sys
from pathlib import Path

from mpistage.bench.simfs.client import SimFS, read_stats, reset_stats
from mpistage.bench.simfs.common import (
    DEFAULT_LATENCY,
    FS_TYPE,
    MOUNT_TIMEOUT,
    PROG,
    STATS_FILE,
    SimFSError,
    fuse_available,
)
from mpistage.bench.simfs.mount import detached_log_path, mount_type, unmount_path
from mpistage.bench.units import (
    format_bandwidth,
    format_time,
    parse_bandwidth,
    parse_time,
)


class _SimFSParser(argparse.ArgumentParser):
    """An argument parser whose errors become :class:`SimFSError`."""

    def error(self, message):
        raise SimFSError(message)


def _latency_arg(text):
    try:
        return parse_time(text, "latency")
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
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1


def _simfs_parser():
    parser = _SimFSParser(
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
        default=MOUNT_TIMEOUT,
        help=f"seconds to wait for the mount (default: {MOUNT_TIMEOUT:g})",
    )
    return parser


def _describe(args):
    bandwidth = format_bandwidth(args.bandwidth)
    caches = "on" if args.cache else "off"
    return (
        f"latency {format_time(args.latency)}, bandwidth {bandwidth}, "
        f"kernel caches {caches}"
    )


def _mount_action(args):
    if args.foreground:
        reason = fuse_available()
        if reason:
            raise SimFSError(reason)
        from mpistage.bench.simfs.server import serve

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
    parser = _SimFSParser(
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
    parser = _SimFSParser(
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
        print(f"{PROG}: error: expected a command: {names}", file=sys.stderr)
        return 1
    return _COMMANDS[argv[0]](argv[1:])
