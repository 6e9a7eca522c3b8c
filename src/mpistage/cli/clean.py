"""``mpistage clean [DIR] [--dry-run]``: remove node places left behind.

A job whose nodes crashed, or that ran with ``--keep``, leaves its staging
roots. Each root records the host and pid of the leader that made it; a
root of this user, on this host, whose leader is gone or a zombie is stale.
Environment stages under their default name (``mpistage-env-UID-...``)
whose job ended are stale too (:mod:`mpistage.runtime.envreap`).
Given ``DIR``, it removes an environment that ``mpistage stage`` filled,
complete or interrupted. Removal is :func:`mpistage.node.cleanup.remove`.

:data:`REMOVE_STAGE` is the same removal for ``mpistage run``'s clean step,
as a ``/bin/sh`` script: it runs on every node, where starting Python from
the shared file system would cost as much as the stage step itself, and
where the stage may be half-written or missing.
"""

import os as _os

from mpistage import StageError

# mine DIR TOKEN: if the run with TOKEN made DIR, print what it made ("dir":
# the directory; "contents": only what is inside an existing one), a space
# and DIR's real path. It made it if DIR is this user's directory, not a
# symlink, with a stage marker of this user (a regular file, no symlink)
# that holds TOKEN and, as the path DIR was made at, the path DIR resolves
# to now.
MINE = r"""
mine() {
  [ -n "$2" ] && [ -d "$1" ] && [ ! -L "$1" ] && [ -O "$1" ] || return 1
  [ -f "$1/.mpistage-stage" ] && [ ! -L "$1/.mpistage-stage" ] &&
    [ -O "$1/.mpistage-stage" ] || return 1
  _real=$(cd -P -- "$1" 2>/dev/null && pwd -P) || return 1
  _token= _path= _made=contents
  while IFS= read -r _line || [ -n "$_line" ]; do
    case $_line in
      token=*) _token=${_line#token=} ;;
      path=*) _path=${_line#path=} ;;
      made=dir) _made=dir ;;
    esac
  done < "$1/.mpistage-stage"
  [ "$_token" = "$2" ] && [ "$_path" = "$_real" ] || return 1
  printf '%s %s\n' "$_made" "$_real"
}
"""

# drop DIR [contents]: remove what is in DIR, its stage marker last, then
# DIR itself (unless "contents"). A removal cut short (the job's end, its
# processes killed) leaves the marker, the owner record by which the next
# job's stage step, or `mpistage clean`, knows the rest for garbage.
DROP = r"""
drop() {
  for _e in "$1"/* "$1"/.[!.]* "$1"/..?*; do
    { [ -e "$_e" ] || [ -L "$_e" ]; } || continue
    [ "$_e" = "$1/.mpistage-stage" ] || rm -rf -- "$_e" || return 1
  done
  if [ "$2" = contents ]; then
    rm -f -- "$1/.mpistage-stage"
  else
    rm -rf -- "$1"
  fi
}
"""

# sh -c REMOVE_STAGE mpistage-clean TOKEN DIR...: remove what the run with
# TOKEN made of each DIR (the directory, or what it put in an existing one);
# leave anything else: another run's stage, one reached through a symlink,
# a directory or a marker of another user. A symlink or a directory not
# this user's is said in one line.
REMOVE_STAGE = (
    MINE
    + DROP
    + r"""
status=0
token=$1
shift
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
  elif found=$(mine "$dir" "$token"); then
    real=${found#* }
    drop "$real" "${found%% *}" || status=1
  fi
done
exit $status
"""
)


def clean(folder=None, dry_run=False):
    """Remove (or, with *dry_run*, list) stale roots, or the stage in *folder*.

    ``{node}`` in *folder* stands for each of ``MPISTAGE_EMULATE_NODES``
    emulated nodes, which share this machine.
    """
    from mpistage.runtime.stager import node_dir, per_node

    if not folder:
        return clean_roots(dry_run)
    if not per_node(folder):
        return clean_stage(folder, dry_run)
    from mpistage.cli.launchers import emulated

    count = emulated() or 1
    found = []
    for node in range(count):
        path = node_dir(folder, node)
        if _os.path.isdir(path):
            found += clean_stage(path, dry_run)
    parent = _os.path.dirname(node_dir(folder, 0))
    if not per_node(_os.path.dirname(folder)) and not dry_run:
        try:
            _os.rmdir(parent)  # The parent the stage step made, now empty.
        except OSError:
            pass
    return found


