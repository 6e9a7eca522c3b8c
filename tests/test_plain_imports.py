"""The program imports what plain python would give it, on every rank.

- A name the bundle does not hold is found exactly where plain python finds
  it: ``FileFinder``'s own rule decides, so names that are no identifiers
  (``sysconfig``'s ``_sysconfigdata__linux_x86_64-linux-gnu``,
  ``importlib.import_module("dashed-mod")``) are found in the original.
- The runner's own work leaves nothing in ``sys.modules`` that plain python
  would not have: a ``json.py`` beside the script is the program's ``json``
  on rank 0 as on every other rank.
- A directory the bundle holds in part answers absent names from the listing
  recorded in the manifest, without listing the original.

Every run: 4 ranks on 2 emulated nodes.
"""

import ast
import importlib.machinery
import sys
from pathlib import Path

import pytest

from recordtools import recorded
from stagetools import (
    PYTHON,
    install_record,
    make_site,
    mpirun,
    pack,
    results,
    run,
    write_target,
)

pytestmark = pytest.mark.usefixtures("reap_mpich_shm")

RANKS = 4


def launch(bundle, script, env, *args, cwd=None):
    """Run the script with the runner at 4 ranks on 2 emulated nodes."""
    env = dict(env, MPISTAGE_EMULATE_NODES="2")
    runner = ["-m", "mpistage", "--bundle", bundle, script, *args]
    return mpirun(RANKS, runner, env, cwd=cwd)


# -- names plain python finds ------------------------------------------------------


def test_absent_names_are_answered_as_filefinder_would(tmp_path):
    """The listing's names are exactly those ``FileFinder`` finds in the directory."""
    from mpistage.runtime.roots import listing, module_names

    folder = tmp_path / "root"
    (folder / "pkg").mkdir(parents=True)
    (folder / "pkg" / "__init__.py").write_text("")
    (folder / "dashed-ns").mkdir()
    (folder / "__pycache__").mkdir()
    (folder / "numpy-2.0.dist-info").mkdir()
    ext = importlib.machinery.EXTENSION_SUFFIXES[0]
    for name in (
        "plain.py",
        "dashed-mod.py",
        "_sysconfigdata__linux_x86_64-linux-gnu.py",
        f"native{ext}",
        "stable.abi3.so",
        "compiled.pyc",
        "notes.txt",
        "extra.pth",
        "README",
    ):
        (folder / name).write_text("")
    entries = listing(folder)
    candidates = {e.rstrip("/") for e in entries}
    for entry in entries:
        candidates |= {entry.split(".")[0], entry.rsplit(".", 1)[0]}
    candidates |= {"absent", "dashed", "native", "numpy-2"}
    candidates = {c for c in candidates if "." not in c}  # a name's last part
    m = importlib.machinery
    finder = m.FileFinder(
        str(folder),
        (m.ExtensionFileLoader, m.EXTENSION_SUFFIXES),
        (m.SourceFileLoader, m.SOURCE_SUFFIXES),
        (m.SourcelessFileLoader, m.BYTECODE_SUFFIXES),
    )
    found = {n for n in candidates if finder.find_spec(n) is not None}
    assert {"_sysconfigdata__linux_x86_64-linux-gnu", "dashed-mod"} <= found
    assert found == {n for n in candidates if n in module_names(entries)}


LOOKUP_APP = """
import importlib, sysconfig
import tinypkg
dashed = importlib.import_module("dashed-mod")
emit([len(sysconfig.get_config_vars()) > 10, dashed.WHO, dashed.__file__])
"""


def test_pack_without_stdlib_finds_sysconfigdata(tmp_path, stage_env):
    site = make_site(tmp_path / "site")
    (site / "dashed-mod.py").write_text("WHO = 'dashed'\n")
    env = dict(stage_env, PYTHONPATH=str(site))
    bundle = pack(tmp_path / "tiny.mpistage", "tinypkg", env=env)
    script = write_target(tmp_path / "app.py", LOOKUP_APP)
    result = launch(bundle, script, env, cwd=tmp_path)
    assert result.returncode == 0, result
    expected = [True, "dashed", str(site / "dashed-mod.py")]
    assert results(env, RANKS) == [expected] * RANKS


PATH_APP = """
import sys, tinypkg
if "config" in sys.argv[1:]:
    import sysconfig
    sysconfig.get_config_vars()
emit(sys.argv[1:])
"""


def test_recorded_bundle_serves_another_code_path(tmp_path, stage_env):
    """What the learning run did not import is found where plain python finds it."""
    site = make_site(tmp_path / "site")
    env = dict(stage_env, PYTHONPATH=str(site))
    script = write_target(tmp_path / "app.py", PATH_APP)
    out = tmp_path / "record-out"
    out.mkdir()
    bundle = tmp_path / "app.mpistage"
    recorded(bundle, script, dict(env, MPISTAGE_TEST_OUT=str(out)), cwd=tmp_path)
    result = launch(bundle, script, env, "config", cwd=tmp_path)
    assert result.returncode == 0, result
    assert results(env, RANKS) == [["config"]] * RANKS


