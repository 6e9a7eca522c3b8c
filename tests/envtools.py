"""Helpers of the environment-staging tests: a small venv, ELF and trace reading.

The project's own venv is too big to pack in a test, so :func:`small_venv`
makes a new one from the same base interpreter with only numpy, mpi4py and
the MPICH wheel (its libmpi and mpiexec) copied in. It is built once per
test session, whichever module asks first.
"""

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from stagetools import clean_environ, run

MPICH_BIN = (
    "mpiexec",
    "mpiexec.hydra",
    "mpirun",
    "hydra_pmi_proxy",
    "hydra_nameserver",
    "hydra_persist",
)
PACKAGES = ("mpi4py", "numpy", "numpy.libs")
DIST_INFO = ("mpich-*.dist-info", "mpi4py-*.dist-info", "numpy-*.dist-info")
# A console script with an absolute python shebang, as pip would write it.
HELLO = '#!{python}\nimport sys\nprint("hi", sys.prefix)\n'

_built = {}


class Venv:
    """A small venv: its prefix, base prefix, site-packages and interpreters."""

    def __init__(self, prefix, base_python):
        self.prefix = Path(prefix)
        self.base_python = Path(base_python)
        self.base = self.base_python.resolve().parent.parent
        self.version = "{}.{}".format(*sys.version_info[:2])
        self.site = self.prefix / "lib" / f"python{self.version}" / "site-packages"
        self.python = self.prefix / "bin" / "python"
        self.mpiexec = self.prefix / "bin" / "mpiexec"


def base_interpreter():
    """Return the executable this test venv (``sys.prefix``) was made from."""
    cfg = Path(sys.prefix) / "pyvenv.cfg"
    if not cfg.is_file():
        pytest.skip(f"the tests must run in a venv: no {cfg}")
    for line in cfg.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "executable":
            return Path(value.strip())
    pytest.skip(f"{cfg} names no executable")


def small_venv(tmp_path_factory):
    """Return the session's small venv (see the module docstring)."""
    if "venv" not in _built:
        _built["venv"] = build_venv(tmp_path_factory.mktemp("smallvenv") / "V")
    return _built["venv"]


def package_venv(tmp_path_factory, dists):
    """Return a venv like the small one plus *dists* and what they require."""
    key = ("packages", *sorted(dists))
    if key not in _built:
        prefix = tmp_path_factory.mktemp("packagevenv") / "V"
        _built[key] = build_venv(prefix, site_entries(dists))
    return _built[key]


def site_entries(dists):
    """Return the site-packages entries of *dists* and their requirements."""
    from importlib import metadata

    from packaging.requirements import Requirement

    todo, seen, entries = list(dists), set(), set()
    while todo:
        name = todo.pop()
        if name.lower() in seen:
            continue
        seen.add(name.lower())
        dist = metadata.distribution(name)
        for requirement in map(Requirement, dist.requires or []):
            marker = requirement.marker
            if marker is None or marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
        entries |= {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}
    return sorted(entries - {"__pycache__"})


