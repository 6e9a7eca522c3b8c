"""Where a benchmark's files live on the simulated shared file system.

- ``realistic`` (the default): as on a cluster, everything is on the shared
  file system: a base interpreter (``base/``: ``bin/python3.X``,
  ``libpython``, the standard library) and a venv made from it (``venv/``:
  mpi4py, the MPICH wheel's libraries, mpistage itself and the workload's
  packages). Every rank starts ``venv/bin/python`` from the mount.
- ``packages``: only the workload's packages are on the shared file system;
  the interpreter, mpi4py and mpistage stay on local disk. This was the
  first benchmark's layout; it hides most of the cost and is kept as a
  labelled comparison.

The workload is reached through site-packages (``via="site"``), or through
``PYTHONPATH`` (``via="pythonpath"``), as many sites set it up.
"""

import glob as _glob
import os as _os
import shutil as _shutil
import sys as _sys

VIAS = ("site", "pythonpath")
PYTHON = "python{}.{}".format(*_sys.version_info[:2])  # bin/ and lib/ name
STDLIB_SKIP = ("site-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip")


class Layout:
    """What every layout tells the modes: how ranks start, where things are."""

    name = "?"

    def __init__(self, testbed, via="site"):
        self.testbed, self.via = testbed, via
        self.pythonpath_dir = _os.path.join(testbed.source, "pythonpath")

    def workload_dir(self):
        """The source-side directory the workload's packages go to."""
        raise NotImplementedError

    def environ(self):
        """Environment variables every rank of every mode gets."""
        env = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1"}
        if self.via == "pythonpath":
            env["PYTHONPATH"] = self.mounted(self.pythonpath_dir)
        return env

    def mounted(self, source_path):
        """Return the mount-side path of a path in the source tree."""
        rel = _os.path.relpath(source_path, self.testbed.source)
        return _os.path.join(self.testbed.mount, rel)


class Packages(Layout):
    """Only the workload on the shared FS; the interpreter is the local one."""

    name = "packages"

    def workload_dir(self):
        """``site/`` (put on ``sys.path`` by the driver), or ``pythonpath/``."""
        if self.via == "pythonpath":
            return self.pythonpath_dir
        return self.testbed.source_site

    def build(self, workload):
        """Put the workload on the shared FS (untimed)."""
        workload.build(self.workload_dir())

    @property
    def python(self):
        """The local interpreter (with mpistage, mpi4py and the MPICH wheel)."""
        return _sys.executable

    @property
    def command(self):
        """The ``mpistage`` command installed beside it."""
        return installed_command()

    def driver_site(self):
        """The root the driver puts on ``sys.path`` itself (site variant only)."""
        return None if self.via == "pythonpath" else self.testbed.shared_site

    def environ(self):
        """No ``PYTHONNOUSERSITE`` games: the local interpreter as it is."""
        env = super().environ()
        env.pop("PYTHONNOUSERSITE")
        return env


class Realistic(Layout):
    """Interpreter, stdlib, venv, mpi4py, MPICH, mpistage: all on the shared FS."""

    name = "realistic"

    def __init__(self, testbed, via="site"):
        super().__init__(testbed, via)
        self.base = _os.path.join(testbed.source, "base")
        self.venv = _os.path.join(testbed.source, "venv")
        self.site = site_packages(self.venv)

    def workload_dir(self):
        """The venv's site-packages, or ``pythonpath/``."""
        return self.pythonpath_dir if self.via == "pythonpath" else self.site

    @property
    def python(self):
        """The venv's ``bin/python``, on the mount."""
        return self.mounted(_os.path.join(self.venv, "bin", "python"))

    @property
    def command(self):
        """The venv's ``bin/mpistage`` (the ``mpistage`` command), on the mount."""
        return self.mounted(_os.path.join(self.venv, "bin", "mpistage"))

    def driver_site(self):
        """Nothing: the venv's site-packages is on ``sys.path`` already."""
        return None

    def build(self, workload):
        """Lay out the base interpreter and the venv, then the workload (untimed)."""
        copy_base(self.base)
        make_venv(self.venv, self.mounted(self.base))
        copy_packages(self.site)
        install_mpistage(self.site)
        install_command(_os.path.join(self.venv, "bin"), self.python)
        _os.makedirs(self.workload_dir(), exist_ok=True)
        workload.build(self.workload_dir())


def site_packages(prefix):
    """Return the site-packages directory of the venv at *prefix*."""
    return _os.path.join(prefix, "lib", PYTHON, "site-packages")


