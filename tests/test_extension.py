"""A C extension that links a sibling library through an $ORIGIN RPATH.

The layout is auditwheel's: ``extpkg/_ext<EXT_SUFFIX>`` needs
``libextutil.so``, found through ``$ORIGIN/../extpkg.libs``. Staged, the
extension and the library must both load from the node's node's place.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from stagetools import clean_environ, job_dirs, mpirun, pack, results, write_target

pytestmark = pytest.mark.usefixtures("reap_mpich_shm")

UTIL_C = "int extutil_triple(int x) { return 3 * x; }\n"

EXT_C = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
int extutil_triple(int x);
static PyObject *triple(PyObject *self, PyObject *args) {
    int x;
    if (!PyArg_ParseTuple(args, "i", &x)) return NULL;
    return PyLong_FromLong(extutil_triple(x));
}
static PyMethodDef methods[] = {
    {"triple", triple, METH_VARARGS, "3 * x, computed in libextutil"},
    {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ext", NULL, -1, methods};
PyMODINIT_FUNC PyInit__ext(void) { return PyModule_Create(&module); }
"""

TARGET = """
from mpi4py import MPI
import extpkg, extpkg._ext
maps = sorted({line.split()[-1] for line in open("/proc/self/maps")
               if "libextutil" in line})
emit({"rank": MPI.COMM_WORLD.rank, "ext": extpkg._ext.__file__,
      "pkg": where(extpkg), "value": extpkg.triple(14), "maps": maps})
"""


def compiler():
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    include = sysconfig.get_paths()["include"]
    if not cc:
        pytest.skip("no C compiler (cc) found")
    if not os.path.exists(os.path.join(include, "Python.h")):
        pytest.skip(f"no Python.h in {include}")
    return cc, include


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Compile the extension and its library into a site directory."""
    cc, include = compiler()
    base = tmp_path_factory.mktemp("ext")
    site = base / "site"
    pkg, libs = site / "extpkg", site / "extpkg.libs"
    pkg.mkdir(parents=True)
    libs.mkdir()
    (base / "util.c").write_text(UTIL_C)
    (base / "ext.c").write_text(EXT_C)
    (pkg / "__init__.py").write_text("from extpkg._ext import triple\n")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    commands = [
        [cc, "-shared", "-fPIC", "-o", libs / "libextutil.so", base / "util.c"],
        [
            cc,
            "-shared",
            "-fPIC",
            f"-I{include}",
            "-o",
            pkg / f"_ext{suffix}",
            base / "ext.c",
            f"-L{libs}",
            "-lextutil",
            "-Wl,-rpath,$ORIGIN/../extpkg.libs",
        ],
    ]
    for cmd in commands:
        done = subprocess.run(
            [str(c) for c in cmd], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
    # The plain import works, from the original location.
    env = clean_environ()
    env["PYTHONPATH"] = str(site)
    check = subprocess.run(
        [sys.executable, "-c", "import extpkg; print(extpkg.triple(5))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.stdout.strip() == "15", check
    return site


@pytest.mark.parametrize(
    "how,remove_original", [("name", False), ("path", True)], ids=["by-name", "path"]
)
def test_extension_and_its_library_are_staged(
    tmp_path, stage_env, stage_dir, built, how, remove_original
):
    site = tmp_path / "site"
    shutil.copytree(built, site, symlinks=True)
    env = clean_environ()
    env["PYTHONPATH"] = str(site)
    args = ["extpkg"] if how == "name" else ["--path", site]
    bundle = pack(tmp_path / "ext.mpistage", *args, env=env)
    trust = []
    if remove_original:  # the job must not need the original tree at all
        shutil.rmtree(site / "extpkg")
        shutil.rmtree(site / "extpkg.libs")
        trust = ["--trust"]  # the originals are gone: skip the staleness check

    target = write_target(tmp_path / "app.py", TARGET)
    stage_env.update(PYTHONPATH=str(site), MPISTAGE_EMULATE_NODES="2")
    result = mpirun(
        3,
        ["-m", "mpistage", "--bundle", bundle, *trust, target],
        stage_env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result

    roots = set()
    for res in results(stage_env, 3):
        ext = Path(res["ext"])
        root = ext.parents[2]  # <root>/r0/extpkg/_ext...
        assert root.parent == stage_dir / f"mpistage-{os.getuid()}", res
        assert ext.name == "_ext" + sysconfig.get_config_var("EXT_SUFFIX")
        assert Path(res["pkg"]).is_relative_to(root)
        assert res["value"] == 42
        assert res["maps"] == [str(root / "r0" / "extpkg.libs" / "libextutil.so")]
        roots.add(root)
    assert len(roots) == 2  # ranks 0-1 on node 0, rank 2 on node 1
    assert job_dirs(stage_dir) == []


def test_live_an_extension_over_the_size_limit_loads_the_original(
    tmp_path, stage_env, stage_dir, built
):
    """The reader leaves a file over its size limit to the ranks: the node's
    copy lacks the extension even after a rank asked for it, and every rank
    loads the original, as plain python does."""
    from mpistage.runtime.live.reader import MAX_FILE

    site = tmp_path / "site"
    shutil.copytree(built, site, symlinks=True)
    ext = next((site / "extpkg").glob("_ext*"))
    os.truncate(ext, MAX_FILE + 1)  # sparse: the loader maps only its segments
    target = write_target(tmp_path / "app.py", TARGET)
    stage_env.update(PYTHONPATH=str(site), MPISTAGE_EMULATE_NODES="2")
    result = mpirun(3, ["-m", "mpistage", target], stage_env, cwd=tmp_path)
    assert result.returncode == 0, result
    for res in results(stage_env, 3):
        assert res["value"] == 42
        assert res["ext"] == str(ext), res
    assert job_dirs(stage_dir) == []


def test_live_an_extension_whose_library_cannot_be_served_loads_the_original(
    tmp_path, stage_env, stage_dir, built
):
    """A library over the reader's size limit stays out of the copy: so does
    the extension that needs it from ``$ORIGIN`` (both load from the originals)."""
    from mpistage.runtime.live.reader import MAX_FILE

    site = tmp_path / "site"
    shutil.copytree(built, site, symlinks=True)
    lib = site / "extpkg.libs" / "libextutil.so"
    os.truncate(lib, MAX_FILE + 1)  # sparse: the loader maps only its segments
    target = write_target(tmp_path / "app.py", TARGET)
    stage_env.update(PYTHONPATH=str(site), MPISTAGE_EMULATE_NODES="2")
    result = mpirun(3, ["-m", "mpistage", target], stage_env, cwd=tmp_path)
    assert result.returncode == 0, result
    for res in results(stage_env, 3):
        assert res["value"] == 42
        assert res["ext"].startswith(str(site)), res
        assert res["maps"] == [str(lib)]
    assert job_dirs(stage_dir) == []