def build_venv(prefix, extra=()):
    """Make the small venv at *prefix* and check that numpy and MPI work in it.

    *extra* names more site-packages entries to copy in.
    """
    base_python = base_interpreter()
    if not base_python.exists():
        pytest.skip(f"base interpreter {base_python} is gone")
    made = run([base_python, "-m", "venv", "--without-pip", prefix], timeout=60)
    assert made.returncode == 0, made
    venv = Venv(prefix, base_python)
    ours = Path(sys.prefix)
    site = ours / "lib" / f"python{venv.version}" / "site-packages"
    names = [*PACKAGES, *(p.name for g in DIST_INFO for p in site.glob(g))]
    for name in names:
        if not (site / name).exists():
            pytest.skip(f"{site / name} is not installed")
        shutil.copytree(site / name, venv.site / name, symlinks=True)
    for name in sorted(set(extra) - set(names)):
        if (site / name).is_dir():
            shutil.copytree(site / name, venv.site / name, symlinks=True)
        else:
            shutil.copy2(site / name, venv.site / name)
    # The MPICH wheel's files outside site-packages: libmpi, its own
    # libraries in lib/mpich, and mpiexec with the hydra helpers it starts
    # from its own directory.
    for lib in (ours / "lib").glob("libmpi*"):
        shutil.copy2(lib, venv.prefix / "lib" / lib.name, follow_symlinks=False)
    if (ours / "lib" / "mpich").is_dir():
        shutil.copytree(ours / "lib" / "mpich", venv.prefix / "lib" / "mpich")
    for name in MPICH_BIN:
        if (ours / "bin" / name).exists():
            shutil.copy2(ours / "bin" / name, venv.prefix / "bin" / name)
    if not venv.mpiexec.exists():
        pytest.skip(f"no mpiexec in {ours / 'bin'} (the MPICH wheel)")
    hello = venv.prefix / "bin" / "hello"
    hello.write_text(HELLO.format(python=venv.python))
    hello.chmod(0o755)

    env = clean_environ()
    env.pop("VIRTUAL_ENV", None)
    code = (
        "import os, numpy, mpi4py.MPI as M\n"
        "os.write(1, f'{M.COMM_WORLD.rank} {numpy.__file__}\\n'.encode())"
    )
    check = run([venv.python, "-c", code], env=env, timeout=60)
    assert check.returncode == 0, check
    assert check.stdout.split()[1].startswith(str(venv.site)), check
    check = run([venv.mpiexec, "-n", 2, venv.python, "-c", code], env=env)
    assert check.returncode == 0, check
    ranks = sorted(line.split()[0] for line in check.stdout.splitlines())
    assert ranks == ["0", "1"], check
    return venv


def runpaths(path):
    """Return the DT_RPATH and DT_RUNPATH entries of the ELF file *path*."""
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    rpath, runpath = [], []
    with open(path, "rb") as f:
        for section in ELFFile(f).iter_sections():
            if isinstance(section, DynamicSection):
                for tag in section.iter_tags():
                    if tag.entry.d_tag == "DT_RPATH":
                        rpath += tag.rpath.split(":")
                    elif tag.entry.d_tag == "DT_RUNPATH":
                        runpath += tag.runpath.split(":")
    return rpath, runpath


def elf_files(root):
    """Yield the regular ELF files below *root*."""
    for folder, _dirs, files in os.walk(root):
        for name in files:
            path = Path(folder, name)
            if not path.is_symlink() and path.read_bytes()[:4] == b"\x7fELF":
                yield path


def under(path, prefix):
    """Whether *path* is *prefix* or below it (as strings, no resolving)."""
    path, prefix = str(path), str(prefix).rstrip("/")
    return path == prefix or path.startswith(prefix + "/")


QUOTED = re.compile(r'"(/(?:[^"\\]|\\.)*)"')
OPEN = re.compile(r'^(?:open|openat|openat2)\((?:[A-Z_]+, )?"([^"]*)"')


def trace_paths(text):
    """Return every absolute path quoted in an ``strace`` output."""
    return {m.group(1) for m in QUOTED.finditer(text)}


def opened(text):
    """Return the paths an ``strace -f`` output shows opened successfully."""
    return set(open_counts(text))


def open_counts(text):
    """Return ``{path: successful opens}`` of an ``strace -f`` output.

    Follows ``<unfinished ...>`` / ``<... resumed>`` pairs by pid.
    """
    from collections import Counter

    pending, found = {}, Counter()
    for line in text.splitlines():
        pid, _, rest = line.partition(" ")
        rest = rest.strip()
        match = OPEN.match(rest)
        if match and rest.endswith("<unfinished ...>"):
            pending[pid] = match.group(1)
            continue
        if match:
            path = match.group(1)
        elif rest.startswith("<... open") and pid in pending:
            path = pending.pop(pid)
        else:
            continue
        result = rest.rpartition("= ")[2].split(" ")[0]
        if result.isdigit():
            found[path] += 1
    return found
