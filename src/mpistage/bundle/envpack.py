"""``mpistage pack --env``: a whole Python environment as one bundle.

The bundle lays the environment out as one self-contained tree, which
``mpistage stage`` unpacks node-locally:

- a venv stays a venv, with its base interpreter inside it: the venv's tree,
  and in ``base/`` the base's executable, standard library (not its
  site-packages) and ``libpython``; ``bin/python`` links to
  ``base/bin/pythonX.Y``. Its ``pyvenv.cfg`` is written where the copy
  lands (:func:`mpistage.runtime.extract.write_venv`), since the
  interpreter reads ``home`` as an absolute path. So ``sys.prefix``, the
  site directories and ``sysconfig`` are the venv's, as with the original:
  a distribution's Python (Debian's looks in ``dist-packages`` outside a
  venv) finds the venv's ``site-packages`` too;
- a conda environment, or any other prefix, is taken whole;
- the shared libraries all of its ELF files need, outside the environment,
  go to ``lib/`` (see :mod:`mpistage.elfdeps`), except what every node has
  (glibc and the loader by default).

Relocation happens here, once: scripts whose ``#!`` names the environment's
Python get a shebang that finds ``python`` next to themselves, and absolute
RUNPATH/RPATH entries that point into the environment or at a bundled
library directory are rewritten in place to ``$ORIGIN``-relative ones.
"""

import os as _os
import sys as _sys

from mpistage import StageError

DEFAULT_EXCLUDE = (
    "lib/python3.*/test",
    "lib/python3.*/config-*",
    "**/__pycache__/*.opt-[12].pyc",
)
BASE = "base"  # where a venv's base interpreter goes in the staged tree
VENV_OWN = ("home", "executable", "command")  # pyvenv.cfg keys made anew
SHEBANG = (
    b"#!/bin/sh\n"
    b'\'\'\'exec\' "$(dirname -- "$(readlink -f -- "$0")")/python" '
    b"\"$0\" \"$@\"\n' '''\n"
)


class Env:
    """What an environment prefix is: its kind, its base, its Python."""

    def __init__(self, prefix):
        self.prefix = _os.path.abspath(prefix)
        if not _os.path.isdir(self.prefix):
            raise StageError(f"--env {prefix!r} is not a directory")
        self.cfg = read_cfg(_os.path.join(self.prefix, "pyvenv.cfg"))
        self.kind = (
            "venv"
            if self.cfg
            else (
                "conda"
                if _os.path.isdir(_os.path.join(self.prefix, "conda-meta"))
                else "prefix"
            )
        )
        self.base = base_prefix(self.cfg) if self.cfg else None
        self.version = python_version(self.cfg)


def python_version(cfg):
    """Return ``X.Y`` of the environment's Python: ``pyvenv.cfg``, else this one."""
    parts = cfg.get("version", cfg.get("version_info", "")).split(".")
    if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
        return f"{parts[0]}.{parts[1]}"
    return "{}.{}".format(*_sys.version_info[:2])


def python_tag(version):
    """Return the Python tag of a bundle for Python *version* (``X.Y``)."""
    from mpistage.runtime.bundlefile import python_tag as current

    tag, here = current(), "{}{}".format(*_sys.version_info[:2])
    there = version.replace(".", "")
    tag["version"] = version
    tag["cache_tag"] = tag["cache_tag"].replace(here, there)
    tag["ext_suffix"] = tag["ext_suffix"].replace(here, there)
    return tag


def read_cfg(path):
    """Return ``pyvenv.cfg`` as a dict, or ``{}`` when there is none."""
    if not _os.path.isfile(path):
        return {}
    cfg = {}
    with open(path) as f:
        for line in f:
            key, sep, value = line.partition("=")
            if sep:
                cfg[key.strip()] = value.strip()
    return cfg


def base_prefix(cfg):
    """Return the prefix of the interpreter a venv was made from."""
    executable = cfg.get("executable") or _os.path.join(cfg.get("home", ""), "python3")
    return _os.path.dirname(_os.path.dirname(_os.path.realpath(executable)))


def pack_env(output, prefix=None, exclude=(), exclude_libs=()):
    """Write the environment at *prefix* (default ``sys.prefix``) to *output*.

    Returns the manifest; ``manifest["env"]["missing"]`` names the libraries
    that could not be found.
    """
    from mpistage.bundle.writer import Selection

    try:
        import elftools  # noqa: F401
    except ImportError:
        raise StageError(
            "pack --env reads ELF files with pyelftools: pip install 'mpistage[env]'"
        ) from None
    env = Env(prefix or _sys.prefix)
    if env.base:
        check_base(env)
    watch = watch_env(env)  # before reading: a change while packing shows later
    roots = Selection(exclude=DEFAULT_EXCLUDE + tuple(exclude))
    take_env(roots, env)
    if env.base:
        take_base(roots, env)
    libs, missing = take_libraries(roots, env, exclude_libs)
    return write_env(output, roots, env, libs, missing, watch)


