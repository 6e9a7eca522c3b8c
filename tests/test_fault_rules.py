"""Faults, round 4: each rule tested by the class it comes from, end to end.

Every job runs at 4 ranks on 2 emulated nodes (or 2 ranks) with a timeout:
a hang is a failure. The classes:

- rank 0 never fails alone: what only rank 0 does (writing the report) is
  checked before the program runs, and agreed after it;
- the runner's ``-c`` finds modules as plain python does, also after
  ``os.chdir`` (``sys.path[0]`` is ``""``);
- what cannot be mirrored under live imports is read from the original, and
  the job goes on; what the node's copy still lacks after a rank asked for
  it (a file the user cannot read, a copy that is full) is imported as
  plain python imports it, with the same error where plain python fails;
- through a link to a file the user cannot read, or a link that loops,
  live imports (``pkgutil.get_data``, ``importlib.resources``) raise the
  exception plain python raises, with its message;
- listings know what an entry is: a FIFO, a socket or a dangling link is
  neither a file nor a module;
- in a forked child, live finders step aside as plain python's would.
"""

import json
import os
import shutil
import socket
import subprocess

import pytest

from stagetools import (
    EMIT,
    MPIEXEC,
    PYTHON,
    job_dirs,
    mpirun,
    results,
    run,
    write_target,
)

pytestmark = pytest.mark.usefixtures("reap_mpich_shm")
NODES = {"MPISTAGE_EMULATE_NODES": "2"}


def launch(ranks, target, env, cwd, *options, timeout=90):
    """``mpiexec -n RANKS python -m mpistage OPTIONS TARGET`` on 2 nodes."""
    args = ["-m", "mpistage", *options, *target]
    return mpirun(ranks, args, dict(env, **NODES), cwd=cwd, timeout=timeout)


def error_lines(result):
    return [ln for ln in result.stderr.splitlines() if "mpistage: error" in ln]


# -- rank 0 never fails alone ------------------------------------------------------


def test_a_report_that_cannot_be_written_is_refused_before_the_program(
    tmp_path, stage_env
):
    env = dict(stage_env, MPISTAGE_REPORT=str(tmp_path / "no" / "such" / "r.json"))
    target = write_target(tmp_path / "app.py", "emit('ran')\n")
    result = launch(4, [target], env, tmp_path, timeout=60)
    assert result.returncode == 1, result
    assert len(error_lines(result)) == 1, result.stderr
    assert "MPISTAGE_REPORT" in error_lines(result)[0]
    assert not list((tmp_path / "out").iterdir())  # the program did not run


def test_a_report_that_fails_at_the_end_ends_every_rank(tmp_path, stage_env):
    report = tmp_path / "report.json"
    report.mkdir()  # its directory is writable; the report itself is not
    env = dict(stage_env, MPISTAGE_REPORT=str(report))
    target = write_target(tmp_path / "app.py", "emit('ran')\n")
    result = launch(4, [target], env, tmp_path, timeout=60)
    assert result.returncode == 1, result
    assert len(error_lines(result)) == 1, result.stderr
    assert results(env, 4) == ["ran"] * 4
    assert job_dirs(tmp_path / "stage") == []


# -- -c as plain python -----------------------------------------------------------

CHDIR = """
import os, sys
os.chdir(sys.argv[1])
import chdirmod
emit([sys.path[0], chdirmod.WHERE])
"""


def test_code_imports_from_the_directory_it_changed_to(tmp_path, stage_env):
    other = tmp_path / "other"
    other.mkdir()
    (other / "chdirmod.py").write_text("WHERE = 'other'\n")
    code = EMIT + CHDIR
    plain = run([PYTHON, "-c", code, str(other)], env=stage_env, cwd=tmp_path)
    assert plain.returncode == 0, plain
    expected = json.loads((tmp_path / "out" / "plain.json").read_text())
    assert expected == ["", "other"]
    (tmp_path / "out" / "plain.json").unlink()
    result = launch(2, ["-c", code, str(other)], stage_env, tmp_path, timeout=60)
    assert result.returncode == 0, result
    assert results(stage_env, 2) == [expected] * 2


# -- what cannot be mirrored is read from the original ------------------------------

FAR_NAME = "m" * 245

UNMIRRORABLE = f"""
import importlib, importlib.metadata, importlib.resources, sys
got = []
long = importlib.import_module("{FAR_NAME}")
got.append(long.VALUE)
got.append(importlib.resources.files("oddpkg").joinpath("../oddpkg/data.txt").read_text())
dist = importlib.metadata.distribution("oddpkg")
got.append(sorted(str(f) for f in dist.files if "bin" in str(f)))
got.append(dist.read_text("../../bin/oddtool") is None)
emit(got)
"""


