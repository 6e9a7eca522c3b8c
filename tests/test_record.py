"""``mpistage record``: a trial run writes the bundle; replays use it.

Every replay runs 4 ranks on 2 emulated nodes (2 ranks for the smaller
checks), stages below the test's own directory, and compares what the
program printed with a plain ``python`` run of the same script.
"""

import json
import os
import sysconfig
from pathlib import Path

import pytest

from mpistage.runtime import bundlefile
from mpistage.runtime.read import read_manifest
from recordtools import WORKLOAD, below, make_workload, need_report, record, replay
from recordtools import recorded as record_ok
from stagetools import PYTHON, mpistage, results, run, write_target

pytestmark = pytest.mark.usefixtures("reap_mpich_shm")


def plain(script, env, out, args=()):
    """Run ``python SCRIPT ARGS`` with its results going to *out*."""
    out.mkdir(exist_ok=True)
    result = run([PYTHON, script, *args], env=dict(env, MPISTAGE_TEST_OUT=str(out)))
    assert result.returncode == 0, result
    return result.stdout


def record_into(tmp_path, name, script, env, granularity=None):
    """Record ``python SCRIPT`` into tmp_path/NAME.mpistage (its own output)."""
    out = tmp_path / f"{name}-record-out"
    out.mkdir()
    path = tmp_path / f"{name}.mpistage"
    env = dict(env, MPISTAGE_TEST_OUT=str(out))
    record_ok(path, script, env, cwd=tmp_path, granularity=granularity)
    return path


def inspect(path, env):
    result = mpistage(["inspect", path], env=env)
    assert result.returncode == 0, result
    return result.stdout


WORKLOAD_APP = f"""
import json, sys
import {WORKLOAD}, {WORKLOAD}.driver
summary = {WORKLOAD}.driver.main()
line = json.dumps({{"summary": summary, "argv": sys.argv[1:]}}, sort_keys=True)
print(line)
emit({{"line": line, "file": where({WORKLOAD}),
       "driver": where({WORKLOAD}.driver)}})
"""


def test_round_trip_generated_workload(tmp_path, stage_env, stage_dir):
    site = make_workload(tmp_path / "site")
    (tmp_path / "app").mkdir()
    script = write_target(tmp_path / "app" / "app.py", WORKLOAD_APP)
    env = dict(stage_env, PYTHONPATH=str(site))
    expected = plain(script, env, tmp_path / "plain-out", ["a", "--b"])
    assert json.loads(expected)["summary"]["ok"] is True

    path = record_into(tmp_path, "app", script, env)
    text = inspect(path, env)
    assert "made by: mpistage record" in text, text
    assert f"recorded: {PYTHON} {script} (granularity package)" in text, text
    tag = bundlefile.python_tag()
    assert f"python: {tag['implementation']} {tag['version']} " in text, text
    assert tag["ext_suffix"] in text
    assert any(line.endswith(f" {site}") for line in text.splitlines()), text
    manifest = read_manifest(path)
    assert WORKLOAD in manifest["packages"]
    assert manifest["recorded"]["granularity"] == "package"
    assert manifest["recorded"]["processes"] == 1
    rels = {m["rel"] for m in manifest["members"]}
    assert f"{WORKLOAD}-1.0.dist-info/METADATA" in rels
    assert not any("mpistage" == r.split("/")[0] for r in rels)

    result, facts = replay(
        4,
        ["--bundle", path, "--report"],
        script,
        env,
        tmp_path / "r.json",
        args=["a", "--b"],
    )
    facts = need_report(result, facts)
    assert result.stdout == [expected] * 4, result
    assert facts["modules"]["missed"] == 0, facts
    assert facts["modules"]["served"] >= 20, facts
    assert facts["ranks"] == 4 and len(facts["stage_roots"]) == 2
    assert "mpistage report" in result.stderr
    for res in results(stage_env, 4):
        assert res["line"] == expected.strip()
        assert below(res["file"], stage_dir) and below(res["driver"], stage_dir), res


