"""The public Python API: ``mpistage.staged``, ``pack``, ``inspect``, the CLI shell."""

import pytest

import mpistage as api
from mpistage.runtime.read import read_manifest
from stagetools import (
    clean_environ,
    first_file_member,
    flip_byte,
    job_dirs,
    mpirun,
    mpistage,
    results,
    write_target,
)

STAGED_APP = """
import os, sys
from mpi4py import MPI
import mpistage
from mpistage.runtime.activate import StagedFinder, StagedHook

comm = MPI.COMM_WORLD
hooks = list(sys.path_hooks)
facts = {"rank": comm.rank}
with mpistage.staged(sys.argv[1], comm=comm) as session:
    import tinypkg
    facts["file"] = tinypkg.__file__
    facts["inside"] = session.staged.path
    facts["hooked"] = any(isinstance(h, StagedHook) for h in sys.path_hooks)
facts["hooks_restored"] = sys.path_hooks == hooks
facts["finders_left"] = [
    repr(f) for f in list(sys.meta_path) + list(sys.path_importer_cache.values())
    if isinstance(f, StagedFinder) or type(f).__name__ == "MetadataFinder"
]
facts["copy_exists"] = os.path.exists(facts["inside"])
import othermod
facts["other"] = othermod.__file__
try:
    with mpistage.staged(sys.argv[2], comm=comm):
        facts["entered"] = True
except mpistage.StageError as exc:
    facts["error"] = str(exc)
facts["went_on"] = comm.allreduce(1)
from mpistage.node import cleanup
finalize, depth = MPI.Finalize, 0
while hasattr(finalize, "__wrapped__"):
    finalize, depth = finalize.__wrapped__, depth + 1
facts["finalize"] = [MPI.Finalize.__name__, depth, len(cleanup.ENDS)]
emit(facts)
"""


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_staged_serves_then_restores(tmp_path, stage_env, stage_dir, tiny, ranks):
    corrupt = tmp_path / "corrupt.mpistage"
    member = first_file_member(read_manifest(tiny["bundle"]))
    flip_byte(tiny["bundle"], corrupt, member["offset"])
    target = write_target(tmp_path / "app.py", STAGED_APP)
    stage_env.update(
        PYTHONPATH=str(tiny["site"]), MPISTAGE_EMULATE_NODES=str(min(ranks, 2))
    )
    result = mpirun(ranks, [target, tiny["bundle"], corrupt], stage_env, cwd=tmp_path)
    assert result.returncode == 0, result
    facts = results(stage_env, ranks)
    copies = {f["inside"] for f in facts}
    assert len(copies) == min(ranks, 2)  # one copy per (emulated) node
    for f in facts:
        assert f["file"] == f["inside"] + "/r0/tinypkg/__init__.py", f
        assert f["hooked"] and f["hooks_restored"], f
        assert f["finders_left"] == [], f
        assert not f["copy_exists"], f
        assert f["other"] == str(tiny["site"] / "othermod.py")
        assert "entered" not in f
        assert "checksum mismatch" in f["error"], f
        assert f["went_on"] == ranks
        # One MPI.Finalize of mpistage's, whatever the number of blocks, with
        # nothing left for it to run first.
        assert f["finalize"] == ["Finalize", 1, 0], f
    assert {f["error"] for f in facts} == {facts[0]["error"]}  # agreed
    assert job_dirs(stage_dir) == []


def test_pack_and_inspect_are_the_cli_as_functions(tmp_path, tiny, monkeypatch):
    monkeypatch.syspath_prepend(str(tiny["site"]))
    out = tmp_path / "api.mpistage"
    manifest = api.pack(str(out), ["tinypkg"], exclude=["*.bin"])
    assert manifest == api.inspect(str(out))
    rels = {m["rel"] for m in manifest["members"]}
    assert "tinypkg/__init__.py" in rels and "tinypkg/blob.bin" not in rels
    cli = mpistage(["inspect", "--json", out], env=clean_environ())
    assert cli.returncode == 0 and '"tinypkg/__init__.py"' in cli.stdout


def test_public_names():
    assert set(api.__all__) == {
        "StageError",
        "__version__",
        "data",
        "inspect",
        "pack",
        "staged",
    }
    for name in api.__all__:
        assert getattr(api, name) is not None


def test_inspect_of_a_malformed_manifest_is_one_line(tmp_path, tiny):
    from stagetools import rewrite_manifest

    bad = rewrite_manifest(
        tiny["bundle"],
        tmp_path / "bad.mpistage",
        lambda m: m["members"][0].update(root=99),
    )
    with pytest.raises(api.StageError, match="malformed: member 0 has bad root 99"):
        api.inspect(str(bad))
    result = mpistage(["inspect", bad], env=clean_environ())
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0, result
    assert result.stderr.startswith("mpistage: error: "), result


@pytest.mark.parametrize("word", ["frobnicate", "packk"])
def test_unknown_subcommand_is_one_line(word):
    result = mpistage([word], env=clean_environ())
    assert result.returncode == 2, result
    assert result.stderr.startswith(f"mpistage: error: unknown command {word!r}")
    assert result.stderr.count("\n") == 1, result
    assert result.stdout == ""


def test_version_without_mpi():
    result = mpistage(["--version"], env=clean_environ())
    assert result.returncode == 0, result
    assert result.stdout.strip() == f"mpistage {api.__version__}"


AFTER_APP = """
import os, sys
from mpi4py import MPI
import mpistage

comm = MPI.COMM_WORLD
with mpistage.staged(sys.argv[1], comm=comm) as session:
    import tinypkg
    inside, copy = tinypkg.__file__, session.staged.path
import tinypkg.sub  # not imported inside the block
with open(os.path.join(os.path.dirname(tinypkg.__file__), "blob.bin"), "rb") as f:
    blob = len(f.read())
emit({"inside": inside, "copy": copy, "after": tinypkg.__file__,
      "spec": tinypkg.__spec__.origin, "path": list(tinypkg.__path__),
      "sub": tinypkg.sub.TEXT, "sub_file": tinypkg.sub.__file__, "blob": blob,
      "copy_exists": os.path.exists(copy)})
"""


def test_imports_after_the_block_come_from_the_originals(tmp_path, stage_env, tiny):
    target = write_target(tmp_path / "app.py", AFTER_APP)
    env = dict(stage_env, PYTHONPATH=str(tiny["site"]), MPISTAGE_EMULATE_NODES="2")
    result = mpirun(4, [target, tiny["bundle"]], env, cwd=tmp_path)
    assert result.returncode == 0, result
    pkg = tiny["site"] / "tinypkg"
    for facts in results(env, 4):
        assert facts["inside"] == facts["copy"] + "/r0/tinypkg/__init__.py", facts
        assert not facts["copy_exists"], facts
        assert facts["after"] == facts["spec"] == str(pkg / "__init__.py"), facts
        assert facts["path"] == [str(pkg)], facts
        assert facts["sub"] == "tiny data", facts
        assert facts["sub_file"] == str(pkg / "sub" / "__init__.py"), facts
        assert facts["blob"] == 10_000, facts
