"""A package's libraries that other distributions hold (a GPU stack's shape).

torch's extensions need CUDA libraries that other wheels install in the
same site-packages (``nvidia/cublas/lib/libcublas.so.12``), found through
RUNPATH ``$ORIGIN/../../nvidia/cublas/lib``. Here ``gpuext/_ext`` needs
``libfakecublas.so``, which the distribution ``nvidia-fakecublas`` holds in
``nvidia/fakecublas/lib/``; that library needs ``libfakehelper.so``, in a
``fakehelper.libs/`` no distribution owns. Bundled, no rank may open either
library on the shared file system, and the report counts them from the
node's copy.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from envtools import opened
from stagetools import (
    MPIEXEC,
    PYTHON,
    clean_environ,
    job_dirs,
    mpistage,
    pack,
    results,
    run,
    write_target,
)

pytestmark = pytest.mark.usefixtures("reap_mpich_shm")

HELPER_C = "int fakehelper_add(int x) { return x + 2; }\n"
CUBLAS_C = """int fakehelper_add(int x);
int fakecublas_gemm(int x) { return 2 * fakehelper_add(x); }
"""

EXT_C = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
int fakecublas_gemm(int x);
static PyObject *gemm(PyObject *self, PyObject *args) {
    int x;
    if (!PyArg_ParseTuple(args, "i", &x)) return NULL;
    return PyLong_FromLong(fakecublas_gemm(x));
}
static PyMethodDef methods[] = {
    {"gemm", gemm, METH_VARARGS, "2 * (x + 2), computed in libfakecublas"},
    {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ext", NULL, -1, methods};
PyMODINIT_FUNC PyInit__ext(void) { return PyModule_Create(&module); }
"""

TARGET = """
import gpuext
maps = sorted({line.split()[-1] for line in open("/proc/self/maps")
               if "libfake" in line})
emit({"value": gpuext.gemm(19), "maps": maps})
"""

# torch's way (2.5 and later): preload a CUDA library found along sys.path,
# by the path of its original, before the extension needs it.
PRELOAD = """
import ctypes, glob, os, sys
for entry in sys.path:
    found = glob.glob(os.path.join(entry, "nvidia", "fakecublas", "lib", "lib*.so"))
    if found:
        ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)
        break
"""

LIBS = ("nvidia/fakecublas/lib/libfakecublas.so", "fakehelper.libs/libfakehelper.so")


def compiler():
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    include = sysconfig.get_paths()["include"]
    if not cc:
        pytest.skip("no C compiler (cc) found")
    if not os.path.exists(os.path.join(include, "Python.h")):
        pytest.skip(f"no Python.h in {include}")
    return cc, include


