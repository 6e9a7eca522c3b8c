"""The runner end to end: real ``mpiexec`` jobs with emulated nodes."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from stagetools import (
    EMIT,
    MPIEXEC,
    PYTHON,
    job_dirs,
    mpirun,
    pack,
    results,
    run,
    sha256,
    tree_digests,
    uid_dir,
    write_target,
)

pytestmark = pytest.mark.usefixtures("reap_mpich_shm")

NUMPY_TARGET = """
import os, sys
from importlib import metadata
import numpy
import numpy.linalg
from numpy._core import _multiarray_umath
from mpi4py import MPI

rng = numpy.random.default_rng(MPI.COMM_WORLD.rank)
a = rng.standard_normal((50, 50)) + 50 * numpy.eye(50)
b = rng.standard_normal(50)
x = numpy.linalg.solve(a, b)
libs = sorted({line.split()[-1] for line in open("/proc/self/maps")
               if "openblas" in line})
emit({
    "rank": MPI.COMM_WORLD.rank,
    "numpy": where(numpy),
    "linalg": where(numpy.linalg),
    "umath": where(_multiarray_umath),
    "files": [numpy.__file__, numpy.linalg.__file__, _multiarray_umath.__file__],
    "residual": float(numpy.abs(a @ x - b).max()),
    "inverse": bool(numpy.allclose(numpy.linalg.inv(a) @ a, numpy.eye(50))),
    "blas": libs,
    "version_ok": metadata.version("numpy") == numpy.__version__,
    "argv": sys.argv,
})
"""


def node_of(rank, ranks, nodes):
    """The emulated node of *rank*: contiguous blocks, as documented."""
    return rank * nodes // ranks


def test_numpy_staged_on_every_rank(tmp_path, stage_env, stage_dir, numpy_bundle):
    import numpy

    target = write_target(tmp_path / "np_app.py", NUMPY_TARGET)
    report = tmp_path / "report.json"
    stage_env.update(MPISTAGE_EMULATE_NODES="2", MPISTAGE_REPORT=str(report))
    args = ["-m", "mpistage", "--bundle", numpy_bundle, target, "x", "--y"]
    result = mpirun(4, args, stage_env, cwd=tmp_path)
    assert result.returncode == 0, result

    facts = json.loads(report.read_text())
    roots = facts["stage_roots"]
    assert len(roots) == 2, facts
    assert all(Path(r).parent == stage_dir / f"mpistage-{os.getuid()}" for r in roots)
    assert facts["ranks"] == 4 and facts["nodes"] == 2
    assert facts["bundle_bytes"] == numpy_bundle.stat().st_size
    assert facts["modules"]["served"] > 10
    assert facts["modules"]["missed_names"] == []

    original = Path(numpy.__file__).parent
    for rank, res in enumerate(results(stage_env, 4)):
        root = next(r for r in roots if r.endswith(f".n{node_of(rank, 4, 2)}"))
        assert res["version_ok"]
        for key in ("numpy", "linalg", "umath"):  # read from the node's copy
            assert res[key].startswith(root + os.sep), (rank, key, res[key])
            assert not res[key].startswith(str(original))
        # shown at their originals: pack left numpy's tests out, so the
        # copy's directories list less than the originals'
        assert res["files"] == [numpy.__file__, numpy.linalg.__file__,
                                numpy._core._multiarray_umath.__file__]  # fmt: skip
        assert res["residual"] < 1e-8
        assert res["inverse"]
        # numpy's BLAS, linked through $ORIGIN/../numpy.libs, came staged too
        assert res["blas"] and all(b.startswith(root + os.sep) for b in res["blas"])
        assert res["argv"] == [str(target), "x", "--y"]
    assert job_dirs(stage_dir) == [], "node places were not removed at exit"


def strace_problem():
    """Why strace cannot trace here, or ``None``."""
    if not shutil.which("strace"):
        return "strace is not installed"
    probe = subprocess.run(
        ["strace", "-f", "-qq", "-e", "trace=openat", "-o", os.devnull, "true"],
        capture_output=True,
        timeout=30,
    )
    if probe.returncode != 0:
        return f"strace cannot trace (ptrace not permitted?): {probe.stderr!r}"
    return None


def test_only_rank0_opens_the_bundle(tmp_path, stage_env, numpy_bundle):
    problem = strace_problem()
    if problem:
        pytest.skip(problem)
    import numpy

    target = write_target(tmp_path / "np_app.py", NUMPY_TARGET)
    stage_env["MPISTAGE_EMULATE_NODES"] = "2"
    traces = tmp_path / "traces"
    traces.mkdir()
    wrapper = (
        f'exec strace -f -qq -e trace=open,openat -o "{traces}/TRACE.$PMI_RANK" "$@"'
    )
    args = [PYTHON, "-m", "mpistage", "--bundle", numpy_bundle, target]
    cmd = [MPIEXEC, "-n", 4, "sh", "-c", wrapper, "sh", *args]
    result = run(cmd, env=stage_env, cwd=tmp_path)
    assert result.returncode == 0, result
    assert [r["rank"] for r in results(stage_env, 4)] == [0, 1, 2, 3]

    text = {r: (traces / f"TRACE.{r}").read_text() for r in range(4)}
    bundle_path = f'"{numpy_bundle}"'
    opened = [r for r in range(4) if bundle_path in text[r]]
    assert opened == [0], f"ranks that opened the bundle: {opened}"
    # and no rank opened anything of the original numpy or numpy.libs
    original = Path(numpy.__file__).parent
    for r in range(4):
        for path in (f'"{original}/', f'"{original}.libs/'):
            assert path not in text[r], f"rank {r} opened {path} directly"


@pytest.mark.parametrize("ranks,nodes", [(1, 1), (2, 2), (5, 2)])
def test_tiny_bundle_served(tmp_path, stage_env, stage_dir, tiny, ranks, nodes):
    target = write_target(
        tmp_path / "app.py",
        """
