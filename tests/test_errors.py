"""Failures end the job quickly and clearly: one message, exit 1, no leftovers."""

import os
import time
from pathlib import Path

import pytest

from mpistage.runtime.read import read_manifest
from stagetools import (
    PYTHON,
    first_file_member,
    flip_byte,
    job_dirs,
    mpirun,
    mpirun_status,
    rewrite_manifest,
    run,
)

pytestmark = pytest.mark.usefixtures("reap_mpich_shm")

RANKS = 4
QUICK = 20  # seconds an error path may take, at most


def expect_failure(result, status, cause):
    """One ``mpistage: error:`` line naming *cause*; exit 1 on every rank."""
    assert result.elapsed < QUICK, result
    assert result.returncode == 1, result
    assert status == {r: 1 for r in range(RANKS)}, result
    errors = result.errors()
    assert len(errors) == 1, result
    assert cause in errors[0], result
    assert "Traceback" not in result.stderr, result
    return errors[0]


def wrong_python(manifest):
    manifest["python"]["version"] = "2.7"
    manifest["python"]["ext_suffix"] = ".cpython-27-x86_64-linux-gnu.so"


def make_bad_bundle(kind, good, folder):
    """Return a broken copy of the bundle *good*, and the expected cause."""
    path = Path(folder) / f"{kind}.mpistage"
    manifest = read_manifest(good)
    data = good.read_bytes()
    if kind == "corrupt-member":
        member = first_file_member(manifest)
        flip_byte(good, path, member["offset"] + member["size"] // 2)
        return path, f"checksum mismatch in {member['rel']!r}"
    if kind == "corrupt-manifest":
        flip_byte(good, path, len(data) - 5)
        return path, "manifest checksum mismatch"
    if kind == "truncated-data":
        path.write_bytes(data[: len(data) // 2])
        return path, "truncated"
    if kind == "padded":
        path.write_bytes(data + b"\0" * 64)
        return path, "truncated or padded"
    if kind == "truncated-header":
        path.write_bytes(data[:20])
        return path, "truncated"
    if kind == "not-a-bundle":
        path.write_bytes(b"#!/bin/sh\necho this is no bundle\n" * 4)
        return path, "not an mpistage bundle"
    if kind == "wrong-python":
        rewrite_manifest(good, path, wrong_python)
        return path, "built for Python '2.7'"
    if kind == "missing":
        return path, f"cannot read bundle {str(path)!r}: No such file or directory"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "corrupt-member",
        "corrupt-manifest",
        "truncated-data",
        "truncated-header",
        "padded",
        "not-a-bundle",
        "wrong-python",
        "missing",
    ],
)
def test_bad_bundle(tmp_path, stage_env, stage_dir, tiny, kind):
    bad, cause = make_bad_bundle(kind, tiny["bundle"], tmp_path)
    stage_env.update(PYTHONPATH=str(tiny["site"]), MPISTAGE_EMULATE_NODES="2")
    args = ["-m", "mpistage", "--bundle", bad, "-c", "print('target ran')"]
    result, status = mpirun_status(RANKS, args, stage_env, cwd=tmp_path)
    expect_failure(result, status, cause)
    assert "target ran" not in result.stdout
    assert job_dirs(stage_dir) == [], "a partial node's place was left behind"


def test_rewritten_manifest_helper_makes_a_valid_bundle(tmp_path, tiny):
    """The wrong-python case above fails for its version, not for corruption."""
    copy = rewrite_manifest(tiny["bundle"], tmp_path / "same.mpistage", lambda m: m)
    assert read_manifest(copy) == read_manifest(tiny["bundle"])
    assert copy.read_bytes() == tiny["bundle"].read_bytes()


def test_no_usable_place(tmp_path, stage_env, tiny):
    missing = tmp_path / "does-not-exist"
    regular = tmp_path / "a-file"
    regular.write_text("not a directory\n")
    stage_env.update(
        PYTHONPATH=str(tiny["site"]),
        MPISTAGE_EMULATE_NODES="2",
        MPISTAGE_STAGE_DIR=f"{missing}{os.pathsep}{regular}",
    )
    args = ["-m", "mpistage", "--bundle", tiny["bundle"], "-c", "print('target ran')"]
    result, status = mpirun_status(RANKS, args, stage_env, cwd=tmp_path)
    error = expect_failure(result, status, "no usable place for the node's copy")
    assert str(missing) in error and str(regular) in error
    assert not missing.exists()
    assert regular.read_text() == "not a directory\n"


def test_bad_fallback_setting(tmp_path, stage_env, tiny):
    stage_env.update(PYTHONPATH=str(tiny["site"]), MPISTAGE_STAGE_FALLBACK="maybe")
    args = ["-m", "mpistage", "--bundle", tiny["bundle"], "-c", "pass"]
    result, status = mpirun_status(RANKS, args, stage_env, cwd=tmp_path)
    expect_failure(result, status, "MPISTAGE_STAGE_FALLBACK='maybe'")


@pytest.mark.parametrize("value", ["0", "5", "two", "-1"])
def test_bad_emulated_node_count(tmp_path, stage_env, tiny, value):
    stage_env.update(PYTHONPATH=str(tiny["site"]), MPISTAGE_EMULATE_NODES=value)
    args = ["-m", "mpistage", "--bundle", tiny["bundle"], "-c", "print('target ran')"]
    result, status = mpirun_status(RANKS, args, stage_env, cwd=tmp_path)
    error = expect_failure(result, status, f"MPISTAGE_EMULATE_NODES={value!r}")
    assert f"from 1 to the number of ranks ({RANKS})" in error
    assert "target ran" not in result.stdout


def test_emulated_nodes_checked_without_bundle(tmp_path, stage_env):
    stage_env["MPISTAGE_EMULATE_NODES"] = "3"
    result, status = mpirun_status(2, ["-m", "mpistage", "-c", "pass"], stage_env)
    assert result.returncode == 1, result
    assert status == {0: 1, 1: 1}
    assert len(result.errors()) == 1 and "(2)" in result.errors()[0]


def test_exception_on_one_rank_ends_the_job(tmp_path, stage_env, stage_dir, tiny):
    code = (
        "import time, tinypkg\n"
        "from mpi4py import MPI\n"
        "if MPI.COMM_WORLD.rank == 1:\n"
        "    raise RuntimeError('rank one went wrong')\n"
        "time.sleep(60)\n"
        "print('slept through it')\n"
    )
    stage_env.update(PYTHONPATH=str(tiny["site"]), MPISTAGE_EMULATE_NODES="2")
    args = ["-m", "mpistage", "--bundle", tiny["bundle"], "-c", code]
    start = time.monotonic()
    result = mpirun(RANKS, args, stage_env, cwd=tmp_path, timeout=50)
    assert time.monotonic() - start < QUICK, result
    assert result.returncode != 0, result
    assert "Traceback (most recent call last)" in result.stderr
    assert "RuntimeError: rank one went wrong" in result.stderr
    assert "slept through it" not in result.stdout


def test_exception_without_bundle_ends_the_job(tmp_path, stage_env):
    code = (
        "import time\n"
        "from mpi4py import MPI\n"
        "if MPI.COMM_WORLD.rank == 1:\n"
        "    raise KeyError('lost')\n"
        "time.sleep(60)\n"
    )
    result = mpirun(2, ["-m", "mpistage", "-c", code], stage_env, timeout=50)
    assert result.elapsed < QUICK, result
    assert result.returncode != 0
    assert "KeyError: 'lost'" in result.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--bogus", "-c", "pass"], "unknown option '--bogus'"),
        (["--keep=yes", "-c", "pass"], "unknown option '--keep'"),
        (["--bundle"], "--bundle needs a value"),
        ([], "no target"),
        (["--keep"], "no target"),
        (["-m"], "-m needs an argument"),
        (["-c"], "-c needs an argument"),
    ],
)
def test_usage_errors(stage_env, args, message):
    result, status = mpirun_status(2, ["-m", "mpistage", *args], stage_env)
    assert result.returncode == 2, result
    assert status == {0: 2, 1: 2}, result
    assert len(result.errors()) == 1, result
    assert message in result.errors()[0]
    assert result.stderr.count("usage: python -m mpistage") == 1


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help(stage_env, flag):
    result = run(
        [PYTHON, "-m", "mpistage", flag, "-c", "raise SystemExit(5)"], env=stage_env
    )
    assert result.returncode == 0, result
    assert "usage: python -m mpistage" in result.stdout
    assert "--bundle FILE" in result.stdout and "MPISTAGE_STAGE_DIR" in result.stdout


