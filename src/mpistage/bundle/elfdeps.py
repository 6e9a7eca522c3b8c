"""ELF dependency closure: which shared libraries a set of binaries needs.

For each ELF file, its ``DT_NEEDED`` entries are resolved the way the
dynamic loader does: ``DT_RPATH`` (when there is no ``DT_RUNPATH``), then
``LD_LIBRARY_PATH``, then ``DT_RUNPATH``, then ``ld.so.cache``, then the
default directories, with ``$ORIGIN`` expanded. Found libraries are
followed in turn. The ELF files are read with pyelftools, not by running
``ldd``; ``ld.so.cache`` is read with ``ldconfig -p``.

Libraries every node has anyway are left out: by default glibc and the
loader (:data:`DEFAULT_EXCLUDE`), plus any glob patterns the caller adds.
"""

import fnmatch as _fnmatch
import os as _os

DEFAULT_EXCLUDE = (
    "ld-linux*.so*",
    "ld64.so*",
    "libc.so*",
    "libm.so*",
    "libmvec.so*",
    "libpthread.so*",
    "libdl.so*",
    "librt.so*",
    "libutil.so*",
    "libresolv.so*",
    "libanl.so*",
    "libnsl.so*",
    "libnss_*.so*",
    "libBrokenLocale.so*",
    "libthread_db.so*",
    "libc_malloc_debug.so*",
    "linux-vdso.so*",
)
DEFAULT_DIRS = (
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
)


def is_elf(path):
    """Whether *path* is a regular file that starts with the ELF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def dynamic(path):
    """Return (needed, rpath, runpath) of the ELF file *path*."""
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    needed, rpath, runpath = [], [], []
    with open(path, "rb") as f:
        for section in ELFFile(f).iter_sections():
            if not isinstance(section, DynamicSection):
                continue
            for tag in section.iter_tags():
                if tag.entry.d_tag == "DT_NEEDED":
                    needed.append(tag.needed)
                elif tag.entry.d_tag == "DT_RPATH":
                    rpath += tag.rpath.split(":")
                elif tag.entry.d_tag == "DT_RUNPATH":
                    runpath += tag.runpath.split(":")
    return needed, rpath, runpath


def is_program(path):
    """Whether the ELF file *path* is a program (has an interpreter), not a library."""
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        elf = ELFFile(f)
        if elf["e_type"] == "ET_EXEC":
            return True
        return any(seg["p_type"] == "PT_INTERP" for seg in elf.iter_segments())


def origin_of(path):
    """Return the directory ``$ORIGIN`` stands for in the ELF file *path*.

    As the loader does: a program's is where it really is (from
    ``/proc/self/exe``, symlinks resolved); a library's is the directory of
    the path it was opened by, as it is, so a library reached through a
    symlink looks next to the symlink.
    """
    try:
        program = is_program(path)
    except Exception:  # not a readable ELF file: take it as a library
        program = False
    resolve = _os.path.realpath if program else _os.path.abspath
    return _os.path.dirname(resolve(path))


def expand(dirs, origin):
    """Expand ``$ORIGIN`` in *dirs*, dropping empty entries."""
    out = []
    for d in dirs:
        d = d.replace("${ORIGIN}", origin).replace("$ORIGIN", origin)
        if d:
            out.append(_os.path.normpath(d))
    return out


def ld_cache():
    """Return ``{soname: path}`` from ``ld.so.cache`` (via ``ldconfig -p``)."""
    import subprocess

    found = {}
    try:
        out = subprocess.run(
            ["ldconfig", "-p"], capture_output=True, text=True, check=False
        ).stdout
    except OSError:
        return found
    tag = {"x86_64": "x86-64", "aarch64": "AArch64"}.get(_os.uname().machine, "")
    for line in out.splitlines()[1:]:
        name, sep, path = line.strip().partition(" => ")
        if sep and tag in name:
            found.setdefault(name.split(" ", 1)[0], path.strip())
    return found


class Closure:
    """Resolves the shared-library dependencies of ELF files, transitively."""

    def __init__(self, exclude=(), library_path=None):
        self.exclude = tuple(DEFAULT_EXCLUDE) + tuple(exclude)
        lp = (
            _os.environ.get("LD_LIBRARY_PATH", "")
            if library_path is None
            else library_path
        )
        self.library_path = [d for d in lp.split(":") if d]
        self.cache = ld_cache()
        self.found, self.missing = {}, set()
        self.origins = {}

    def excluded(self, name):
        """Whether the library *name* is left out (every node has it)."""
        return any(_fnmatch.fnmatch(name, pattern) for pattern in self.exclude)

    def search(self, name, path, rpath, runpath):
        """Return where the loader finds *name* for the object at *path*."""
        if "/" in name:
            return name if _os.path.exists(name) else None
        if path not in self.origins:
            self.origins[path] = origin_of(path)
        origin = self.origins[path]
        dirs = [] if runpath else expand(rpath, origin)
        dirs += self.library_path + expand(runpath, origin)
        for d in dirs:
            candidate = _os.path.join(d, name)
            if _os.path.isfile(candidate):
                return candidate
        if name in self.cache:
            return self.cache[name]
        for d in DEFAULT_DIRS:
            candidate = _os.path.join(d, name)
            if _os.path.isfile(candidate):
                return candidate
        return None

    def add(self, path):
        """Resolve the dependencies of *path* and, in turn, of theirs."""
        todo = [path]
        while todo:
            current = todo.pop()
            try:
                needed, rpath, runpath = dynamic(current)
            except Exception:  # not a readable ELF file: nothing to follow
                continue
            for name in needed:
                if self.excluded(name) or name in self.found:
                    continue
                where = self.search(name, current, rpath, runpath)
                if where is None:
                    self.missing.add(name)
                    continue
                self.found[name] = where
                todo.append(where)
        return self.found


def closure(paths, exclude=(), library_path=None):
    """Return ``{soname: path}`` for every library *paths* need, and the missing."""
    resolver = Closure(exclude, library_path)
    for path in paths:
        resolver.add(path)
    return resolver.found, sorted(resolver.missing)