import os, tinypkg, tinypkg.sub
from mpi4py import MPI
emit({"rank": MPI.COMM_WORLD.rank, "file": tinypkg.__file__,
      "sub": tinypkg.sub.__file__, "text": tinypkg.sub.TEXT,
      "value": tinypkg.VALUE})
""",
    )
    stage_env.update(PYTHONPATH=str(tiny["site"]), MPISTAGE_EMULATE_NODES=str(nodes))
    args = ["-m", "mpistage", "--bundle", tiny["bundle"], target]
    result = mpirun(ranks, args, stage_env, cwd=tmp_path)
    assert result.returncode == 0, result
    res = results(stage_env, ranks)
    roots = {}
    for rank, r in enumerate(res):
        root = r["file"].split(os.sep + "r0" + os.sep)[0]
        assert root.startswith(str(stage_dir) + os.sep), r
        assert r["sub"].startswith(root + os.sep)
        assert (r["value"], r["text"]) == (42, "tiny data")
        roots.setdefault(node_of(rank, ranks, nodes), set()).add(root)
    # one root per emulated node, shared by the ranks of that node
    assert len(roots) == nodes and all(len(v) == 1 for v in roots.values())
    assert len(set.union(*roots.values())) == nodes
    assert job_dirs(stage_dir) == []


@pytest.mark.parametrize("chunk", [63, 64, 65])
def test_chunked_broadcast_is_byte_identical(tmp_path, stage_env, tiny, chunk):
    target = write_target(
        tmp_path / "app.py",
        """
