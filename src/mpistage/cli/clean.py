"""``mpistage clean [DIR] [--dry-run]``: remove staging roots left behind.

A job whose nodes crashed, or that ran with ``--keep``, leaves its staging
roots. Each root records the host and pid of the leader that made it; a
root of this user, on this host, whose leader is gone or a zombie is stale.
Given ``DIR``, it removes an environment that ``mpistage stage`` filled,
complete or interrupted. Removal is :func:`mpistage.runtime.place.remove`.

:data:`REMOVE_STAGE` is the same removal for ``mpistage run``'s clean step,
as a ``/bin/sh`` script: it runs on every node, where starting Python from
the shared file system would cost as much as the stage step itself, and
where the stage may be half-written or missing.
"""

import os as _os

from mpistage import StageError

# sh -c REMOVE_STAGE mpistage-clean DIR...: remove each DIR that holds the
# marker of `mpistage stage` (complete or interrupted); remove it if the
# failed stage step left it empty; leave anything else and say so.
REMOVE_STAGE = r"""
status=0
node=${SLURMD_NODENAME:-$(uname -n)}
for dir in "$@"; do
  if [ -L "$dir" ]; then
    echo "mpistage: error: on $node: $dir is a symlink, not a stage; left as it is" >&2
    status=1
  elif [ ! -e "$dir" ]; then
    :
  elif [ ! -d "$dir" ] || [ ! -O "$dir" ]; then
    echo "mpistage: error: on $node: $dir is not your directory; left as it is" >&2
    status=1
  elif [ -f "$dir/.mpistage-stage" ] && [ ! -L "$dir/.mpistage-stage" ]; then
    rm -rf -- "$dir" || status=1
  else
    rmdir -- "$dir" 2>/dev/null || :
  fi
done
exit $status
"""


def clean(folder=None, dry_run=False):
    """Remove (or, with *dry_run*, list) stale roots, or the stage in *folder*.

    ``{node}`` in *folder* stands for each of ``MPISTAGE_EMULATE_NODES``
    emulated nodes, which share this machine.
    """
    if not folder:
        return clean_roots(dry_run)
    if "{node}" not in folder:
        return clean_stage(folder, dry_run)
    count = int(_os.environ.get("MPISTAGE_EMULATE_NODES") or 1)
    found = []
    for node in range(count):
        path = folder.replace("{node}", str(node))
        if _os.path.isdir(path):
            found += clean_stage(path, dry_run)
    parent = _os.path.dirname(folder.replace("{node}", "0"))
    if "{node}" not in _os.path.dirname(folder) and not dry_run:
        try:
            _os.rmdir(parent)  # The parent the stage step made, now empty.
        except OSError:
            pass
    return found


def clean_roots(dry_run=False):
    """Remove this user's stale staging roots on this host; return their paths."""
    from mpistage.runtime.place import candidates, open_safe, remove_entry

    found = []
    for candidate in candidates():
        try:
            real, fd = open_safe(_os.path.join(candidate, f"mpistage-{_os.getuid()}"))
        except (StageError, OSError):
            continue
        try:
            for name in stale_in(fd):
                found.append(f"{real}/{name}")
                if not dry_run:
                    remove_entry(fd, name)
        finally:
            _os.close(fd)
    return found


def stale_in(fd):
    """Yield the names of the stale roots in this user's directory *fd*."""
    from mpistage.runtime.place import DIR_FLAGS, read_owner

    host = _os.uname().nodename
    for name in sorted(_os.listdir(fd)):
        try:
            root_fd = _os.open(name, DIR_FLAGS, dir_fd=fd)
        except OSError:
            continue
        try:
            owner = read_owner(root_fd)
        finally:
            _os.close(root_fd)
        if owner and owner.get("host") == host and not alive(owner.get("pid")):
            yield name


def alive(pid):
    """Whether a process with *pid* runs on this host (a zombie does not)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, ValueError, TypeError, IndexError):
        return False
    return state not in ("Z", "X")


def clean_stage(folder, dry_run=False):
    """Remove an environment staged by ``mpistage stage`` into *folder*."""
    from mpistage.runtime.place import remove, target_dir
    from mpistage.runtime.stager import read_marker

    if _os.path.islink(folder) or not _os.path.isdir(folder):
        raise StageError(f"{folder!r} is not a directory")
    root = target_dir(folder)
    if not read_marker(root.fd):
        root.close()
        raise StageError(f"{folder!r} is not a stage made by `mpistage stage`")
    if dry_run:
        root.close()
    else:
        remove(root)
    return [folder]


def parser():
    """Return the argument parser of ``mpistage clean``."""
    import argparse

    p = argparse.ArgumentParser(
        prog="mpistage clean",
        description="Remove this user's staging roots of jobs that have ended, "
        "or, given DIR, an environment staged there (run it once per node).",
    )
    p.add_argument("dir", nargs="?", help="a directory `mpistage stage` filled")
    p.add_argument("--dry-run", action="store_true", help="list, do not remove")
    return p


def main(argv):
    """Run ``mpistage clean``; return the exit status."""
    args = parser().parse_args(argv)
    for root in clean(args.dir, dry_run=args.dry_run):
        print(("would remove " if args.dry_run else "removed ") + root)
    return 0