NUMPY_APP = """
import json
import numpy, numpy.linalg
rng = numpy.random.default_rng(7)
a = rng.standard_normal((30, 30)) + 30 * numpy.eye(30)
line = json.dumps({
    "det": round(float(numpy.linalg.det(a)), -20),
    "solve": [round(float(v), 9) for v in numpy.linalg.solve(a, numpy.ones(30))[:5]],
    "svd": round(float(numpy.linalg.svd(a, compute_uv=False)[0]), 9),
    "version": numpy.__version__,
})
print(line)
emit({"line": line, "numpy": where(numpy), "linalg": where(numpy.linalg)})
"""


def test_round_trip_numpy(tmp_path, stage_env, stage_dir):
    pytest.importorskip("numpy")
    (tmp_path / "app").mkdir()
    script = write_target(tmp_path / "app" / "np_app.py", NUMPY_APP)
    expected = plain(script, stage_env, tmp_path / "plain-out").strip()
    path = record_into(tmp_path, "np", script, stage_env)
    assert "numpy" in read_manifest(path)["packages"]

    result, facts = replay(
        4, ["--bundle", path, "--report"], script, stage_env, tmp_path / "r.json"
    )
    facts = need_report(result, facts)
    assert result.stdout == [expected + "\n"] * 4, result
    assert facts["modules"]["missed"] == 0, facts
    assert facts["modules"]["served"] > 10, facts
    for res in results(stage_env, 4):
        assert res["line"] == expected
        assert below(res["numpy"], stage_dir) and below(res["linalg"], stage_dir)


MPI_APP = """
from mpi4py import MPI
rank = MPI.COMM_WORLD.rank
import common
if rank % 2:
    import oddonly
    name = where(oddonly)
else:
    name = None
print("rank", rank, common.VALUE)
emit({"rank": rank, "common": where(common), "odd": name})
"""