@pytest.fixture
def odd_site(tmp_path):
    """A site whose names cannot all be mirrored: long, climbing, outside."""
    site = tmp_path / "site"
    pkg = site / "oddpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data.txt").write_text("data")
    (site / f"{FAR_NAME}.py").write_text("VALUE = 'far'\n")
    info = site / "oddpkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Name: oddpkg\nVersion: 1.0\n")
    (info / "RECORD").write_text(
        "oddpkg/__init__.py,,\noddpkg/data.txt,,\n../../bin/oddtool,,\n"
    )
    return site


def test_what_cannot_be_mirrored_is_read_from_the_original(
    tmp_path, stage_env, odd_site
):
    env = dict(stage_env, PYTHONPATH=str(odd_site))
    target = write_target(tmp_path / "odd.py", UNMIRRORABLE)
    plain = run([PYTHON, target], env=env, cwd=tmp_path)
    assert plain.returncode == 0, plain
    expected = json.loads((tmp_path / "out" / "plain.json").read_text())
    (tmp_path / "out" / "plain.json").unlink()
    result = launch(4, [target], env, tmp_path)
    assert result.returncode == 0, result
    assert results(env, 4) == [expected] * 4
    assert job_dirs(tmp_path / "stage") == []


FLIPPED = """
import importlib, importlib.resources, os
from mpi4py import MPI
world = MPI.COMM_WORLD
root = importlib.resources.files("flippkg")
got = [(root / "flip").read_text(), (root / "flop" / "inner.txt").read_text()]
world.Barrier()
if world.rank == 0:  # the original changes under the job: kinds swap places
    folder = str(root)
    os.rename(folder + "/flip", folder + "/flip.was")
    os.rename(folder + "/flip.next", folder + "/flip")
    os.rename(folder + "/flop", folder + "/flop.was")
    os.rename(folder + "/flop.next", folder + "/flop")
world.Barrier()
importlib.invalidate_caches()
got += [(root / "flip" / "inner.txt").read_text(), (root / "flop").read_text()]
emit(got)
"""


def flip_site(site):
    """A package with a file about to become a directory, and the reverse."""
    pkg = site / "flippkg"
    (pkg / "flop").mkdir(parents=True)
    (pkg / "flip.next").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "flip").write_text("a file")
    (pkg / "flop" / "inner.txt").write_text("below a directory")
    (pkg / "flip.next" / "inner.txt").write_text("below what was a file")
    (pkg / "flop.next").write_text("what was a directory")
    return site


def test_a_file_that_becomes_a_directory_is_read_from_the_original(tmp_path, stage_env):
    """The node's copy holds the file where the original now has a directory
    (and the reverse): what it cannot hold is read from the original."""
    expected = ["a file", "below a directory"]
    expected += ["below what was a file", "what was a directory"]
    for how, ranks in (("plain", 1), ("live", 4)):
        site = flip_site(tmp_path / f"site-{how}")
        env = dict(stage_env, PYTHONPATH=str(site))
        target = write_target(tmp_path / f"flip-{how}.py", FLIPPED)
        if how == "plain":
            done = run([PYTHON, target], env=env, cwd=tmp_path)
            assert done.returncode == 0, done
            assert json.loads((tmp_path / "out" / "plain.json").read_text()) == expected
            (tmp_path / "out" / "plain.json").unlink()
            continue
        result = launch(ranks, [target], env, tmp_path)
        assert result.returncode == 0, result
        assert results(env, ranks) == [expected] * ranks
        assert job_dirs(tmp_path / "stage") == []


# -- what the copy still lacks after asking is plain python's ------------------------

TRY_IMPORTS = """
import importlib
got = {}
for name in NAMES:
    try:
        got[name] = importlib.import_module(name).VALUE
    except Exception as exc:
        got[name] = [type(exc).__name__, getattr(exc, "errno", None)]
emit(got)
"""


def try_imports(tmp_path, names):
    """Write a target that imports *names* and emits each VALUE or error."""
    body = f"NAMES = {list(names)!r}\n" + TRY_IMPORTS
    return write_target(tmp_path / "tries.py", body)


def plain_then_live(tmp_path, env, target, prefix=()):
    """Run *target* with plain python, then live on 4 ranks; return both results."""
    plain = run([*prefix, PYTHON, target], env=env, cwd=tmp_path)
    assert plain.returncode == 0, plain
    expected = json.loads((tmp_path / "out" / "plain.json").read_text())
    (tmp_path / "out" / "plain.json").unlink()
    if MPIEXEC is None:
        pytest.skip("no mpiexec next to this Python nor on PATH")
    args = [*prefix, MPIEXEC, "-n", "4", PYTHON, "-m", "mpistage", target]
    result = run(args, env=dict(env, **NODES), cwd=tmp_path, timeout=90)
    assert result.returncode == 0, result
    return expected, results(env, 4)