import hashlib, os, tinypkg
from mpi4py import MPI
root = os.path.dirname(tinypkg.__file__)
digests = {}
for top, dirs, files in os.walk(root):
    dirs[:] = [d for d in dirs if d != "__pycache__"]  # bytecode the ranks write
    for name in files:
        path = os.path.join(top, name)
        with open(path, "rb") as f:
            digests[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
emit({"rank": MPI.COMM_WORLD.rank, "file": tinypkg.__file__, "digests": digests})
""",
    )
    driver = (
        "import sys, mpistage.runtime.bulk as b; "
        f"b.PIECE_SIZE = {chunk}; "
        "from mpistage.__main__ import main; main(sys.argv[1:])"
    )
    stage_env.update(PYTHONPATH=str(tiny["site"]), MPISTAGE_EMULATE_NODES="2")
    args = ["-c", driver, "--bundle", tiny["bundle"], target]
    result = mpirun(4, args, stage_env, cwd=tmp_path)
    assert result.returncode == 0, result
    expected = tree_digests(tiny["site"] / "tinypkg")
    assert tiny["bundle"].stat().st_size > 100 * chunk  # many chunks, a ragged end
    res = results(stage_env, 4)
    assert len({r["file"] for r in res}) == 2  # two nodes, two staged copies
    for r in res:
        assert r["digests"] == expected, r["rank"]


SHOW = """
import sys
emit({"name": __name__, "argv": sys.argv, "path0": sys.path[0]})
"""


def semantics_case(tmp_path, kind):
    """Return (plain python args, target args) for one kind of target."""
    if kind == "script":
        return [tmp_path / "app" / "show.py", "a", "-b", "--c=d"]
    if kind == "module":
        return ["-m", "showmod", "a", "-b", "--c=d"]
    return ["-c", (tmp_path / "app" / "show.py").read_text(), "a", "-b"]


@pytest.mark.parametrize("kind", ["script", "module", "code"])
def test_argv_and_main_like_plain_python(tmp_path, stage_env, kind):
    (tmp_path / "app").mkdir()
    (tmp_path / "mods").mkdir()
    write_target(tmp_path / "app" / "show.py", SHOW)
    write_target(tmp_path / "mods" / "showmod.py", SHOW)
    stage_env["PYTHONPATH"] = str(tmp_path / "mods")
    target = semantics_case(tmp_path, kind)

    plain = run([PYTHON, *target], env=stage_env, cwd=tmp_path)
    assert plain.returncode == 0, plain
    out = Path(stage_env["MPISTAGE_TEST_OUT"])
    expected = json.loads((out / "plain.json").read_text())
    (out / "plain.json").unlink()

    result = mpirun(2, ["-m", "mpistage", *target], stage_env, cwd=tmp_path)
    assert result.returncode == 0, result
    for res in results(stage_env, 2):
        assert res["argv"] == expected["argv"]
        assert res["name"] == "__main__"
        if kind != "code":  # plain python puts "" first for -c: the same cwd
            assert res["path0"] == expected["path0"]


def test_script_imports_its_sibling(tmp_path, stage_env):
    app = tmp_path / "app"
    app.mkdir()
    (app / "helper.py").write_text("WORD = 'sibling'\n")
    target = write_target(app / "main.py", "import helper\nemit(helper.WORD)\n")
    result = mpirun(2, ["-m", "mpistage", target], stage_env, cwd=tmp_path / "out")
    assert result.returncode == 0, result
    assert results(stage_env, 2) == ["sibling", "sibling"]


def test_bundled_module_runs_with_dash_m(tmp_path, stage_env, tiny):
    stage_env.update(PYTHONPATH=str(tiny["site"]), MPISTAGE_EMULATE_NODES="2")
    stage_env["MPISTAGE_BUNDLE"] = str(tiny["bundle"])  # the bundle by environment
    args = ["-m", "mpistage", "-m", "tinypkg.main", "one", "two"]
    result = mpirun(2, args, stage_env, cwd=tmp_path)
    assert result.returncode == 0, result
    # two ranks print at once: their words may interleave, not their counts
    assert result.stdout.count("tinypkg.main") == 2, result
    assert result.stdout.count("['one', 'two']") == 2, result


@pytest.mark.parametrize(
    "code,status",
    [("pass", 0), ("import sys; sys.exit(0)", 0), ("import sys; sys.exit(3)", 3)],
)
def test_exit_status_propagates(tmp_path, stage_env, tiny, code, status):
    stage_env["PYTHONPATH"] = str(tiny["site"])
    args = ["-m", "mpistage", "--bundle", tiny["bundle"], "-c", code]
    result = mpirun(2, args, stage_env, cwd=tmp_path)
    assert result.returncode == status, result


def test_misses_are_reported(tmp_path, stage_env, tiny):
    target = write_target(  # only the last rank misses: the report gathers all
        tmp_path / "app.py",
        "import os, tinypkg.data\n"
        "if os.environ['PMI_RANK'] == '1':\n"
        "    import othermod\n"
        "    emit(othermod.__file__)\n"
        "else:\n"
        "    emit(None)\n",
    )
    report = tmp_path / "report.json"
    stage_env.update(
        PYTHONPATH=str(tiny["site"]),
        MPISTAGE_EMULATE_NODES="2",
        MPISTAGE_REPORT=str(report),
    )
    args = ["-m", "mpistage", "--bundle", tiny["bundle"], "--report", target]
    result = mpirun(2, args, stage_env, cwd=tmp_path)
    assert result.returncode == 0, result
    assert results(stage_env, 2) == [None, str(tiny["site"] / "othermod.py")]

    facts = json.loads(report.read_text())
    assert facts["modules"]["missed_names"] == ["othermod"]
    assert facts["modules"]["missed"] == 1
    assert facts["modules"]["served"] == 2  # tinypkg, tinypkg.data
    assert facts["bundle"] == str(tiny["bundle"])
    assert set(facts["seconds"]) == {
        "topology",
        "read",
        "broadcast",
        "stage",
        "validate",
        "activate",
        "run",
    }
    assert all(v >= 0 for v in facts["seconds"].values())
    # the text report: once, on rank 0, on stderr
    assert result.stderr.count("mpistage report") == 1, result
    assert "missed: othermod" in result.stderr
    assert "mpistage report" not in result.stdout


def test_without_bundle_imports_are_live(tmp_path, stage_env, stage_dir, tiny):
    stage_env["PYTHONPATH"] = str(tiny["site"])
    code = "import tinypkg; emit([tinypkg.__file__, where(tinypkg)])"

    result = mpirun(2, ["-m", "mpistage", "-c", EMIT + code], stage_env, cwd=tmp_path)
    assert result.returncode == 0, result
    original = str(tiny["site"] / "tinypkg/__init__.py")
    for file, read in results(stage_env, 2):
        assert file == original  # as with plain python
        assert read.startswith(str(stage_dir)) and read.endswith(original), read
    assert job_dirs(stage_dir) == []


def test_live_imports_can_be_switched_off(tmp_path, stage_env, stage_dir, tiny):
    stage_env.update(PYTHONPATH=str(tiny["site"]), MPISTAGE_LIVE="no")
    code = "import tinypkg; emit(where(tinypkg))"

    result = mpirun(2, ["-m", "mpistage", "-c", EMIT + code], stage_env, cwd=tmp_path)
    assert result.returncode == 0, result
    assert results(stage_env, 2) == [str(tiny["site"] / "tinypkg/__init__.py")] * 2
    # nothing staged, and the node boot's place is gone: the user's directory is empty
    assert [p.relative_to(stage_dir) for p in stage_dir.rglob("*")] == [
        uid_dir(stage_dir).relative_to(stage_dir)
    ]


def test_staged_files_match_originals(tmp_path, stage_env, stage_dir, tiny):
    stage_env["PYTHONPATH"] = str(tiny["site"])
    args = ["-m", "mpistage", "--bundle", tiny["bundle"], "--keep", "-c", "pass"]
    result = mpirun(1, args, stage_env, cwd=tmp_path)
    assert result.returncode == 0, result
    (root,) = job_dirs(stage_dir)
    staged = root / "r0" / "tinypkg"
    assert tree_digests(staged) == tree_digests(tiny["site"] / "tinypkg")
    blob = tiny["site"] / "tinypkg" / "blob.bin"
    assert sha256(staged / "blob.bin") == sha256(blob)
    assert (staged / "blob.bin").stat().st_mtime_ns == blob.stat().st_mtime_ns
    # a module that is not bundled is not staged
    assert not (root / "r0" / "othermod.py").exists()


def test_symlink_member_is_staged(tmp_path, stage_env, stage_dir):
    lib = tmp_path / "lib"
    (lib / "pkg").mkdir(parents=True)
    (lib / "pkg" / "__init__.py").write_text("X = 'via link'\n")
    (lib / "alias.py").symlink_to("pkg/__init__.py")
    bundle = pack(tmp_path / "lib.mpistage", "--path", lib)
    stage_env["PYTHONPATH"] = str(lib)
    code = EMIT + "import alias; emit([where(alias), alias.X])"
    args = ["-m", "mpistage", "--bundle", bundle, "--keep", "-c", code]
    result = mpirun(1, args, stage_env, cwd=tmp_path)
    assert result.returncode == 0, result
    (root,) = job_dirs(stage_dir)
    staged = root / "r0" / "alias.py"
    assert results(stage_env, 1) == [[str(staged), "via link"]]
    assert staged.is_symlink() and os.readlink(staged) == "pkg/__init__.py"


@pytest.mark.parametrize("boot", ["yes", "no"])
def test_python_m_mpi4py_with_a_bundle_misses_nothing(tmp_path, stage_env, tiny, boot):
    """``-m mpi4py app.py``: mpi4py.run, which runs first, comes with mpi4py.

    The node boot brings it with mpi4py (or the rank imports it as usual
    before the bundle's finders), so no rank reports it missed.
    """
    target = write_target(tmp_path / "app.py", "import tinypkg\nemit(tinypkg.VALUE)\n")
    report = tmp_path / "report.json"
    stage_env.update(
        PYTHONPATH=str(tiny["site"]),
        MPISTAGE_EMULATE_NODES="2",
        MPISTAGE_REPORT=str(report),
        MPISTAGE_BOOT=boot,
    )
    args = ["-m", "mpistage", "--bundle", tiny["bundle"], "-m", "mpi4py", target]
    result = mpirun(4, args, stage_env, cwd=tmp_path)
    assert result.returncode == 0, result
    assert results(stage_env, 4) == [42] * 4
    facts = json.loads(report.read_text())
    assert facts["modules"]["missed_names"] == [], facts["modules"]


def test_entry_modules_of_the_documented_entry_points():
    from mpistage.node.imports import entry_modules

    assert entry_modules(["mpistage", "--bundle", "b", "-m", "mpi4py", "a.py"]) == (
        "mpi4py.run",
    )
    assert entry_modules(["mpistage", "-m", "mpi4py.run", "a.py"]) == ("mpi4py.run",)
    assert entry_modules(["mpistage", "-m", "mypkg.main"]) == ()
    assert entry_modules(["mpistage", "app.py"]) == ()


def test_a_bundle_of_another_environment_is_said_in_one_line(tmp_path, stage_env, tiny):
    """A bundle whose roots are not on this sys.path serves nothing: say so first."""
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tiny["site"], elsewhere)
    code = "import tinypkg"
    said = "none of the bundle's roots is on this sys.path"
    for site, expected in ((tiny["site"], 0), (elsewhere, 1)):
        env = dict(stage_env, PYTHONPATH=str(site), MPISTAGE_EMULATE_NODES="2")
        args = ["-m", "mpistage", "--bundle", tiny["bundle"], "-c", code]
        result = mpirun(4, args, env, cwd=tmp_path)
        assert result.returncode == 0, result
        lines = [ln for ln in result.stderr.splitlines() if said in ln]
        assert len(lines) == expected, result.stderr
        if expected:
            assert lines[0].endswith(str(tiny["site"])), lines