def copy_base(dest):
    """Copy the base interpreter, libpython and the stdlib; relocate the binary."""
    from mpistage.bundle.envpack import base_prefix, fix_runpath, read_cfg

    cfg = read_cfg(_os.path.join(_sys.prefix, "pyvenv.cfg"))
    prefix = base_prefix(cfg) if cfg else _sys.base_prefix
    binary = _os.path.join(dest, "bin", PYTHON)
    _os.makedirs(_os.path.dirname(binary))
    _shutil.copy2(_os.path.realpath(_os.path.join(prefix, "bin", PYTHON)), binary)
    libdir = _os.path.join(prefix, "lib")
    data = fix_runpath(
        binary, lambda d: "lib" if d.rstrip("/") == libdir else None, "bin"
    )
    if data is not None:
        with open(binary, "wb") as f:
            f.write(data)
    lib = _os.path.join(dest, "lib")
    _os.makedirs(lib)
    for path in _glob.glob(_os.path.join(prefix, "lib", "libpython*")):
        _shutil.copy2(path, lib, follow_symlinks=False)
    ignore = _shutil.ignore_patterns(*STDLIB_SKIP, "config-*", "*.opt-[12].pyc")
    stdlib = _os.path.join(prefix, "lib", PYTHON)
    _shutil.copytree(stdlib, _os.path.join(lib, PYTHON), ignore=ignore, symlinks=True)


def make_venv(dest, base):
    """Write a venv whose interpreter is *base*'s (on the mount), without pip."""
    _os.makedirs(_os.path.join(dest, "bin"))
    _os.makedirs(site_packages(dest))
    with open(_os.path.join(dest, "pyvenv.cfg"), "w") as f:
        f.write(f"home = {base}/bin\ninclude-system-site-packages = false\n")
        f.write("version = {}.{}.{}\n".format(*_sys.version_info[:3]))
    for name in ("python", "python3", PYTHON):
        _os.symlink(
            _os.path.join(base, "bin", PYTHON), _os.path.join(dest, "bin", name)
        )
    copy_mpich_libs(dest)


def copy_mpich_libs(dest):
    """Copy the MPICH wheel's libraries (``lib/libmpi*``, ``lib/mpich``) to *dest*."""
    lib = _os.path.join(_sys.prefix, "lib")
    for path in _glob.glob(_os.path.join(lib, "libmpi*")) + [
        _os.path.join(lib, "mpich")
    ]:
        copy(path, _os.path.join(dest, "lib", _os.path.basename(path)))


def copy_packages(site, names=("mpi4py", "mpi4py-*.dist-info", "mpich-*.dist-info")):
    """Copy what matches *names* in this environment's site-packages to *site*.

    By default: mpi4py and the MPICH wheel's metadata.
    """
    import sysconfig

    here = sysconfig.get_paths()["purelib"]
    for pattern in names:
        for path in _glob.glob(_os.path.join(here, pattern)):
            copy(path, _os.path.join(site, _os.path.basename(path)))


def install_mpistage(site):
    """Install this mpistage as pip would: the package, bytecode, a dist-info."""
    import compileall

    import mpistage

    package = _os.path.dirname(_os.path.abspath(mpistage.__file__))
    target = _os.path.join(site, "mpistage")
    _shutil.copytree(package, target, ignore=_shutil.ignore_patterns("__pycache__"))
    compileall.compile_dir(target, quiet=1)
    info = _os.path.join(site, f"mpistage-{mpistage.__version__}.dist-info")
    _os.makedirs(info)
    with open(_os.path.join(info, "METADATA"), "w") as f:
        f.write(
            f"Metadata-Version: 2.1\nName: mpistage\nVersion: {mpistage.__version__}\n"
        )
    write_record(site, info, [target, info])


def installed_command():
    """Return the ``mpistage`` command of this environment (a script)."""
    import sysconfig

    path = _os.path.join(sysconfig.get_path("scripts"), "mpistage")
    if not _os.path.isfile(path):
        from mpistage import StageError

        raise StageError(f"no mpistage command at {path!r}: install mpistage")
    return path


def install_command(folder, python):
    """Install the ``mpistage`` command into *folder* as pip would, for *python*."""
    with open(installed_command()) as f:
        body = f.read().split("\n", 1)[1]
    path = _os.path.join(folder, "mpistage")
    with open(path, "w") as f:
        f.write(f"#!{python}\n{body}")
    _os.chmod(path, 0o755)


def write_record(site, info, trees):
    """Write the ``RECORD`` of a distribution whose files are *trees*."""
    lines = []
    for tree in trees:
        for top, _dirs, files in _os.walk(tree):
            for name in files:
                lines.append(_os.path.relpath(_os.path.join(top, name), site) + ",,")
    lines.append(_os.path.relpath(_os.path.join(info, "RECORD"), site) + ",,")
    with open(_os.path.join(info, "RECORD"), "w") as f:
        f.write("\n".join(sorted(lines)) + "\n")


def copy(src, dst):
    """Copy a file, symlink or tree, symlinks as symlinks."""
    if _os.path.isdir(src) and not _os.path.islink(src):
        _shutil.copytree(src, dst, symlinks=True)
    else:
        _shutil.copy2(src, dst, follow_symlinks=False)


LAYOUTS = {layout.name: layout for layout in (Realistic, Packages)}
