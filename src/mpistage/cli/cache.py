"""``mpistage clean --cache``: see and trim the bundles ``--auto`` keeps.

Each program run with ``--auto`` leaves one bundle in the cache (50-230 MB
for numpy or scipy). A bundle's last use is the later of its atime and
mtime: replays read it, which moves its atime at least once a day (Linux's
``relatime``). Removing a cached bundle is always safe: the next ``--auto``
run of its program learns it again.
"""

import os as _os
import time as _time

DAY = 86400.0


class Cached:
    """One cached bundle: its path, size in bytes and seconds since last use."""

    def __init__(self, path, st, now):
        self.path, self.size = path, st.st_size
        self.idle = max(0.0, now - max(st.st_atime, st.st_mtime))


def cached(folder):
    """Return the bundles in the cache *folder*, least recently used first."""
    from mpistage.runtime.bundlefile import SUFFIX

    now, found = _time.time(), []
    try:
        names = _os.listdir(folder)
    except FileNotFoundError:
        return []
    for name in names:
        path = _os.path.join(folder, name)
        if name.endswith(SUFFIX) and not name.startswith("."):
            st = _os.lstat(path)
            if _os.path.stat.S_ISREG(st.st_mode):
                found.append(Cached(path, st, now))
    return sorted(found, key=lambda c: -c.idle)


def chosen(bundles, older_than=None, max_size=None):
    """Return the bundles to remove: idle longer than *older_than* days, then
    the least recently used until the rest fit in *max_size* bytes; all of
    them when neither limit is given."""
    if older_than is None and max_size is None:
        return list(bundles)
    old = [b for b in bundles if older_than is not None and b.idle > older_than * DAY]
    kept = [b for b in bundles if b not in old]
    total = sum(b.size for b in kept)
    for b in kept:
        if max_size is None or total <= max_size:
            break
        old.append(b)
        total -= b.size
    return old


def clean_cache(folder=None, older_than=None, max_size=None, dry_run=False):
    """Trim the ``--auto`` cache; return (removed, kept), lists of :class:`Cached`."""
    from mpistage.runtime.auto import cache_dir

    bundles = cached(cache_dir(folder))
    gone = chosen(bundles, older_than, max_size)
    for b in gone if not dry_run else ():
        try:
            _os.unlink(b.path)
        except FileNotFoundError:
            pass  # Another clean, or a job that rebuilt it, was first.
    return gone, [b for b in bundles if b not in gone]


def describe(bundle):
    """Return one line about *bundle*: size, idle days, path."""
    return f"{bundle.size / 1e6:10.1f} MB  {bundle.idle / DAY:6.1f} d  {bundle.path}"


def report(gone, kept, dry_run, folder):
    """Print what was (or would be) removed and what the cache holds now."""
    verb = "would remove" if dry_run else "removed"
    for b in gone:
        print(f"{verb} {describe(b)}")
    for b in kept:
        print(f"kept {describe(b)}")
    size = sum(b.size for b in kept) / 1e6
    holds = "would hold" if dry_run else "holds"
    print(f"cache {folder} {holds} {len(kept)} bundle(s), {size:.1f} MB")
