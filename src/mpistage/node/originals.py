"""The originals the node boot copies: directories opened once, listed once.

The first rank of a node reads what it copies (:mod:`mpistage.node.copy`)
relative to a descriptor of each original directory, opened once, and
answers every question about a directory from one listing of it: where
the dynamic loader would find a library, which files a package's
directory or a plugin directory holds. So a shared file system sees one
open and one listing per directory, and one open per file.
"""

import os as _os

from mpistage import read_fd
from mpistage.node.elf import shared_object

PLUGIN_FILES = 256  # files a plugin directory may hold to be copied


class Originals:
    """The original directories and files, reached through descriptors."""

    def __init__(self):
        self.dirs, self.listings = {}, {}

    def dir_fd(self, folder):
        """Return a descriptor of the original directory *folder* (opened once)."""
        if folder not in self.dirs:
            flags = _os.O_RDONLY | _os.O_DIRECTORY | _os.O_CLOEXEC
            self.dirs[folder] = _os.open(folder, flags)
        return self.dirs[folder]

    def listing(self, folder):
        """Return {name: is directory} of the original *folder* (None if missing)."""
        if folder not in self.listings:
            try:
                with _os.scandir(self.dir_fd(folder)) as entries:
                    found = {e.name: e.is_dir() for e in entries}
            except OSError:
                found = None
            self.listings[folder] = found
        return self.listings[folder]

    def read(self, path):
        """Return the bytes of the original file *path*."""
        folder, name = _os.path.split(path)
        fd = _os.open(name, _os.O_RDONLY | _os.O_CLOEXEC, dir_fd=self.dir_fd(folder))
        try:
            return read_fd(fd, _os.fstat(fd).st_size)
        finally:
            _os.close(fd)

    def tree_files(self, folder, depth, most, found=None):
        """Return the files below *folder*; None past the bounds.

        A ``__pycache__`` is named as a directory (``path/``), not read:
        the copy holds it empty, so that the copy's directory lists as the
        original's does, while the bytecode in it (Python's own cache)
        costs the shared file system nothing.
        """
        found = [] if found is None else found
        entries = self.listing(folder)
        if entries is None or depth == 0:
            return None
        for name, is_dir in sorted(entries.items()):
            path = f"{folder}/{name}"
            if name == "__pycache__" and is_dir:
                found.append(path + "/")
            elif is_dir:
                if self.tree_files(path, depth - 1, most, found) is None:
                    return None
            else:
                found.append(path)
            if len(found) > most:
                return None
        return found

    def plugin_files(self, folder, depth, found=None):
        """Return the files of a directory of shared objects only, else None."""
        found = [] if found is None else found
        entries = self.listing(folder)
        if entries is None or depth == 0:
            return None
        for name, is_dir in sorted(entries.items()):
            path = f"{folder}/{name}"
            if is_dir:
                if self.plugin_files(path, depth - 1, found) is None:
                    return None
            elif not shared_object(name):
                return None
            else:
                found.append(path)
            if len(found) > PLUGIN_FILES:
                return None
        return found

    def close(self):
        """Close the descriptors of the original directories."""
        for fd in self.dirs.values():
            _os.close(fd)
        self.dirs = {}
