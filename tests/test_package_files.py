"""What a program finds beside a module is what plain python finds, in every mode.

mpi4py keeps files beside its modules: ``libmpi.pxd`` (mpi4py's own tests
read it next to ``MPI.__file__``), ``mpi.cfg`` (``get_config()``) and
``include/`` (``get_include()``). The node boot's copy of ``MPI`` has its
``__file__`` in the node's place, so the place holds the package's
directory too (its ``__pycache__`` empty).

numpy's directories, as a bundle with ``pack``'s defaults holds them, lack
``tests/``, and the live copy holds only what was asked for: a program that
lists, globs, walks or opens what is beside a module, or asks
``pkgutil.iter_modules`` and ``importlib.resources``, must still get plain
python's answers (:data:`BESIDE`), and every numpy module's ``__file__``
must lie below ``numpy.__file__``'s directory, on every rank, with live
imports, ``--bundle`` (pack's defaults, and an ``--exclude``), both
``--auto`` runs and ``mpistage-env``. Each runner mode runs on 2 ranks and
2 emulated nodes.
"""

import json
import os
from pathlib import Path

import mpi4py
import pytest

from envtools import small_venv
from stagetools import MPIEXEC, PYTHON, clean_environ, mpirun, pack, run, write_target

MPISTAGE = str(Path(PYTHON).parent / "mpistage")
ENV_SCRIPT = str(Path(__file__).resolve().parent.parent / "bin" / "mpistage-env")
ORIGINAL = Path(mpi4py.__file__).parent

TARGET = """\
import os
import mpi4py
from mpi4py import MPI

def tree(folder):
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return sorted(found)

include = mpi4py.get_include()
beside = {}
for name, module in (("mpi4py", mpi4py), ("MPI", MPI)):
    with open(os.path.join(os.path.dirname(module.__file__), "libmpi.pxd")) as f:
        beside[name] = f.read()
emit({"config": mpi4py.get_config(),
      "header": os.path.isfile(os.path.join(include, "mpi4py", "mpi4py.h")),
      "pxd": beside, "mpi": MPI.__file__,
      "tree": tree(os.path.dirname(MPI.__file__))})
"""


def tree(folder):
    """The files below *folder* but ``__pycache__``, relative to it."""
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return sorted(found)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """``pack mpi4py numpy``, once."""
    pytest.importorskip("numpy")
    return pack(tmp_path_factory.mktemp("pkgfiles") / "b.mpistage", "mpi4py", "numpy")


def run_job(tmp_path, env, options):
    """Run the target under ``mpistage OPTIONS`` on 2 ranks, 2 nodes; return results."""
    target = write_target(tmp_path / "app.py", TARGET)
    out = Path(env["MPISTAGE_TEST_OUT"])
    for old in out.glob("*.json"):
        old.unlink()
    env = dict(env, MPISTAGE_EMULATE_NODES="2")
    result = mpirun(2, [MPISTAGE, *options, target], env, cwd=tmp_path)
    assert result.returncode == 0, result
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


def assert_as_in_the_original(got):
    """mpi4py's files beside its modules read as they do where it is installed."""
    pxd = (ORIGINAL / "libmpi.pxd").read_text()
    assert got["config"] == mpi4py.get_config()
    assert got["header"] is True
    assert got["pxd"] == {"mpi4py": pxd, "MPI": pxd}
    assert got["tree"] == tree(ORIGINAL)


@pytest.mark.parametrize("mode", ["live", "bundle", "auto"])
def test_mpi4py_finds_its_own_files_in_every_mode(tmp_path, stage_env, bundle, mode):
    if mode == "auto":
        options = [["--auto", "--cache-dir", str(tmp_path / "cache")]] * 2
    else:
        options = [["--bundle", str(bundle)] if mode == "bundle" else []]
    for each in options:  # --auto: the learning run, then the replay
        for got in run_job(tmp_path, stage_env, each):
            assert Path(got["mpi"]).parent.name == "mpi4py"
            assert_as_in_the_original(got)