def watch_env(env):
    """The directories ``mpistage run`` checks for changes, with their state now.

    See :mod:`mpistage.runtime.envfresh`.
    """
    from mpistage.runtime.envfresh import snapshot, watched

    stdlib = _os.path.join(env.base or env.prefix, "lib", f"python{env.version}")
    return snapshot(watched(env.prefix, stdlib))


def take_env(roots, env):
    """Take the environment's own tree (a venv without its interpreter links)."""
    skip = {"pyvenv.cfg"} if env.base else set()  # written where it lands
    for entry in sorted(_os.listdir(env.prefix)):
        if entry not in skip:
            roots.take(env.prefix, _os.path.join(env.prefix, entry))
    bindir = _os.path.join(env.prefix, "bin")
    if env.base and _os.path.isdir(bindir):
        for name in _os.listdir(bindir):
            if name.startswith("python"):
                roots.drop(env.prefix, _os.path.join(bindir, name))


def check_base(env):
    """Refuse a venv whose base interpreter is not here, with one clear line."""
    lib = f"python{env.version}"
    if not _os.path.isdir(_os.path.join(env.base, "lib", lib)):
        raise StageError(
            f"the venv {env.prefix!r} was made from Python {env.version} in "
            f"{env.base!r}, whose standard library is not there: pack the venv "
            "on a machine that has its base interpreter"
        )


def take_base(roots, env):
    """Take the base interpreter, its stdlib and libpython, not its packages."""
    base, lib = env.base, f"python{env.version}"
    roots.take(base, _os.path.realpath(_os.path.join(base, "bin", lib)))
    stdlib = _os.path.join(base, "lib", lib)
    for entry in sorted(_os.listdir(stdlib)):
        if entry != "site-packages":
            roots.take(base, _os.path.join(stdlib, entry))
    libdir = _os.path.join(base, "lib")
    for entry in sorted(_os.listdir(libdir)):
        if entry.startswith("libpython"):
            roots.take(base, _os.path.join(libdir, entry))


def elf_members(roots):
    """Yield every regular ELF file chosen so far."""
    from mpistage.bundle.elfdeps import is_elf

    for root in roots.paths:
        for path in roots.taken(root):
            if not _os.path.islink(path) and _os.path.isfile(path) and is_elf(path):
                yield path


def take_libraries(roots, env, exclude_libs):
    """Add the shared libraries the ELF files need from outside the roots."""
    from mpistage.bundle.elfdeps import closure

    lib_path = [_os.path.join(p, "lib") for p in (env.prefix, env.base) if p]
    extra = ":".join(lib_path + [_os.environ.get("LD_LIBRARY_PATH", "")])
    found, missing = closure(sorted(elf_members(roots)), exclude_libs, extra)
    outside = {}
    for name, path in found.items():
        if not any(path.startswith(r + _os.sep) for r in roots.paths[:2]):
            outside[name] = path
    for _name, path in sorted(outside.items()):
        roots.add(_os.path.dirname(path), path)
    return outside, unbundled(roots, missing)


def unbundled(roots, missing):
    """Return the names of *missing* that no file chosen so far carries.

    A library one ELF file cannot find on its own search path (no run path
    to a wheel's ``.libs``) may still be in the bundle, for the files that
    do find it: that one is not missing.
    """
    names = {_os.path.basename(p) for root in roots.paths for p in roots.taken(root)}
    return [name for name in missing if name not in names]


def destination(roots, env, root):
    """Return where *root* goes in the staged tree."""
    if root == env.prefix:
        return ""
    return BASE if root == env.base else "lib"


def new_dir(roots, env, path):
    """Return the staged directory (tree-relative) of an original dir *path*.

    A venv made inside its base's prefix (or the other way round) belongs
    to the longer, nearer one.
    """
    for root in sorted((r for r in (env.prefix, env.base) if r), key=len, reverse=True):
        if path == root or path.startswith(root + _os.sep):
            rel = _os.path.relpath(path, root)
            return _os.path.normpath(_os.path.join(destination(roots, env, root), rel))
    if path in roots.paths:
        return "lib"
    return None