def as_a_user():
    """The command prefix under which file permissions hold (root: no DAC override)."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv(1): permissions cannot be made to hold")
    caps = "-dac_override,-dac_read_search"
    return ("setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}")


def test_a_file_the_user_cannot_read_fails_as_with_plain_python(tmp_path, stage_env):
    """The reader cannot read it, so the copy never holds it: the rank's own
    import meets the same ``PermissionError`` plain python meets."""
    site = tmp_path / "site"
    (site / "lockedpkg").mkdir(parents=True)
    (site / "locked.py").write_text("VALUE = 'locked'\n")
    (site / "lockedpkg" / "__init__.py").write_text("VALUE = 'lockedpkg'\n")
    (site / "readable.py").write_text("VALUE = 'readable'\n")
    for path in (site / "locked.py", site / "lockedpkg" / "__init__.py"):
        path.chmod(0)
    env = dict(stage_env, PYTHONPATH=str(site))
    target = try_imports(tmp_path, ["locked", "lockedpkg", "readable"])
    expected, got = plain_then_live(tmp_path, env, target, as_a_user())
    denied = ["PermissionError", 13]
    assert expected == {"locked": denied, "lockedpkg": denied, "readable": "readable"}
    assert got == [expected] * 4
    assert job_dirs(tmp_path / "stage") == []


LINKED = """
import importlib, importlib.resources, pkgutil
got = {}
def attempt(key, step):
    try:
        got[key] = step()
    except Exception as exc:
        got[key] = [type(exc).__name__, getattr(exc, "errno", None), str(exc)]
for name in ("tolocked", "looped", "lockedpkg"):
    attempt(name, lambda: importlib.import_module(name).VALUE)
import datapkg
for name in ("tolocked.txt", "looped.txt", "locked.txt", "plain.txt"):
    data = importlib.resources.files("datapkg").joinpath(name)
    attempt("read_text " + name, lambda: data.read_text())
    attempt("is_file " + name, lambda: data.is_file())
    attempt("get_data " + name, lambda: pkgutil.get_data("datapkg", name).decode())
emit(got)
"""


def test_links_to_what_cannot_be_read_fail_as_with_plain_python(tmp_path, stage_env):
    """Through a link to a file the user cannot read, or a link that loops,
    live imports raise plain python's exception, with its message."""
    site = tmp_path / "site"
    (site / "datapkg").mkdir(parents=True)
    (site / "lockedpkg").mkdir()
    (site / "locked.py").write_text("VALUE = 'locked'\n")
    (site / "tolocked.py").symlink_to("locked.py")
    (site / "looped.py").symlink_to("looped.py")
    (site / "lockedpkg" / "__init__.py").symlink_to("../locked.py")
    data = site / "datapkg"
    (data / "__init__.py").write_text("")
    (data / "locked.txt").write_text("secret")
    (data / "tolocked.txt").symlink_to("locked.txt")
    (data / "looped.txt").symlink_to("looped.txt")
    (data / "plain.txt").write_text("plain")
    for path in (site / "locked.py", data / "locked.txt"):
        path.chmod(0)
    env = dict(stage_env, PYTHONPATH=str(site))
    target = write_target(tmp_path / "linked.py", LINKED)
    expected, got = plain_then_live(tmp_path, env, target, as_a_user())
    assert expected["tolocked"][:2] == ["PermissionError", 13]
    assert expected["read_text looped.txt"][:2] == ["OSError", 40]  # ELOOP
    assert expected["get_data tolocked.txt"][:2] == ["PermissionError", 13]
    assert expected["get_data plain.txt"] == "plain"
    assert got == [expected] * 4
    assert job_dirs(tmp_path / "stage") == []


@pytest.fixture
def small_stage_dir(tmp_path):
    """A 1 MiB tmpfs as the only staging candidate: a full ``/dev/shm``."""
    point = tmp_path / "small"
    point.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    args = ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(point)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield point
    subprocess.run(["umount", "-l", str(point)], timeout=30, check=False)


def test_a_full_copy_leaves_imports_to_the_originals(
    tmp_path, stage_env, small_stage_dir
):
    """Modules of 400 KiB fill a node's 1 MiB copy after two: the mirror's
    writes fail, and the ranks import the rest from the originals."""
    site = tmp_path / "site"
    site.mkdir()
    names = [f"big{i}" for i in range(5)]
    for name in names:
        (site / f"{name}.py").write_text(
            f"VALUE = {name!r}\nPAD = {'x' * (400 << 10)!r}\n"
        )
    (site / "smallpkg").mkdir()
    (site / "smallpkg" / "__init__.py").write_text("VALUE = 'small'\n")
    env = dict(stage_env, PYTHONPATH=str(site), MPISTAGE_STAGE_DIR=str(small_stage_dir))
    target = try_imports(tmp_path, [*names, "smallpkg"])
    expected, got = plain_then_live(tmp_path, env, target)
    assert expected == {name: name for name in names} | {"smallpkg": "small"}
    assert got == [expected] * 4
    assert job_dirs(small_stage_dir) == []