def clean_roots(dry_run=False):
    """Remove this user's stale places on this host; return their paths."""
    from mpistage.node.cleanup import user_dirs
    from mpistage.node.place import candidates, open_safe
    from mpistage.runtime.envreap import reap

    found = []
    for candidate in candidates():
        try:
            real, fd = open_safe(candidate)
        except (StageError, OSError):
            continue
        try:
            for name in user_dirs(fd):
                found += clean_user_dir(fd, f"{real}/{name}", name, dry_run)
            found += [f"{real}/{n}" for n in reap(fd, kept_too=True, dry_run=dry_run)]
        finally:
            _os.close(fd)
    return found


def clean_user_dir(candidate_fd, path, name, dry_run):
    """Remove the stale roots in one of this user's directories; return their paths."""
    from mpistage.node.cleanup import doom, stale_roots
    from mpistage.node.place import DIR_FLAGS, check_own

    try:
        fd = _os.open(name, DIR_FLAGS, dir_fd=candidate_fd)
    except OSError:
        return []
    found = []
    try:
        check_own(_os.fstat(fd), path, True)
        for root in list(stale_roots(fd, kept_too=True)):
            found.append(f"{path}/{root}")
            if not dry_run:
                doom(fd, root)
    except StageError:
        return []  # Somebody else's (a squatter's): not ours to clean.
    finally:
        _os.close(fd)
    if name != f"mpistage-{_os.getuid()}" and not dry_run:
        try:
            _os.rmdir(name, dir_fd=candidate_fd)  # A private directory, now empty.
        except OSError:
            pass
    return found


def clean_stage(folder, dry_run=False):
    """Remove an environment staged by ``mpistage stage`` into *folder*."""
    from mpistage.node.cleanup import remove
    from mpistage.node.place import target_dir
    from mpistage.runtime.envreap import read_marker

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
    from mpistage.cli import argument_parser

    p = argument_parser(
        prog="mpistage clean",
        description="Remove this user's node places of jobs that have ended, "
        "or, given DIR, an environment staged there (run it once per node).",
    )
    p.add_argument("dir", nargs="?", help="a directory `mpistage stage` filled")
    p.add_argument("--dry-run", action="store_true", help="list, do not remove")
    cache = p.add_argument_group(
        "the --auto cache",
        "--cache removes the bundles --auto keeps (each is learned again on its "
        "program's next --auto run), or only those past a limit; with --dry-run "
        "it lists them with their sizes and days since last use",
    )
    cache.add_argument("--cache", action="store_true", help="trim the --auto cache")
    cache.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="the cache (default: $MPISTAGE_CACHE_DIR, else "
        "$XDG_CACHE_HOME/mpistage or ~/.cache/mpistage)",
    )
    cache.add_argument(
        "--older-than",
        type=float,
        metavar="DAYS",
        help="remove only bundles unused for more than DAYS days",
    )
    cache.add_argument(
        "--max-size",
        metavar="SIZE",
        help="then remove the least recently used until the cache holds at "
        "most SIZE (e.g. 2GB, 500MiB)",
    )
    return p


def main(argv):
    """Run ``mpistage clean``; return the exit status."""
    args = parser().parse_args(argv)
    if args.cache or args.cache_dir or args.older_than or args.max_size:
        return main_cache(args)
    for root in clean(args.dir, dry_run=args.dry_run):
        print(("would remove " if args.dry_run else "removed ") + root)
    return 0


def main_cache(args):
    """Run ``mpistage clean --cache``; return the exit status."""
    from mpistage.bench.units import parse_size
    from mpistage.cli.cache import clean_cache, report
    from mpistage.runtime.auto import cache_dir

    if args.dir:
        raise StageError("--cache trims the --auto cache: give no DIR")
    limit = parse_size(args.max_size, "--max-size") if args.max_size else None
    gone, kept = clean_cache(args.cache_dir, args.older_than, limit, args.dry_run)
    report(gone, kept, args.dry_run, cache_dir(args.cache_dir))
    return 0