def relocated(roots, env, root, path):
    """Return *path*'s content fixed for its new place, or ``None`` if unchanged."""
    from mpistage.bundle.elfdeps import is_elf

    with open(path, "rb") as f:
        head = f.read(256)
    if head.startswith(b"#!") and b"python" in head.split(b"\n", 1)[0]:
        return fix_shebang(path, env)
    if is_elf(path):
        own = _os.path.dirname(
            _os.path.join(destination(roots, env, root), _os.path.relpath(path, root))
        )
        return fix_runpath(path, lambda d: new_dir(roots, env, d), own)
    return None


def fix_shebang(path, env):
    """Give a script of this environment a shebang that works anywhere."""
    with open(path, "rb") as f:
        first, _, rest = f.read().partition(b"\n")
    target = first[2:].strip().split(b" ")[0].decode(errors="replace")
    if not any(target.startswith(p + _os.sep) for p in (env.prefix, env.base) if p):
        return None
    return SHEBANG + rest


def fix_runpath(path, mapping, own_dir):
    """Rewrite absolute RUNPATH/RPATH entries in place as ``$ORIGIN`` paths.

    Returns the new content, or ``None`` when nothing needed to change. An
    entry whose new form would not fit in the old string is left as it is.
    """
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        data = bytearray(f.read())
        elf = ELFFile(f)
        strtab = elf.get_section_by_name(".dynstr")
        if strtab is None:
            return None
        changed = False
        for section in elf.iter_sections():
            if isinstance(section, DynamicSection):
                for tag in section.iter_tags():
                    if tag.entry.d_tag in ("DT_RPATH", "DT_RUNPATH"):
                        offset = strtab["sh_offset"] + tag.entry.d_val
                        changed |= patch_string(data, offset, mapping, own_dir)
    return bytes(data) if changed else None


def patch_string(data, offset, mapping, own_dir):
    """Rewrite one NUL-terminated search path at *offset* of *data*."""
    end = data.index(b"\0", offset)
    old = data[offset:end].decode()
    entries = []
    for entry in old.split(":"):
        target = mapping(entry) if entry.startswith("/") else None
        if target is not None:
            entry = "$ORIGIN/" + _os.path.relpath(target, own_dir or ".")
        entries.append(entry)
    new = ":".join(entries).encode()
    if new == old.encode() or len(new) > end - offset:
        return False
    data[offset:end] = new + b"\0" * (end - offset - len(new))
    return True


def write_env(output, roots, env, libs, missing, watch=()):
    """Relocate what needs it and write the environment bundle."""
    from mpistage.bundle.envboot import launch_field
    from mpistage.bundle.writer import write

    for root in roots.paths:
        roots.place(root, destination(roots, env, root))
        for path in sorted(roots.taken(root)):
            place_member(roots, env, root, path)
    if env.base:
        target = _os.path.join("..", venv_field(env)["executable"])
        for name in ("python", "python3", f"python{env.version}"):
            roots.link(env.prefix, f"bin/{name}", target)
    fields = {
        "kind": "env",
        "created_by": "pack --env",
        "python": python_tag(env.version),
        "packages": [],
        "env": {
            "kind": env.kind,
            "prefix": env.prefix,
            "base": env.base,
            "libraries": sorted(libs),
            "missing": missing,
            "watch": list(watch),
            "venv": venv_field(env) if env.base else None,
        },
        "launch": launch_field(),  # mpistage-env's extraction code
    }
    return write(output, roots, fields)


def venv_field(env):
    """What the staged ``pyvenv.cfg`` says: paths below the tree, other keys kept.

    The writer at the other end: :func:`mpistage.runtime.extract.write_venv`.
    """
    base_python = _os.path.join(env.base, "bin", f"python{env.version}")
    interpreter = _os.path.realpath(base_python)
    return {
        "home": f"{BASE}/bin",
        "executable": f"{BASE}/bin/{_os.path.basename(interpreter)}",
        "cfg": {k: v for k, v in env.cfg.items() if k.lower() not in VENV_OWN},
    }


def place_member(roots, env, root, path):
    """Record where one file goes and, if it must change, its new content."""
    if path == root:
        return
    source = path
    if destination(roots, env, root) == "lib":
        # The soname the loader asks for, with the content it resolves to.
        source = _os.path.realpath(path)
        roots.relocate(root, path, rel=_os.path.basename(path), source=source)
    if _os.path.isfile(source) and not _os.path.islink(source):
        data = relocated(roots, env, root, source)
        if data is not None:
            roots.relocate(root, path, data=data)