# -- the runner's own modules --------------------------------------------------------

# Written without json (the program's json is the user's here).
SHADOW_APP = """\
import os, sys
start = sorted(sys.modules)
import json, _hashlib
data = {"json": getattr(json, "WHO", None), "hashlib": getattr(_hashlib, "WHO", None),
        "start": start}
name = os.environ.get("PMI_RANK", "plain")
with open(os.path.join(os.environ["MPISTAGE_TEST_OUT"], name + ".txt"), "w") as f:
    f.write(repr(data))
"""

MPI_MODULES = "import sys; from mpi4py import MPI; print(repr(sorted(sys.modules)))"


def emitted(env, name):
    path = Path(env["MPISTAGE_TEST_OUT"]) / f"{name}.txt"
    return ast.literal_eval(path.read_text())


@pytest.mark.parametrize("mode", ["bundle", "auto", "live"])
def test_a_module_beside_the_script_is_the_programs_on_every_rank(
    tmp_path, stage_env, tiny, mode
):
    app = tmp_path / "app"
    app.mkdir()
    (app / "json.py").write_text("WHO = 'mine'\n")
    (app / "_hashlib.py").write_text("WHO = 'mine'\n")
    script = app / "app.py"
    script.write_text(SHADOW_APP)
    env = dict(stage_env, PYTHONPATH=str(tiny["site"]))
    plain = run([PYTHON, script], env=env, cwd=app)
    assert plain.returncode == 0, plain
    expected = emitted(env, "plain")
    assert expected["json"] == expected["hashlib"] == "mine"
    mpi = run([PYTHON, "-c", MPI_MODULES], env=env, cwd=tmp_path)
    assert mpi.returncode == 0, mpi
    allowed = set(expected["start"]) | set(ast.literal_eval(mpi.stdout))
    allowed |= set(sys.builtin_module_names) | {"runpy"}

    env = dict(env, MPISTAGE_EMULATE_NODES="2")
    if mode == "bundle":
        options = ["--bundle", tiny["bundle"]]
    elif mode == "live":
        options = []
    else:
        options = ["--auto", "--cache-dir", tmp_path / "cache"]
    for _ in range(1 if mode == "bundle" else 2):  # --auto: learn, then replay
        result = mpirun(RANKS, ["-m", "mpistage", *options, script], env, cwd=app)
        assert result.returncode == 0, result
        ranks = [emitted(env, str(rank)) for rank in range(RANKS)]
        seen = []
        for rank, facts in enumerate(ranks):
            assert (facts["json"], facts["hashlib"]) == ("mine", "mine"), rank
            seen.append({m for m in facts["start"] if m.split(".")[0] != "mpistage"})
            assert seen[-1] - allowed == set(), (rank, sorted(seen[-1] - allowed))
            assert seen[-1] == seen[0], (rank, seen[-1] ^ seen[0])


# -- directories held in part ------------------------------------------------------

PARTIAL_APP = """
import importlib, os, sys
import partpkg
listed = []
def hook(event, args, where=os.environ["PARTPKG"]):
    if event in ("os.listdir", "os.scandir") and str(args[0]).startswith(where):
        listed.append(str(args[0]))
sys.addaudithook(hook)
import partpkg.core
absent = []
for name in ("partpkg.nothere", "partpkg.core_extra", "partpkg.tests_x"):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        absent.append(name)
if "tests" in sys.argv[1:]:
    import partpkg.tests.test_x
    absent.append(partpkg.tests.test_x.WHO)
emit([absent, sorted(set(listed))])
"""


def test_absent_names_in_a_partial_directory_need_no_listing(tmp_path, stage_env):
    site = tmp_path / "site"
    tests = site / "partpkg" / "tests"
    tests.mkdir(parents=True)
    (site / "partpkg" / "__init__.py").write_text("")
    (site / "partpkg" / "core.py").write_text("CORE = 1\n")
    (tests / "__init__.py").write_text("")
    (tests / "test_x.py").write_text("WHO = 'left out'\n")
    install_record(site, "partpkg", "1.0")
    env = dict(stage_env, PYTHONPATH=str(site), PARTPKG=str(site / "partpkg"))
    bundle = pack(tmp_path / "part.mpistage", "partpkg", env=env)  # tests left out
    script = write_target(tmp_path / "app.py", PARTIAL_APP)
    absent = ["partpkg.nothere", "partpkg.core_extra", "partpkg.tests_x"]

    result = launch(bundle, script, env, cwd=tmp_path)
    assert result.returncode == 0, result
    assert results(env, RANKS) == [[absent, []]] * RANKS  # the original not listed

    for path in Path(env["MPISTAGE_TEST_OUT"]).iterdir():
        path.unlink()
    result = launch(bundle, script, env, "tests", cwd=tmp_path)
    assert result.returncode == 0, result  # what was left out is in the original
    for found, listed in results(env, RANKS):
        assert found == [*absent, "left out"]
        assert str(site / "partpkg") in listed, listed
