"""What a package reaches through its own ``__file__`` is there, in every mode.

mpi4py keeps files beside its modules: ``libmpi.pxd`` (mpi4py's own tests
read it next to ``MPI.__file__``), ``mpi.cfg`` (``get_config()``) and
``include/`` (``get_include()``). The node boot's copy of ``MPI`` has its
``__file__`` in the node's place, so the place holds the package's
directory too. Each runner mode runs on 2 ranks and 2 emulated nodes.
"""

import json
import os
from pathlib import Path

import mpi4py
import pytest

from stagetools import PYTHON, mpirun, pack, write_target

MPISTAGE = str(Path(PYTHON).parent / "mpistage")
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