BESIDE = """\
import glob, hashlib, importlib.resources, os, pkgutil
import numpy, numpy._utils, numpy.linalg, numpy.random._generator
from numpy._core import _multiarray_umath
from mpi4py import MPI

def rel(paths, folder):
    return sorted(os.path.relpath(p, folder) for p in paths)

def beside(module):
    folder = os.path.dirname(module.__file__)
    return {
        "listdir": sorted(os.listdir(folder)),
        "scandir": sorted((e.name, e.is_dir()) for e in os.scandir(folder)),
        "glob": rel(glob.glob(os.path.join(folder, "*")), folder),
    }

top = os.path.dirname(numpy.__file__)
with open(os.path.join(top, "tests", "test_public_api.py"), "rb") as f:
    read = hashlib.sha256(f.read()).hexdigest()
walked = [os.path.relpath(os.path.join(d, n), top)
          for d, dirs, names in os.walk(top) for n in names
          if "__pycache__" not in d]
emit({
    "files": [os.path.relpath(m.__file__, top) for m in (  # all below numpy/
        numpy._utils, numpy.linalg, _multiarray_umath, numpy.random._generator)],
    "beside": {name: beside(m) for name, m in (
        ("numpy", numpy), ("linalg", numpy.linalg),
        ("umath", _multiarray_umath), ("generator", numpy.random._generator),
        ("MPI", MPI))},
    "glob": rel(glob.glob(os.path.join(top, "**", "*.py"), recursive=True), top),
    "walk": sorted(walked),
    "read": read,
    "iter_modules": {name: sorted(n for _, n, _ in pkgutil.iter_modules(m.__path__))
                     for name, m in (("numpy", numpy), ("_core", numpy._core),
                                     ("linalg", numpy.linalg))},
    "resources": {n: sorted(p.name for p in importlib.resources.files(n).iterdir())
                  for n in ("numpy", "numpy._core", "numpy.linalg")},
})
"""


@pytest.fixture(scope="module")
def beside_job(tmp_path_factory):
    """Where the jobs of the BESIDE target run, and plain python's facts."""
    pytest.importorskip("numpy")
    if MPIEXEC is None:
        pytest.skip("no mpiexec next to this Python nor on PATH")
    base = tmp_path_factory.mktemp("beside")
    target = write_target(base / "beside.py", BESIDE)
    return base, target, plain_facts(base, target, [PYTHON])


def plain_facts(base, target, python):
    """The facts of the target under plain *python* (one rank)."""
    out = base / f"plain-{len(list(base.glob('plain-*')))}"
    out.mkdir()
    env = dict(clean_environ(), MPISTAGE_TEST_OUT=str(out))
    done = run([*python, target], env=env, cwd=base, timeout=120)
    assert done.returncode == 0, done
    return json.loads((out / "plain.json").read_text())


def beside_ranks(base, entry, env=None):
    """Run the BESIDE target with *entry* on 2 ranks and 2 nodes; each rank's facts."""
    out = base / f"out-{len(list(base.glob('out-*')))}"
    out.mkdir()
    environ = dict(clean_environ(), MPISTAGE_TEST_OUT=str(out), **(env or {}))
    environ.update(MPISTAGE_EMULATE_NODES="2", MPISTAGE_STAGE_DIR=str(out))
    environ["MPISTAGE_STAGE_FALLBACK"] = "no"
    done = run([MPIEXEC, "-n", "2", *entry, base / "beside.py"], env=environ, cwd=base)
    assert done.returncode == 0, done
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


def assert_beside_as_plain(plain, ranks):
    """Each rank found beside each module what plain python found, fact by fact."""
    for got in ranks:
        for key, want in plain.items():
            if isinstance(want, dict):
                for name in want:
                    assert got[key][name] == want[name], (key, name)
            else:
                assert got[key] == want, key


@pytest.mark.parametrize("mode", ["live", "bundle", "exclude", "auto"])
def test_what_is_beside_a_module_is_what_plain_python_finds(
    beside_job, bundle, tmp_path, mode
):
    base, _target, plain = beside_job
    if mode == "auto":
        runs = [["--auto", "--cache-dir", str(tmp_path / "cache")]] * 2
    elif mode == "exclude":  # no tests left out, but numpy's type stubs
        own = pack(tmp_path / "x.mpistage", "mpi4py", "numpy", "--tests",
                   "--exclude", "*.pyi")  # fmt: skip
        runs = [["--bundle", str(own)]]
    else:
        runs = [["--bundle", str(bundle)] if mode == "bundle" else []]
    for options in runs:  # --auto: the learning run, then the replay
        assert_beside_as_plain(plain, beside_ranks(base, [PYTHON, MPISTAGE, *options]))


def test_what_is_beside_a_module_in_a_staged_environment(
    beside_job, env_bundle, tmp_path_factory
):
    base, target, _plain = beside_job
    venv = small_venv(tmp_path_factory)
    plain = plain_facts(base, target, [str(venv.python)])
    staged = beside_ranks(base, [ENV_SCRIPT, str(env_bundle), "--", "python"])
    assert_beside_as_plain(plain, staged)