# -- listings know what an entry is --------------------------------------------------

KINDS = """
import importlib.resources, pathlib
root = importlib.resources.files("kindpkg")
facts = {}
for name in ("fifo", "sock", "dangling", "file.txt", "sub"):
    p = root / name
    facts[name] = [p.exists(), p.is_file(), p.is_dir()]
facts["listed"] = sorted(p.name for p in root.iterdir())
for name in ("fifomod", "danglingmod"):
    try:
        __import__("kindpkg." + name)
        facts[name] = "imported"
    except ImportError:
        facts[name] = "absent"
emit(facts)
"""


@pytest.fixture
def kind_site(tmp_path):
    site = tmp_path / "site"
    pkg = site / "kindpkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "file.txt").write_text("text")
    os.mkfifo(pkg / "fifo")
    os.mkfifo(pkg / "fifomod.py")
    (pkg / "dangling").symlink_to(tmp_path / "nowhere")
    (pkg / "danglingmod.py").symlink_to(tmp_path / "nowhere.py")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(pkg / "sock"))
    yield site
    sock.close()


def test_fifos_sockets_and_dangling_links_are_what_they_are(
    tmp_path, stage_env, kind_site
):
    env = dict(stage_env, PYTHONPATH=str(kind_site))
    target = write_target(tmp_path / "kinds.py", KINDS)
    plain = run([PYTHON, target], env=env, cwd=tmp_path, timeout=30)
    assert plain.returncode == 0, plain
    expected = json.loads((tmp_path / "out" / "plain.json").read_text())
    (tmp_path / "out" / "plain.json").unlink()
    result = launch(4, [target], env, tmp_path, timeout=60)
    assert result.returncode == 0, result
    assert results(env, 4) == [expected] * 4


# -- fork -------------------------------------------------------------------------

FORKED = """
import multiprocessing as mp
import sys

def child(_):
    import forkmod, json, decimal
    return forkmod.VALUE

if __name__ == "__main__":
    sys.path.insert(1, "/nonexistent-mpistage/x.zip")
    with mp.get_context("fork").Pool(2) as pool:
        emit(pool.map(child, range(2)))
"""


def test_a_forked_child_imports_as_plain_python(tmp_path, stage_env):
    site = tmp_path / "site"
    site.mkdir()
    (site / "forkmod.py").write_text("VALUE = 'forked'\n")
    env = dict(stage_env, PYTHONPATH=str(site))
    target = write_target(tmp_path / "forked.py", FORKED)
    result = launch(2, [target], env, tmp_path, timeout=90)
    assert result.returncode == 0, result
    assert results(env, 2) == [["forked", "forked"]] * 2


# -- a fresh look after importlib.invalidate_caches() --------------------------------

SWAPPED = """
import importlib, os, sys
import v1only
current = os.environ["CURRENT"]
os.replace(current + ".next", current)  # the link now leads to v2
importlib.invalidate_caches()
import v2only
emit([v1only.WHO, v2only.WHO])
"""


def test_a_swapped_symlink_is_followed_after_invalidate_caches(tmp_path, stage_env):
    for version in ("v1", "v2"):
        (tmp_path / version).mkdir()
        (tmp_path / version / f"{version}only.py").write_text(f"WHO = '{version}'\n")
    current = tmp_path / "current"
    target = write_target(tmp_path / "swap.py", SWAPPED)
    expected = ["v1", "v2"]
    for how, ranks in (("plain", 0), ("live", 4)):
        for link in (current, tmp_path / "current.next"):
            link.unlink(missing_ok=True)
        current.symlink_to(tmp_path / "v1")
        (tmp_path / "current.next").symlink_to(tmp_path / "v2")
        env = dict(stage_env, PYTHONPATH=str(current), CURRENT=str(current))
        if how == "plain":
            done = run([PYTHON, target], env=env, cwd=tmp_path)
            assert done.returncode == 0, done
            got = json.loads((tmp_path / "out" / "plain.json").read_text())
            assert got == expected
            (tmp_path / "out" / "plain.json").unlink()
            continue
        # Every rank swaps the link: only the first rename finds current.next.
        body = SWAPPED.replace(
            'os.replace(current + ".next", current)',
            "from mpi4py import MPI\n"
            'if MPI.COMM_WORLD.rank == 0: os.replace(current + ".next", current)\n'
            "MPI.COMM_WORLD.Barrier()",
        )
        target = write_target(tmp_path / "swap4.py", body)
        result = launch(ranks, [target], env, tmp_path, timeout=60)
        assert result.returncode == 0, result
        assert results(env, ranks) == [expected] * ranks
