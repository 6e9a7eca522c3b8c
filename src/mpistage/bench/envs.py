"""A small Python environment for benchmarks and tests: a venv holding
copies of mpi4py, the MPICH wheel's files and numpy from the running one."""

import os as _os
import subprocess as _subprocess
import sys as _sys

from mpistage.bench.layout import copy, copy_mpich_libs, copy_packages, site_packages

PACKAGES = ("mpi4py", "numpy")
MPICH_BIN = (
    "mpiexec",
    "mpiexec.hydra",
    "mpirun",
    "hydra_pmi_proxy",
    "hydra_nameserver",
    "hydra_persist",
)


def small_env(dest, packages=PACKAGES):
    """Make a venv at *dest* with copies of *packages* and the MPICH wheel."""
    _subprocess.run([base_python(), "-m", "venv", "--without-pip", dest], check=True)
    names = [f"{name}*" for name in packages] + ["mpich-*.dist-info"]
    copy_packages(site_packages(dest), names)
    copy_mpich_libs(dest)
    for name in MPICH_BIN:
        if _os.path.exists(_os.path.join(_sys.prefix, "bin", name)):
            copy(
                _os.path.join(_sys.prefix, "bin", name),
                _os.path.join(dest, "bin", name),
            )
    return dest


def base_python():
    """Return the interpreter this venv was made from (itself if not a venv)."""
    from mpistage.bundle.envpack import read_cfg

    cfg = read_cfg(_os.path.join(_sys.prefix, "pyvenv.cfg"))
    return cfg.get("executable") or _sys.executable


def env_bundle(testbed):
    """Once per testbed: an environment bundle on the shared FS; its mount path.

    The realistic layout packs its own venv (base interpreter included); the
    packages layout packs a small venv of copies. Untimed.
    """
    target = _os.path.join(testbed.source, "bundles", "env.mpistage")
    if not _os.path.exists(target):
        _os.makedirs(_os.path.dirname(target), exist_ok=True)
        if testbed.layout.name == "realistic":
            prefix = testbed.layout.mounted(testbed.layout.venv)
        else:
            prefix = small_env(_os.path.join(testbed.work, "small-env"))
        mpistage(["pack", "--env", prefix, "-o", target])
    return testbed.layout.mounted(target)


def shared_env(testbed):
    """Once per testbed: the environment bundle staged onto the shared FS.

    Returns the mount path of that relocated copy (``env/``). Untimed.
    """
    target = _os.path.join(testbed.source, "env")
    if not _os.path.exists(target):
        env_bundle(testbed)
        bundle = _os.path.join(testbed.source, "bundles", "env.mpistage")
        mpistage(["stage", bundle, "--to", target])
        run_from(target, testbed.layout.mounted(target))
    return testbed.layout.mounted(target)


def run_from(target, mounted):
    """Point the staged venv at *target* (if one) at *mounted*, where it runs.

    Its ``pyvenv.cfg`` names the base below where ``mpistage stage`` put the
    copy; the bench runs the copy through the simulator's mount instead.
    """
    cfg = _os.path.join(target, "pyvenv.cfg")
    if not _os.path.isfile(cfg):
        return
    with open(cfg) as f:
        text = f.read()
    for where in {target, _os.path.realpath(target)}:
        text = text.replace(f" = {where}/", f" = {mounted}/")
    with open(cfg, "w") as f:
        f.write(text)


def mpistage(args):
    """Run an mpistage command with this Python, quietly; fail loudly."""
    run = [_sys.executable, "-m", "mpistage", *args]
    done = _subprocess.run(run, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args[:2])} failed:\n{done.stderr}")