def test_record_under_mpiexec_takes_every_rank(tmp_path, stage_env, stage_dir):
    """Each Python process of the command is recorded; the bundle is their union."""
    from stagetools import MPIEXEC

    if MPIEXEC is None:
        pytest.skip("no mpiexec next to this Python nor on PATH")
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "common.py").write_text("VALUE = 5\n")
    (lib / "oddonly.py").write_text("ODD = True\n")
    (lib / "unused.py").write_text("UNUSED = True\n")
    (tmp_path / "app").mkdir()
    script = write_target(tmp_path / "app" / "app.py", MPI_APP)
    env = dict(stage_env, PYTHONPATH=str(lib))
    out = tmp_path / "record-out"
    out.mkdir()
    path = tmp_path / "mpi.mpistage"
    result = record(
        path,
        [MPIEXEC, "-n", 2, PYTHON, script],
        dict(env, MPISTAGE_TEST_OUT=str(out)),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result
    assert sorted(p.name for p in out.iterdir()) == ["0.json", "1.json"]
    manifest = read_manifest(path)
    assert manifest["recorded"]["processes"] == 2, manifest["recorded"]
    assert {"common", "oddonly"} <= set(manifest["packages"]), manifest["packages"]
    assert "unused" not in manifest["packages"]

    result, facts = replay(4, ["--bundle", path], script, env, tmp_path / "r.json")
    facts = need_report(result, facts)
    assert facts["modules"]["missed"] == 0, facts
    res = results(stage_env, 4)
    for r in res:
        assert below(r["common"], stage_dir), r
        assert (r["odd"] is None) == (r["rank"] % 2 == 0)
        assert r["odd"] is None or below(r["odd"], stage_dir), r


NSP_APP = """
import nsp.a, nsp.b
print(nsp.a.A, nsp.b.B)
emit({"a": where(nsp.a), "b": where(nsp.b), "path": list(nsp.__path__)})
"""


def test_namespace_package_across_two_roots(tmp_path, stage_env, stage_dir):
    for root, mod in (("rootA", "a"), ("rootB", "b")):
        (tmp_path / root / "nsp").mkdir(parents=True)
        (tmp_path / root / "nsp" / f"{mod}.py").write_text(f"{mod.upper()} = 1\n")
    (tmp_path / "app").mkdir()
    script = write_target(tmp_path / "app" / "app.py", NSP_APP)
    roots = [tmp_path / "rootA", tmp_path / "rootB"]
    env = dict(stage_env, PYTHONPATH=os.pathsep.join(map(str, roots)))
    expected = plain(script, env, tmp_path / "plain-out")
    path = record_into(tmp_path, "nsp", script, env)
    paths = [r["path"] for r in read_manifest(path)["roots"]]
    assert str(roots[0]) in paths and str(roots[1]) in paths, paths

    result, facts = replay(2, ["--bundle", path], script, env, tmp_path / "r.json")
    facts = need_report(result, facts)
    assert result.stdout == [expected] * 2, result
    assert facts["modules"]["missed"] == 0, facts
    for res in results(stage_env, 2):
        assert below(res["a"], stage_dir) and below(res["b"], stage_dir), res
        assert res["a"].endswith("/nsp/a.py") and res["b"].endswith("/nsp/b.py")


@pytest.fixture
def editable_pth(tmp_path):
    """An editable install: a .pth in the venv's purelib naming a source dir."""
    src = tmp_path / "edsrc"
    (src / "edpkg").mkdir(parents=True)
    (src / "edpkg" / "__init__.py").write_text("WHERE = 'editable'\n")
    pth = Path(sysconfig.get_paths()["purelib"]) / "mpistage_test_editable.pth"
    try:
        pth.write_text(f"{src}\n")
    except OSError as exc:
        pytest.skip(f"cannot write to the venv's purelib: {exc}")
    try:
        yield src
    finally:
        pth.unlink(missing_ok=True)


ED_APP = """
import edpkg
print(edpkg.WHERE)
emit({"file": where(edpkg)})
"""


def test_editable_install_through_pth(tmp_path, stage_env, stage_dir, editable_pth):
    (tmp_path / "app").mkdir()
    script = write_target(tmp_path / "app" / "app.py", ED_APP)
    assert plain(script, stage_env, tmp_path / "plain-out") == "editable\n"
    path = record_into(tmp_path, "ed", script, stage_env)
    manifest = read_manifest(path)
    assert "edpkg" in manifest["packages"]
    assert str(editable_pth) in [r["path"] for r in manifest["roots"]]

    result, facts = replay(
        2, ["--bundle", path], script, stage_env, tmp_path / "r.json"
    )
    facts = need_report(result, facts)
    assert result.stdout == ["editable\n"] * 2, result
    assert facts["modules"]["missed"] == 0, facts
    for res in results(stage_env, 2):
        assert below(res["file"], stage_dir), res


LATE_APP = """
import os
import mypkg, mypkg.early
from mpi4py import MPI
rank = MPI.COMM_WORLD.rank
late = None
if rank > 0:
    import mypkg.late
    late = where(mypkg.late)
emit({"rank": rank, "early": where(mypkg.early), "late": late})
"""


@pytest.fixture
def late_setup(tmp_path, stage_env):
    lib = tmp_path / "lib"
    (lib / "mypkg").mkdir(parents=True)
    (lib / "mypkg" / "__init__.py").write_text("")
    (lib / "mypkg" / "early.py").write_text("E = 1\n")
    (lib / "mypkg" / "late.py").write_text("L = 2\n")
    (tmp_path / "app").mkdir()
    script = write_target(tmp_path / "app" / "app.py", LATE_APP)
    return lib, script, dict(stage_env, PYTHONPATH=str(lib))


def test_package_granularity_serves_a_late_submodule(
    tmp_path, stage_env, stage_dir, late_setup
):
    lib, script, env = late_setup
    path = record_into(tmp_path, "pkg", script, env, granularity="package")
    rels = {m["rel"] for m in read_manifest(path)["members"]}
    assert "mypkg/late.py" in rels

    result, facts = replay(
        4, ["--bundle", path, "--report"], script, env, tmp_path / "r.json"
    )
    facts = need_report(result, facts)
    assert facts["modules"]["missed"] == 0, facts
    assert "hint:" not in result.stderr
    for res in results(stage_env, 4):
        assert below(res["early"], stage_dir), res
        assert (res["late"] is None) == (res["rank"] == 0)
        assert res["late"] is None or below(res["late"], stage_dir), res


def test_file_granularity_misses_a_late_submodule(
    tmp_path, stage_env, stage_dir, late_setup
):
    lib, script, env = late_setup
    path = record_into(tmp_path, "file", script, env, granularity="file")
    manifest = read_manifest(path)
    assert manifest["recorded"]["granularity"] == "file"
    rels = {m["rel"] for m in manifest["members"]}
    assert "mypkg/early.py" in rels and "mypkg/late.py" not in rels, rels

    result, facts = replay(
        4, ["--bundle", path, "--report"], script, env, tmp_path / "r.json"
    )
    # ranks > 0 import mypkg.late from the original: slower, still correct
    facts = need_report(result, facts)
    assert facts["modules"]["missed_names"] == ["mypkg.late"], facts
    assert facts["modules"]["missed"] == 1
    hints = [line for line in result.stderr.splitlines() if "hint:" in line]
    assert len(hints) == 1 and "mpistage record" in hints[0], result.stderr
    assert "missed: mypkg.late" in result.stderr
    for res in results(stage_env, 4):
        assert below(res["early"], stage_dir), res
        if res["rank"]:
            assert res["late"] == str(lib / "mypkg" / "late.py"), res


def one_error(result):
    """The single ``mpistage: error:`` line that is all of stderr."""
    assert result.returncode == 1, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpistage: error: "), result
    return lines[0]


def test_record_without_command(tmp_path, stage_env):
    out = tmp_path / "x.mpistage"
    line = one_error(mpistage(["record", "-o", out], env=stage_env, cwd=tmp_path))
    assert "no command to record" in line
    line = one_error(mpistage(["record", "-o", out, "--"], env=stage_env, cwd=tmp_path))
    assert "no command to record" in line
    assert not out.exists()


def test_record_of_failing_command_writes_nothing(tmp_path, stage_env):
    out = tmp_path / "x.mpistage"
    code = "import json; import sys; sys.exit(2)"
    result = record(out, [PYTHON, "-c", code], stage_env, cwd=tmp_path)
    assert "status 2" in one_error(result)
    assert "no bundle written" in result.stderr
    assert not out.exists()
    assert not list(tmp_path.glob(".mpistage-*.tmp"))


def test_record_of_no_python_process(tmp_path, stage_env):
    out = tmp_path / "x.mpistage"
    result = record(out, ["sh", "-c", "exit 0"], stage_env, cwd=tmp_path)
    assert "no Python process was recorded" in one_error(result)
    result = record(out, [tmp_path / "does-not-exist"], stage_env, cwd=tmp_path)
    assert "cannot run" in one_error(result)
    assert not out.exists()


def test_editing_the_script_leaves_its_recorded_bundle_fresh(tmp_path, stage_env, tiny):
    """The program's own script is not bundled: an edit does not make it stale."""
    env = dict(stage_env, PYTHONPATH=str(tiny["site"]))
    app = tmp_path / "app"
    app.mkdir()
    script = write_target(app / "edited.py", "import tinypkg\nemit('before')\n")
    bundle = record_into(tmp_path, "edited", script, env)
    from mpistage.runtime.read import read_manifest

    rels = [m["rel"] for m in read_manifest(str(bundle))["members"]]
    assert "edited.py" not in rels and rels, rels
    new = app / "edited.py.new"  # an editor's save: write, then rename over
    new.write_text(script.read_text().replace("'before'", "'after'"))
    os.replace(new, script)
    result, _ = replay(4, ["--bundle", bundle], script, env, tmp_path / "r.json")
    assert result.returncode == 0, result
    assert results(env, 4) == ["after"] * 4