def compile_all(base, site):
    """Build the helper, the CUDA-like library and the extension below *site*."""
    cc, include = compiler()
    helper, cublas = site / "fakehelper.libs", site / "nvidia" / "fakecublas" / "lib"
    for folder in (helper, cublas, site / "gpuext"):
        folder.mkdir(parents=True)
    (base / "helper.c").write_text(HELPER_C)
    (base / "cublas.c").write_text(CUBLAS_C)
    (base / "ext.c").write_text(EXT_C)
    ext = site / "gpuext" / ("_ext" + sysconfig.get_config_var("EXT_SUFFIX"))
    shared = [cc, "-shared", "-fPIC", "-Wl,--enable-new-dtags"]
    commands = [
        [*shared, "-o", helper / "libfakehelper.so", base / "helper.c"],
        [*shared, "-o", cublas / "libfakecublas.so", base / "cublas.c", f"-L{helper}"]
        + ["-lfakehelper", "-Wl,-rpath,$ORIGIN/../../../fakehelper.libs"],
        [*shared, f"-I{include}", "-o", ext, base / "ext.c", f"-L{cublas}"]
        + ["-lfakecublas", "-Wl,-rpath,$ORIGIN/../nvidia/fakecublas/lib"],
    ]
    for cmd in commands:
        done = subprocess.run(
            [str(c) for c in cmd], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr


def write_distributions(site):
    """Make ``gpuext`` and ``nvidia-fakecublas`` installed distributions."""
    (site / "gpuext" / "__init__.py").write_text("from gpuext._ext import gemm\n")
    (site / "nvidia" / "fakecublas" / "__init__.py").write_text("")
    for name, top in (("gpuext", "gpuext"), ("nvidia_fakecublas", "nvidia")):
        info = site / f"{name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
        )
        files = sorted(p for p in (site / top).rglob("*") if p.is_file())
        lines = [f"{p.relative_to(site)},," for p in files]
        lines += [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
        (info / "RECORD").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A site directory with the extension and the two libraries it needs."""
    base = tmp_path_factory.mktemp("gpu")
    site = base / "site"
    compile_all(base, site)
    write_distributions(site)
    env = dict(clean_environ(), PYTHONPATH=str(site))
    check = run([PYTHON, "-c", "import gpuext; print(gpuext.gemm(19))"], env=env)
    assert check.stdout.strip() == "42", check
    return site


@pytest.fixture
def site(tmp_path, built):
    copy = tmp_path / "site"
    shutil.copytree(built, copy, symlinks=True)
    return copy


def traced_run(tmp_path, env, options, ranks=2, body=TARGET):
    """``mpiexec -n RANKS python -m mpistage OPTIONS app.py`` under strace."""
    if shutil.which("strace") is None:
        pytest.skip("no strace")
    if MPIEXEC is None:
        pytest.skip("no mpiexec")
    target = write_target(tmp_path / "app.py", body)
    log = tmp_path / f"strace.{len(list(tmp_path.glob('strace.*')))}.log"
    tracer = ["strace", "-f", "-qq", "-e", "trace=%file", "-o", log]
    args = [MPIEXEC, "-n", ranks, PYTHON, "-m", "mpistage", *options, target]
    result = run([*tracer, *args], env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result
    return result, opened(log.read_text(errors="replace"))


def check_served(result, opens, site, stage_env, stage_dir, report):
    """No rank opened a library's original; each mapped the copy; counted."""
    originals = {str(site / lib) for lib in LIBS}
    assert originals.isdisjoint(opens), sorted(originals & opens)
    for res in results(stage_env, 2):
        assert res["value"] == 42
        assert len(res["maps"]) == 2, res
        for path in res["maps"]:
            assert Path(path).is_relative_to(stage_dir), res
    found = json.loads(report.read_text())["libraries"]
    assert {str(site / lib) for lib in LIBS} <= set(found["copy_names"]), found
    assert not [path for path, _ in found["largest"] if path.startswith(str(site))]
    match = re.search(
        r"libraries: (\d+) from the node's copy, (\d+) from", result.stderr
    )
    assert match, result.stderr
    assert int(match.group(1)) == found["copy"], result.stderr
    assert int(match.group(2)) == found["originals"], result.stderr
    assert job_dirs(stage_dir) == []


def test_pack_takes_the_libraries_of_other_distributions(
    tmp_path, stage_env, stage_dir, site
):
    env = dict(clean_environ(), PYTHONPATH=str(site))
    bundle = pack(tmp_path / "gpu.mpistage", "gpuext", env=env)
    listed = mpistage(["inspect", "--json", bundle], env=env)
    members = {m["rel"] for m in json.loads(listed.stdout)["members"]}
    assert set(LIBS) <= members
    assert "nvidia_fakecublas-1.0.dist-info/RECORD" in members  # its owner, whole
    assert "nvidia/fakecublas/__init__.py" in members
    shown = mpistage(["inspect", bundle], env=env).stdout
    assert f"libraries from other distributions: {', '.join(sorted(LIBS))}" in shown

    report = tmp_path / "report.json"
    stage_env.update(
        PYTHONPATH=str(site), MPISTAGE_EMULATE_NODES="2", MPISTAGE_REPORT=str(report)
    )
    result, opens = traced_run(tmp_path, stage_env, ["--bundle", bundle, "--report"])
    check_served(result, opens, site, stage_env, stage_dir, report)
    assert "0 from the originals (0.0 MB)" in result.stderr  # only the package's


def test_a_library_ctypes_loads_by_its_original_path_comes_from_the_copy(
    tmp_path, stage_env, stage_dir, site
):
    env = dict(clean_environ(), PYTHONPATH=str(site))
    bundle = pack(tmp_path / "gpu.mpistage", "gpuext", env=env)
    report = tmp_path / "report.json"
    stage_env.update(
        PYTHONPATH=str(site), MPISTAGE_EMULATE_NODES="2", MPISTAGE_REPORT=str(report)
    )
    options = ["--bundle", bundle, "--report"]
    result, opens = traced_run(tmp_path, stage_env, options, body=PRELOAD + TARGET)
    check_served(result, opens, site, stage_env, stage_dir, report)


def test_report_names_the_libraries_left_to_the_originals(
    tmp_path, stage_env, stage_dir, site
):
    """A bundle of the Python code alone: the libraries load from the shared
    file system, and the report says so, naming them."""
    env = dict(clean_environ(), PYTHONPATH=str(site))
    bundle = pack(
        tmp_path / "gpu.mpistage", "--path", site, "--exclude", "*.so", env=env
    )
    report = tmp_path / "report.json"
    stage_env.update(
        PYTHONPATH=str(site), MPISTAGE_EMULATE_NODES="2", MPISTAGE_REPORT=str(report)
    )
    target = write_target(tmp_path / "app.py", TARGET)
    args = [MPIEXEC, "-n", 2, PYTHON, "-m", "mpistage", "--bundle", bundle]
    result = run([*args, "--report", target], env=stage_env, cwd=tmp_path)
    assert result.returncode == 0, result
    found = json.loads(report.read_text())["libraries"]
    assert found["originals"] == 3, found
    assert found["original_bytes"] > 0
    assert {p for p, _ in found["largest"]} >= {str(site / lib) for lib in LIBS}
    assert "3 from the originals" in result.stderr, result.stderr
    assert str(site / LIBS[0]) in result.stderr


@pytest.mark.parametrize("granularity", ["package", "file"])
def test_record_takes_the_libraries_the_process_mapped(
    tmp_path, stage_env, stage_dir, site, granularity
):
    env = dict(clean_environ(), PYTHONPATH=str(site), MPISTAGE_TEST_OUT=str(tmp_path))
    target = write_target(tmp_path / "app.py", TARGET)
    bundle = tmp_path / "rec.mpistage"
    args = ["record", "-o", bundle, "--granularity", granularity]
    done = mpistage([*args, "--", sys.executable, target], env=env)
    assert done.returncode == 0, done
    (tmp_path / "plain.json").unlink()
    report = tmp_path / "report.json"
    stage_env.update(
        PYTHONPATH=str(site), MPISTAGE_EMULATE_NODES="2", MPISTAGE_REPORT=str(report)
    )
    result, opens = traced_run(tmp_path, stage_env, ["--bundle", bundle, "--report"])
    check_served(result, opens, site, stage_env, stage_dir, report)


def test_auto_replay_serves_the_libraries_from_the_copy(
    tmp_path, stage_env, stage_dir, site
):
    cache = tmp_path / "cache"
    report = tmp_path / "report.json"
    stage_env.update(
        PYTHONPATH=str(site), MPISTAGE_EMULATE_NODES="2", MPISTAGE_REPORT=str(report)
    )
    options = ["--auto", "--cache-dir", cache, "--report"]
    target = write_target(tmp_path / "app.py", TARGET)
    learn = run(
        [MPIEXEC, "-n", 2, PYTHON, "-m", "mpistage", *options, target],
        env=stage_env,
        cwd=tmp_path,
        timeout=120,
    )
    assert learn.returncode == 0, learn
    for out in Path(stage_env["MPISTAGE_TEST_OUT"]).glob("*.json"):
        out.unlink()
    result, opens = traced_run(tmp_path, stage_env, options)
    assert "--auto: replayed" in result.stderr, result.stderr
    check_served(result, opens, site, stage_env, stage_dir, report)


def test_pack_exclude_leaves_the_libraries_to_the_originals(tmp_path, site):
    env = dict(clean_environ(), PYTHONPATH=str(site))
    args = ["gpuext", "--exclude", "nvidia", "--exclude", "*.libs"]
    bundle = pack(tmp_path / "gpu.mpistage", *args, env=env)
    manifest = json.loads(mpistage(["inspect", "--json", bundle], env=env).stdout)
    members = {m["rel"] for m in manifest["members"]}
    assert not [rel for rel in members if rel.startswith(("nvidia", "fakehelper"))]
    assert "libraries" not in manifest


def test_report_libraries_worked_out_by_hand(tmp_path):
    """Two ranks: the copy's libraries named once each, the originals' sizes
    looked up once: 3 MB + 1.5 MB."""
    from mpistage.runtime import libraries

    big, small = tmp_path / "libbig.so.12", tmp_path / "libsmall.so"
    for path, size in ((big, 3_000_000), (small, 1_500_000)):
        path.touch()
        os.truncate(path, size)
    ranks = [
        {"copy": ["/sw/site/a.so"], "originals": [str(big)]},
        {
            "copy": ["/sw/site/a.so", "/sw/site/b.so.1"],
            "originals": [str(big), str(small)],
        },
        None,  # a rank with nothing to say
    ]
    found = libraries.summarize(ranks)
    assert (found["copy"], found["originals"]) == (2, 2)
    assert found["original_bytes"] == 4_500_000
    assert found["largest"] == [[str(big), 3_000_000], [str(small), 1_500_000]]
    assert libraries.render(found) == [
        "  libraries: 2 from the node's copy, 2 from the originals (4.5 MB)",
        f"  largest originals: {big} (3.0 MB), {small} (1.5 MB)",
    ]
    assert libraries.render(libraries.summarize([None])) == []


def test_a_bundles_copy_is_named_by_its_originals():
    from mpistage.runtime.libraries import bundle_namer, is_shared_object

    roots = [{"path": f"/sw/root{i}"} for i in range(11)]
    namer = bundle_namer("/place", {"roots": roots})
    assert namer("/place/r1/x/libx.so") == "/sw/root1/x/libx.so"
    assert namer("/place/r10/x/libx.so") == "/sw/root10/x/libx.so"
    assert namer("/elsewhere/r1/libx.so") is None
    assert [
        is_shared_object(p) for p in ("/a/libx.so.12", "/a/_e.so", "/a/x.sock")
    ] == [
        True,
        True,
        False,
    ]
