"""The one way anything staged is deleted.

:func:`remove` takes a staging directory away, :func:`remove_entry` any
tree below a directory descriptor. The walk is a loop, not a recursion, and
holds two descriptors at most, however deep the tree (a bundle, or the
program, chooses the depth); it never follows a symlink, and it checks that
``..`` leads back to the directory it came from.
"""

import errno as _errno
import os as _os

from mpistage import StageError
from mpistage.runtime.place import DIR_FLAGS, open_safe


def remove(root):
    """Remove the staging directory *root* and everything below it."""
    if root is None or root.parent_fd is None:
        return
    remove_entry(root.parent_fd, root.name)
    if root.holder is not None:
        try:
            _os.rmdir(root.holder[1], dir_fd=root.holder[0])
        except OSError:
            pass  # Not empty any more: another root was made there meanwhile.
    root.close()


def remove_path(path):
    """Remove the staging directory at *path* (found again from its safe parent)."""
    parent, name = _os.path.split(path)
    real, fd = open_safe(parent)
    try:
        remove_entry(fd, name)
    finally:
        _os.close(fd)


def empty(fd):
    """Remove everything inside the directory open as *fd*."""
    with _os.scandir(fd) as entries:
        names = [entry.name for entry in entries]
    for name in names:
        remove_entry(fd, name)


def remove_entry(parent_fd, name):
    """Remove *name* below *parent_fd*, with everything below it.

    A loop, not a recursion, holding two descriptors at most: it goes down
    into the first non-empty directory, and back up through ``..`` once a
    directory is empty, checking that ``..`` is the directory it came from.
    No symlink is followed. Another process may be removing the same tree
    (two ranks of a failing node): what is already gone is not an error.
    """
    if unlink_or_rmdir(parent_fd, name):
        return
    try:
        fd = _os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except (FileNotFoundError, NotADirectoryError):
        return
    trail = [_os.fstat(fd)]
    try:
        while True:
            child = first_nonempty(fd)
            if child is not None:
                fd = descend(fd, child, trail)
            elif len(trail) > 1:
                fd = ascend(fd, trail)
            else:
                break
    finally:
        _os.close(fd)
    for _attempt in range(3):
        if unlink_or_rmdir(parent_fd, name):
            return
        # A rank still running wrote bytecode meanwhile: empty it again.
        fd = _os.open(name, DIR_FLAGS, dir_fd=parent_fd)
        try:
            empty(fd)
        finally:
            _os.close(fd)


def unlink_or_rmdir(fd, name):
    """Remove a file, link or empty directory; ``False`` if it is a full directory."""
    try:
        _os.unlink(name, dir_fd=fd)
        return True
    except FileNotFoundError:
        return True
    except (IsADirectoryError, PermissionError):
        pass
    try:
        _os.rmdir(name, dir_fd=fd)
        return True
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno in (_errno.ENOTEMPTY, _errno.EEXIST):
            return False
        raise


def first_nonempty(fd):
    """Remove what can go at once below *fd*; return a full subdirectory, or None."""
    with _os.scandir(fd) as entries:
        names = [entry.name for entry in entries]
    for name in names:
        if not unlink_or_rmdir(fd, name):
            return name
    return None


def descend(fd, name, trail):
    """Go down from *fd* into its directory *name*; return the new descriptor."""
    child = _os.open(name, DIR_FLAGS, dir_fd=fd)
    _os.close(fd)
    trail.append(_os.fstat(child))
    return child


def ascend(fd, trail):
    """Go up from *fd* to its parent, which must be the one we came from."""
    parent = _os.open("..", DIR_FLAGS, dir_fd=fd)
    _os.close(fd)
    trail.pop()
    st, want = _os.fstat(parent), trail[-1]
    if (st.st_dev, st.st_ino) != (want.st_dev, want.st_ino):
        _os.close(parent)
        raise StageError("a directory being removed was moved away")
    return parent
