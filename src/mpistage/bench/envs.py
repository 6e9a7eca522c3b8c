"""A small Python environment for benchmarks and tests: a venv holding
copies of mpi4py, the MPICH wheel's files and numpy from the running one."""

import glob as _glob
import os as _os
import shutil as _shutil
import subprocess as _subprocess
import sys as _sys

PACKAGES = ("mpi4py", "numpy")
MPICH_BIN = (
    "mpiexec",
    "mpiexec.hydra",
    "mpirun",
    "hydra_pmi_proxy",
    "hydra_nameserver",
    "hydra_persist",
)


def site_packages(prefix):
    """Return the site-packages directory of the venv at *prefix*."""
    version = "python{}.{}".format(*_sys.version_info[:2])
    return _os.path.join(prefix, "lib", version, "site-packages")


def small_env(dest, packages=PACKAGES):
    """Make a venv at *dest* with copies of *packages* and the MPICH wheel."""
    _subprocess.run([base_python(), "-m", "venv", "--without-pip", dest], check=True)
    here, there = site_packages(_sys.prefix), site_packages(dest)
    for name in packages:
        for entry in _glob.glob(_os.path.join(here, f"{name}*")):
            copy(entry, _os.path.join(there, _os.path.basename(entry)))
    for entry in _glob.glob(_os.path.join(here, "mpich-*.dist-info")):
        copy(entry, _os.path.join(there, _os.path.basename(entry)))
    lib = _os.path.join(_sys.prefix, "lib")
    for entry in _glob.glob(_os.path.join(lib, "libmpi*")) + [
        _os.path.join(lib, "mpich")
    ]:
        copy(entry, _os.path.join(dest, "lib", _os.path.basename(entry)))
    for name in MPICH_BIN:
        if _os.path.exists(_os.path.join(_sys.prefix, "bin", name)):
            copy(
                _os.path.join(_sys.prefix, "bin", name),
                _os.path.join(dest, "bin", name),
            )
    return dest


def copy(src, dst):
    """Copy a file, symlink or tree."""
    if _os.path.isdir(src) and not _os.path.islink(src):
        _shutil.copytree(src, dst, symlinks=True)
    else:
        _shutil.copy2(src, dst, follow_symlinks=False)


def base_python():
    """Return the interpreter this venv was made from (itself if not a venv)."""
    from mpistage.bundle.envpack import read_cfg

    cfg = read_cfg(_os.path.join(_sys.prefix, "pyvenv.cfg"))
    return cfg.get("executable") or _sys.executable


def shared_env(bench):
    """Once per bench: an environment bundle, and its relocated copy, on the
    shared FS (``bundles/env.mpistage`` and ``env/``). Untimed."""
    bundle = _os.path.join(bench.source, "bundles", "env.mpistage")
    if _os.path.exists(bundle):
        return
    _os.makedirs(_os.path.dirname(bundle), exist_ok=True)
    prefix = small_env(_os.path.join(bench.work, "small-env"))
    run = [_sys.executable, "-m", "mpistage"]
    quiet = {"stdout": _subprocess.DEVNULL, "stderr": _subprocess.DEVNULL}
    _subprocess.run(run + ["pack", "--env", prefix, "-o", bundle], check=True, **quiet)
    target = _os.path.join(bench.source, "env")
    _subprocess.run(run + ["stage", bundle, "--to", target], check=True, **quiet)