def test_version(stage_env):
    from mpistage import __version__

    result = run([PYTHON, "-m", "mpistage", "--version"], env=stage_env)
    assert result.returncode == 0
    assert result.stdout.strip() == f"mpistage {__version__}"


# -- failures in the middle of the bytes' one pass ---------------------------------

PIECE = 16 << 10  # bytes: the bundle below is about 80 pieces long
# Sets small pieces, then, for a FAULT, does harm on one rank at one piece.
FAULT_DRIVER = """
import os, signal, sys
from mpi4py import MPI
import mpistage.runtime.bulk as bulk
import mpistage.runtime.extract as extract
import mpistage.runtime.read as read
bulk.PIECE_SIZE = int(sys.argv[1])
fault, rank, calls = sys.argv[2], MPI.COMM_WORLD.rank, [0]

def at_third(cls, name, harm):
    real = getattr(cls, name)
    def hurt(self, *args):
        calls[0] += 1
        if calls[0] == 3:
            harm(self)
        return real(self, *args)
    setattr(cls, name, hurt)

if fault == "shrinks" and rank == 0:  # another process truncates the bundle
    at_third(read.Bundle, "fill", lambda b: os.truncate(b.path, b.span[1] // 2))
if fault == "reader killed" and rank == 0:
    at_third(read.Bundle, "fill", lambda b: os.kill(os.getpid(), signal.SIGKILL))
if fault == "leader killed" and rank == 2:
    at_third(extract.Writer, "write", lambda w: os.kill(os.getpid(), signal.SIGKILL))
from mpistage.__main__ import main
main(sys.argv[3:])
"""


