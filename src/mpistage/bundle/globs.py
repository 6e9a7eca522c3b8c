"""Exclusion patterns: which members of a root ``--exclude`` leaves out.

A pattern is matched against a member's path below its root, component by
component, as ``.gitignore`` matches: ``*``, ``?`` and ``[...]`` match
within one name and never cross ``/``, so ``lib/python3.*/test`` leaves
out ``lib/python3.11/test`` and nothing deeper named ``test``. A pattern
with a ``/`` is anchored at the root (a leading ``/`` only anchors a
single name); ``**`` as a whole component matches any number of
components, none included. A pattern without a ``/`` matches a name at
any depth. A member is left out when it, or one of its parent
directories, matches: an excluded directory goes whole.
"""

from fnmatch import fnmatchcase as _fnmatchcase


def excludes(pattern, rel):
    """Whether *pattern* leaves out the member at *rel* (below its root)."""
    names = rel.split("/")
    pattern = pattern.rstrip("/")
    if "/" not in pattern:  # a name, at any depth
        return any(_fnmatchcase(name, pattern) for name in names)
    parts = pattern.lstrip("/").split("/")
    return any(matches(names[:end], parts) for end in range(1, len(names) + 1))


def matches(names, parts):
    """Whether the path components *names* match the pattern components *parts*."""
    while parts and parts[0] != "**":
        if not names or not _fnmatchcase(names[0], parts[0]):
            return False
        names, parts = names[1:], parts[1:]
    if not parts:
        return not names
    return any(matches(names[skip:], parts[1:]) for skip in range(len(names) + 1))
