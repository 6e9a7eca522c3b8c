"""``mpistage clean``: remove staging roots left behind by dead jobs.

A job that was aborted, or ran with ``--keep``, leaves its staging roots.
Each root records the host and pid of the leader that made it; a root of
this user, on this host, whose leader is no longer alive is stale.
"""

import os as _os


def stale_roots(candidates):
    """Yield this user's staging roots whose leader process is gone."""
    import json
    import socket

    host = socket.gethostname()
    for candidate in candidates:
        parent = _os.path.join(candidate, f"mpistage-{_os.getuid()}")
        if not _os.path.isdir(parent) or _os.path.islink(parent):
            continue
        for name in sorted(_os.listdir(parent)):
            root = _os.path.join(parent, name)
            try:
                with open(_os.path.join(root, ".mpistage-owner")) as f:
                    owner = json.load(f)
            except (OSError, ValueError):
                continue
            if owner.get("host") == host and not alive(owner.get("pid")):
                yield root


def alive(pid):
    """Whether a process with *pid* exists on this host."""
    try:
        _os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True
    return True


def clean(dry_run=False):
    """Remove (or, with *dry_run*, list) stale roots; return their paths."""
    from mpistage.stage import candidates, remove_root

    found = list(stale_roots(candidates()))
    if not dry_run:
        for root in found:
            remove_root(root)
    return found


def clean_stage(folder, dry_run=False):
    """Remove an environment staged by ``mpistage stage`` into *folder*."""
    from mpistage.envstage import marker_of
    from mpistage.errors import StageError
    from mpistage.stage import remove_root

    if _os.path.islink(folder) or not _os.path.isdir(folder):
        raise StageError(f"{folder!r} is not a directory")
    if _os.stat(folder).st_uid != _os.getuid():
        raise StageError(f"{folder!r} belongs to another user")
    if marker_of(folder) is None:
        raise StageError(f"{folder!r} is not a stage made by `mpistage stage`")
    if not dry_run:
        remove_root(folder)
    return [folder]


def cli(argv):
    """Run ``mpistage clean [DIR] [--dry-run]``; return the exit status."""
    import argparse

    p = argparse.ArgumentParser(
        prog="mpistage clean",
        description="Remove this user's staging roots of jobs that have ended, "
        "or, given DIR, an environment staged there (run it once per node).",
    )
    p.add_argument("dir", nargs="?", help="a directory `mpistage stage` filled")
    p.add_argument("--dry-run", action="store_true", help="list, do not remove")
    args = p.parse_args(argv)
    found = clean_stage(args.dir, args.dry_run) if args.dir else clean(args.dry_run)
    for root in found:
        print(("would remove " if args.dry_run else "removed ") + root)
    return 0