@pytest.fixture
def long_bundle(tmp_path):
    """A bundle of many pieces: 20 files of 64 KiB, then a small last one."""
    from crafttools import craft

    members = [{"rel": "longpkg", "type": "dir", "mode": 0o755}]
    members += [
        {"rel": f"longpkg/part{i}.bin", "type": "file", "data": os.urandom(64 << 10)}
        for i in range(20)
    ]
    members.append({"rel": "longpkg/__init__.py", "type": "file", "data": b"X = 1\n"})
    return craft(tmp_path / "long.mpistage", members)


def pieces_args(bundle, fault="none", extra=()):
    """The runner's arguments: *bundle* in small pieces, with *fault*."""
    args = ["-c", FAULT_DRIVER, PIECE, fault, "--bundle", bundle, "--trust", *extra]
    return [*args, "-c", "print('target ran')"]


def run_pieces(bundle, env, fault="none", extra=()):
    """Run the runner on *bundle* in small pieces, with *fault*; (result, status)."""
    env = dict(env, MPISTAGE_EMULATE_NODES="2")
    return mpirun_status(RANKS, pieces_args(bundle, fault, extra), env)


def test_many_pieces_arrive_whole(tmp_path, stage_env, stage_dir, long_bundle):
    result, status = run_pieces(long_bundle, stage_env, extra=["--keep"])
    assert result.returncode == 0 and status == dict.fromkeys(range(RANKS), 0), result
    copies = job_dirs(stage_dir)
    assert len(copies) == 2
    manifest = read_manifest(long_bundle)
    data = long_bundle.read_bytes()
    for copy in copies:
        for member in manifest["members"]:
            if member["type"] == "file":
                got = (copy / "r0" / member["rel"]).read_bytes()
                want = data[member["offset"] : member["offset"] + member["size"]]
                assert got == want, (copy, member["rel"])


def test_a_checksum_wrong_in_the_last_piece(
    tmp_path, stage_env, stage_dir, long_bundle
):
    """Every piece but the last is through and written: still nothing is run."""
    manifest = read_manifest(long_bundle)
    last = [m for m in manifest["members"] if m["type"] == "file"][-1]
    bad = flip_byte(long_bundle, tmp_path / "bad.mpistage", last["offset"] + 2)
    result, status = run_pieces(bad, stage_env)
    expect_failure(result, status, f"checksum mismatch in {last['rel']!r}")
    assert "target ran" not in result.stdout
    assert job_dirs(stage_dir) == []


def test_a_bundle_that_shrinks_while_read(tmp_path, stage_env, stage_dir, long_bundle):
    result, status = run_pieces(long_bundle, stage_env, "shrinks")
    expect_failure(result, status, "shrank while being read")
    assert "target ran" not in result.stdout
    assert job_dirs(stage_dir) == []


@pytest.mark.parametrize("fault", ["reader killed", "leader killed"])
def test_a_rank_killed_mid_piece(tmp_path, stage_env, stage_dir, long_bundle, fault):
    """The launcher ends the job at once and says why; no copy is left."""
    from test_security import settled

    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    result = mpirun(RANKS, pieces_args(long_bundle, fault), env)
    assert result.returncode != 0 and result.elapsed < QUICK, result
    assert "target ran" not in result.stdout and "Traceback" not in result.stderr
    assert settled(stage_dir) == []
