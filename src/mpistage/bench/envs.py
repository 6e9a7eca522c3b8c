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


def env_bundle(bench):
    """Once per bench: an environment bundle on the shared FS; its mount path.

    The realistic layout packs its own venv (base interpreter included); the
    packages layout packs a small venv of copies. Untimed.
    """
    target = _os.path.join(bench.source, "bundles", "env.mpistage")
    if not _os.path.exists(target):
        _os.makedirs(_os.path.dirname(target), exist_ok=True)
        if bench.layout.name == "realistic":
            prefix = bench.layout.mounted(bench.layout.venv)
        else:
            prefix = small_env(_os.path.join(bench.work, "small-env"))
        mpistage(["pack", "--env", prefix, "-o", target])
    return bench.layout.mounted(target)


def shared_env(bench):
    """Once per bench: the environment bundle staged onto the shared FS.

    Returns the mount path of that relocated copy (``env/``). Untimed.
    """
    target = _os.path.join(bench.source, "env")
    if not _os.path.exists(target):
        env_bundle(bench)
        bundle = _os.path.join(bench.source, "bundles", "env.mpistage")
        mpistage(["stage", bundle, "--to", target])
    return bench.layout.mounted(target)


def mpistage(args):
    """Run an mpistage command with this Python, quietly; fail loudly."""
    run = [_sys.executable, "-m", "mpistage", *args]
    done = _subprocess.run(run, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args[:2])} failed:\n{done.stderr}")
