"""Hostile bundles, hostile neighbours and bad days: nothing escapes, nothing hangs.

Bundles here are crafted byte by byte from the documented format
(docs/bundle-format.md), with valid digests, so that only what the test
means to be hostile is hostile.
"""

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from crafttools import craft
from mpistage.runtime import bundlefile
from mpistage.runtime.read import read_manifest
from stagetools import (
    MPIEXEC,
    PYTHON,
    clean_environ,
    job_dirs,
    mpirun,
    mpirun_status,
    mpistage,
    write_target,
)

QUICK = 20  # seconds an error path may take, at most


def run_bundle(bundle, env, ranks=2, nodes=2, extra=("--trust",)):
    """Run ``python -m mpistage --bundle BUNDLE -c pass``; return (result, status)."""
    env = dict(env, MPISTAGE_EMULATE_NODES=str(nodes))
    args = ["-m", "mpistage", "--bundle", bundle, *extra, "-c", "pass"]
    return mpirun_status(ranks, args, env)


def stage_bundle(bundle, folder, env, ranks=2, nodes=2):
    """Run ``mpistage stage BUNDLE --to FOLDER`` under mpiexec."""
    env = dict(env, MPISTAGE_EMULATE_NODES=str(nodes))
    return mpirun_status(
        ranks, ["-m", "mpistage", "stage", bundle, "--to", folder], env
    )


def one_line_everywhere(result, status, ranks=2, words=()):
    """Every rank exited 1, quickly, with one error line naming *words*."""
    assert result.returncode == 1, result
    assert status == dict.fromkeys(range(ranks), 1), result
    assert result.elapsed < QUICK, result
    errors = result.errors()
    assert len(errors) == 1, result
    for word in words:
        assert word in errors[0], result


@pytest.fixture
def outside(tmp_path):
    """A directory a hostile bundle must not touch, with its mtime fixed."""
    path = tmp_path / "outside"
    path.mkdir()
    os.utime(path, ns=(10**18, 10**18))
    return path


# -- 1. nothing outside the node's place ---------------------------------------

LINK_ESCAPES = {
    "file through a link": lambda out: [
        {"rel": "evil", "type": "link", "target": str(out)},
        {"rel": "evil/x", "type": "file", "data": b"owned"},
    ],
    "dir through a link": lambda out: [
        {"rel": "evil", "type": "link", "target": str(out)},
        {"rel": "evil/deeper", "type": "dir", "mode": 0o755},
    ],
    "dir named like the link": lambda out: [
        {"rel": "evil", "type": "link", "target": str(out)},
        {"rel": "evil", "type": "dir", "mode": 0o755, "mtime_ns": 5},
    ],
}


@pytest.mark.parametrize("case", sorted(LINK_ESCAPES))
@pytest.mark.parametrize("nodes", [1, 2])
def test_runner_never_writes_through_a_link(
    tmp_path, stage_env, stage_dir, outside, case, nodes
):
    bundle = craft(tmp_path / "evil.mpistage", LINK_ESCAPES[case](outside))
    result, status = run_bundle(bundle, stage_env, nodes=nodes)
    one_line_everywhere(result, status, words=["evil"])
    assert list(outside.iterdir()) == []
    assert outside.stat().st_mtime_ns == 10**18
    assert job_dirs(stage_dir) == []


@pytest.mark.parametrize("case", sorted(LINK_ESCAPES))
def test_stager_never_writes_through_a_link(tmp_path, stage_env, outside, case):
    members = LINK_ESCAPES[case](outside)
    bundle = craft(tmp_path / "evil.mpistage", members, kind="env")
    result, status = stage_bundle(bundle, tmp_path / "env{node}", stage_env)
    one_line_everywhere(result, status, words=["evil"])
    assert list(outside.iterdir()) == []
    assert outside.stat().st_mtime_ns == 10**18
    for node in (0, 1):
        leftover = tmp_path / f"env{node}"
        assert not leftover.exists() or list(leftover.iterdir()) == []


@pytest.mark.parametrize("dest", ["../../..", "/abs", "a/../../b", "a//b"])
def test_root_destination_must_stay_inside(tmp_path, stage_env, stage_dir, dest):
    roots = [{"path": str(tmp_path / "site"), "dest": dest, "listing": []}]
    members = [{"rel": "made_by_bundle/x", "type": "file"}]
    for kind, runner in (("env", True), ("packages", False)):
        bundle = craft(tmp_path / f"{kind}.mpistage", members, roots, kind=kind)
        if runner:
            result, status = stage_bundle(bundle, tmp_path / "env{node}", stage_env)
        else:
            result, status = run_bundle(bundle, stage_env)
        one_line_everywhere(result, status, words=["malformed", "dest"])
    assert not list(tmp_path.rglob("made_by_bundle"))
    assert job_dirs(stage_dir) == []


# -- 2. a job never hangs ---------------------------------------------------------

BROKEN_MANIFESTS = {
    "not json": b"{not json",
    "not an object": b"[1, 2]",
    "no members": json.dumps({"python": bundlefile.python_tag(), "roots": []}).encode(),
    "root out of range": None,
    "unknown member type": None,
    "member without a path": None,
}


def broken(tmp_path, case, kind):
    """A bundle with a valid digest over a broken manifest."""
    members = [{"rel": "pkg/x.py", "type": "file"}]
    if case == "root out of range":
        members[0]["root"] = 7
    elif case == "unknown member type":
        members[0]["type"] = "fifo"
    elif case == "member without a path":
        members[0]["rel"] = None
    raw = BROKEN_MANIFESTS[case]
    return craft(tmp_path / "broken.mpistage", members, kind=kind, raw=raw)


@pytest.mark.parametrize("case", sorted(BROKEN_MANIFESTS))
def test_broken_manifest_ends_the_runner(tmp_path, stage_env, stage_dir, case):
    result, status = run_bundle(broken(tmp_path, case, "packages"), stage_env)
    one_line_everywhere(result, status, words=["malformed"])
    assert job_dirs(stage_dir) == []


@pytest.mark.parametrize("case", sorted(BROKEN_MANIFESTS))
def test_broken_manifest_ends_the_stager(tmp_path, stage_env, case):
    bundle = broken(tmp_path, case, "env")
    result, status = stage_bundle(bundle, tmp_path / "env{node}", stage_env)
    one_line_everywhere(result, status, words=["malformed"])


LEAN_DRIVER = """
import resource, sys
from mpi4py import MPI
import mpistage.runtime.bulk as bulk
bulk.PIECE_SIZE = 1 << 20
with open("/proc/self/status") as f:
    kb = next(int(l.split()[1]) for l in f if l.startswith("VmSize:"))
limit = (kb << 10) + (int(sys.argv[1]) << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from mpistage.__main__ import main
main(sys.argv[2:])
"""
CHECK_COPY = """
import hashlib, sys
import importlib.resources as resources
with resources.as_file(resources.files("bigpkg") / "big.bin") as path:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
assert digest == sys.argv[1] and "/job-" in str(path), (digest, path)
"""


def test_no_rank_holds_the_bundle(tmp_path, stage_env, stage_dir):
    """Ranks that may map 48 MiB more than they had stage a 160 MiB bundle.

    Rank 0 reads it and every leader writes its copy piece by piece (1 MiB
    pieces here): nobody allocates a buffer of the bundle's size.
    """
    blob = os.urandom(160 << 20)
    members = [
        {"rel": "bigpkg", "type": "dir", "mode": 0o755},
        {"rel": "bigpkg/__init__.py", "type": "file", "data": b""},
        {"rel": "bigpkg/big.bin", "type": "file", "data": blob},
    ]
    bundle = craft(tmp_path / "big.mpistage", members)
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2", PYTHONPATH=str(tmp_path / "site"))
    digest = hashlib.sha256(blob).hexdigest()
    args = ["-c", LEAN_DRIVER, 48, "--bundle", bundle, "--trust"]
    result, status = mpirun_status(2, [*args, "-c", CHECK_COPY, digest], env)
    assert result.returncode == 0 and status == {0: 0, 1: 0}, result
    assert job_dirs(stage_dir) == []


def test_auto_with_an_unwritable_cache_ends_before_the_program(
    tmp_path, stage_env, stage_dir
):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r} + __import__('os').environ['PMI_RANK'], 'w')"
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    args = ["-m", "mpistage", "--auto", "--cache-dir", blocker / "cache", "-c", code]
    result, status = mpirun_status(2, args, env)
    one_line_everywhere(result, status, words=["--auto cache"])
    assert not list(tmp_path.glob("ran*"))  # refused before the program ran


# -- 3. and 4. unsafe places -------------------------------------------------------


@pytest.mark.parametrize("where", ["parent", "grandparent"])
def test_world_writable_ancestor_without_sticky_is_refused(
    tmp_path, stage_env, tiny, where
):
    top = tmp_path / "shared"
    candidate = top / "scratch"
    candidate.mkdir(parents=True)
    (candidate if where == "parent" else top).chmod(0o777)
    env = dict(
        stage_env, PYTHONPATH=str(tiny["site"]), MPISTAGE_STAGE_DIR=str(candidate)
    )
    result, status = run_bundle(tiny["bundle"], env, extra=())
    one_line_everywhere(result, status, words=["writable by others and not sticky"])
    assert job_dirs(candidate) == []

    (candidate if where == "parent" else top).chmod(0o1777)
    result, status = run_bundle(tiny["bundle"], env, extra=())
    assert result.returncode == 0, result


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_stage_refuses_another_users_symlink_on_the_way(tmp_path, stage_env, env_like):
    shared = tmp_path / "shared"  # like /tmp: anyone may add a name here
    shared.mkdir()
    shared.chmod(0o1777)
    real = tmp_path / "real"
    real.mkdir()
    link = shared / "link"
    link.symlink_to(real)
    os.lchown(link, 12345, 12345)
    result, status = stage_bundle(env_like, link / "env{node}", stage_env)
    one_line_everywhere(result, status, words=["symlink of uid 12345"])
    assert list(real.iterdir()) == []


@pytest.fixture
def env_like(tmp_path):
    """A tiny environment bundle: a bin/python script and a library file."""
    members = [
        {"rel": "bin", "type": "dir", "mode": 0o755},
        {"rel": "bin/python", "type": "file", "mode": 0o755, "data": b"#!/bin/sh\n"},
        {"rel": "lib", "type": "dir", "mode": 0o755},
        *[
            {"rel": f"lib/f{i}.py", "type": "file", "data": b"y" * 100}
            for i in range(300)
        ],
    ]
    roots = [{"path": str(tmp_path / "prefix"), "dest": "", "listing": []}]
    return craft(tmp_path / "env.mpistage", members, roots, kind="env")


# -- 5. nothing left behind ------------------------------------------------------


def settled(stage_dir, timeout=5.0):
    """Wait for watchdogs to finish; return the job directories left."""
    deadline = time.monotonic() + timeout
    while job_dirs(stage_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    return job_dirs(stage_dir)


ENDINGS = {
    "nonzero exit": ("import sys; sys.exit(3)", 3),
    "exception on rank 1": (
        "from mpi4py import MPI\n"
        "if MPI.COMM_WORLD.rank == 1: raise KeyError('lost')\n"
        "import time; time.sleep(30)",
        1,
    ),
    "COMM_WORLD.Abort on rank 3": (
        "from mpi4py import MPI\n"
        "if MPI.COMM_WORLD.rank == 3: MPI.COMM_WORLD.Abort(4)\n"
        "import time; time.sleep(30)",
        4,
    ),
}


def bundle_or_live(how, tiny):
    """The runner's options: stage the tiny bundle, or none (live imports)."""
    return ["--bundle", tiny["bundle"]] if how == "bundle" else []


@pytest.mark.parametrize("how", ["bundle", "live"])
@pytest.mark.parametrize("case", sorted(ENDINGS))
def test_abnormal_endings_leave_no_copy(
    stage_env, stage_dir, tiny, reap_mpich_shm, case, how
):
    code, expected = ENDINGS[case]
    env = dict(stage_env, PYTHONPATH=str(tiny["site"]), MPISTAGE_EMULATE_NODES="2")
    args = [
        "-m",
        "mpistage",
        *bundle_or_live(how, tiny),
        "-c",
        "import tinypkg\n" + code,
    ]
    result = mpirun(4, args, env)
    assert result.returncode == expected, result
    assert result.elapsed < QUICK, result
    assert settled(stage_dir) == []


SLEEPER = """
import os, time, tinypkg
from mpi4py import MPI
open(os.path.join(os.environ["MPISTAGE_TEST_OUT"], str(MPI.COMM_WORLD.rank)), "w")
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["bundle", "live"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_leaves_no_copy(
    tmp_path, stage_env, stage_dir, tiny, reap_mpich_shm, sig, how
):
    env = dict(stage_env, PYTHONPATH=str(tiny["site"]), MPISTAGE_EMULATE_NODES="2")
    target = write_target(tmp_path / "sleep.py", SLEEPER)
    cmd = [MPIEXEC, "-n", "4", PYTHON, "-m", "mpistage", *bundle_or_live(how, tiny)]
    proc = subprocess.Popen(
        [*cmd, target], env=env, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out = Path(stage_env["MPISTAGE_TEST_OUT"])
        deadline = time.monotonic() + QUICK
        while len(list(out.iterdir())) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(job_dirs(stage_dir)) == 2
        proc.send_signal(sig)
        proc.wait(timeout=QUICK)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert settled(stage_dir) == []


FINALIZER = """
import os
from mpi4py import MPI
import tinypkg
MPI.Finalize()
print("after finalize", flush=True)
"""


def test_program_that_finalizes_mpi_itself(tmp_path, stage_env, stage_dir, tiny):
    env = dict(stage_env, PYTHONPATH=str(tiny["site"]), MPISTAGE_EMULATE_NODES="2")
    target = write_target(tmp_path / "fin.py", FINALIZER)
    report = tmp_path / "report.json"
    env["MPISTAGE_REPORT"] = str(report)
    args = ["-m", "mpistage", "--bundle", tiny["bundle"], "--report", target]
    result, status = mpirun_status(4, args, env)
    assert result.returncode == 0 and status == dict.fromkeys(range(4), 0), result
    assert result.stdout.count("after finalize") == 4
    assert "mpistage report" in result.stderr
    assert json.loads(report.read_text())["modules"]["served"] >= 1
    assert job_dirs(stage_dir) == []


def test_auto_saves_when_the_program_finalizes_mpi(tmp_path, stage_env, tiny):
    env = dict(stage_env, PYTHONPATH=str(tiny["site"]), MPISTAGE_EMULATE_NODES="2")
    target = write_target(tmp_path / "fin.py", FINALIZER)
    cache = tmp_path / "cache"
    args = ["-m", "mpistage", "--auto", "--cache-dir", cache, target]
    result, status = mpirun_status(2, args, env)
    assert result.returncode == 0 and status == {0: 0, 1: 0}, result
    (saved,) = cache.glob("*.mpistage")
    assert "tinypkg/__init__.py" in {m["rel"] for m in read_manifest(saved)["members"]}


@pytest.mark.parametrize("state", ["gone", "zombie"])
def test_clean_removes_copies_of_dead_leaders(tmp_path, stage_env, stage_dir, state):
    child = subprocess.Popen(["true"])
    if state == "gone":
        child.wait()
    else:
        deadline = time.monotonic() + 5
        while Path(f"/proc/{child.pid}/stat").read_text().split()[2] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
    root = stage_dir / f"mpistage-{os.getuid()}" / "job-dead.n0"
    (root / "r0").mkdir(parents=True, mode=0o700)
    (root / ".mpistage-owner").write_text(
        f"kind=job\nhost={os.uname().nodename}\npid={child.pid}\njob=dead\n"
    )
    try:
        done = mpistage(["clean"], env=stage_env)
    finally:
        child.wait()
    assert done.returncode == 0, done
    assert done.stdout.strip() == f"removed {root}"
    assert not root.exists()


def test_interrupted_stage_is_refused_then_cleaned(tmp_path, stage_env, env_like):
    folder = tmp_path / "env0"
    result, _ = stage_bundle(env_like, folder, stage_env, ranks=1, nodes=1)
    assert result.returncode == 0, result
    marker = folder / ".mpistage-stage"
    marker.write_text(marker.read_text().replace("complete", "incomplete"))
    (folder / "lib" / "f7.py").unlink()  # as if killed in the middle
    result, status = stage_bundle(env_like, folder, stage_env, ranks=1, nodes=1)
    one_line_everywhere(result, status, ranks=1, words=["mpistage clean"])
    done = mpistage(["clean", folder], env=clean_environ())
    assert done.returncode == 0, done
    assert not folder.exists()
    result, _ = stage_bundle(env_like, folder, stage_env, ranks=1, nodes=1)
    assert result.returncode == 0, result


# -- 6. staging space running out mid-write ----------------------------------------


def mount_tmpfs(point, size):
    """Mount a tmpfs of *size* at *point* (skip the test if one cannot)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    point.mkdir()
    how = ["-t", "tmpfs", "-o", f"size={size}", "tmpfs", point]
    done = subprocess.run(["mount", *how])
    if done.returncode:
        pytest.skip("cannot mount a tmpfs here")
    return point


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs: room for a bundle's bytes, not for its files' blocks."""
    yield mount_tmpfs(tmp_path / "small", "1m")
    subprocess.run(["umount", "-l", tmp_path / "small"])


@pytest.fixture
def shared_tmpfs(tmp_path):
    """A 10 MiB tmpfs: room for one node's copy of :func:`six_mib`, not two."""
    yield mount_tmpfs(tmp_path / "shared", "10m")
    subprocess.run(["umount", "-l", tmp_path / "shared"])


def six_mib(path, kind="packages"):
    """A bundle of 6 MiB in 96 files, sent in 64 KiB pieces (:data:`PIECES`)."""
    members = [
        {"rel": f"m{i}.bin", "type": "file", "data": os.urandom(64 << 10)}
        for i in range(96)
    ]
    roots = [{"path": str(path.parent / "site"), "listing": []}]
    if kind == "env":
        roots[0]["dest"] = ""
    return craft(path, members, roots, kind=kind)


PIECES = """
import sys
import mpistage.runtime.bulk as bulk
bulk.PIECE_SIZE = 64 << 10
from mpistage.__main__ import main
main(sys.argv[1:])
"""


def test_full_candidate_falls_back_to_the_next(tmp_path, stage_env, small_tmpfs):
    members = [
        {"rel": f"m{i}.py", "type": "file", "data": b"z" * 64} for i in range(600)
    ]
    bundle = craft(tmp_path / "many.mpistage", members)
    second = tmp_path / "second"
    second.mkdir()
    env = dict(stage_env, MPISTAGE_STAGE_DIR=f"{small_tmpfs}{os.pathsep}{second}")
    result, status = run_bundle(bundle, env, extra=("--trust", "--keep"))
    assert result.returncode == 0, result
    assert job_dirs(small_tmpfs) == []
    assert len(job_dirs(second)) == 2

    env["MPISTAGE_STAGE_DIR"] = str(small_tmpfs)
    result, status = run_bundle(bundle, env)
    words = ["no usable place for the node's copy", "space"]
    one_line_everywhere(result, status, words=words)


def test_full_stage_dir_is_one_line_naming_it(tmp_path, stage_env, small_tmpfs):
    members = [
        {"rel": f"m{i}.py", "type": "file", "data": b"z" * 64} for i in range(600)
    ]
    bundle = craft(tmp_path / "many.mpistage", members, kind="env")
    folder = small_tmpfs / "env"
    result, status = stage_bundle(bundle, folder, stage_env, ranks=1, nodes=1)
    one_line_everywhere(result, status, ranks=1, words=["no space left", str(folder)])
    assert not folder.exists()  # the stage made it, and removes it again


def test_a_place_full_mid_pass_moves_to_the_next(tmp_path, stage_env, shared_tmpfs):
    """Both nodes' copies passed the room check of one tmpfs, which holds
    one: a leader's writes fail mid-pass, and the bytes go again, to a
    place in the next candidate for the full node."""
    bundle = six_mib(tmp_path / "six.mpistage")
    second = tmp_path / "second"
    second.mkdir()
    env = dict(stage_env, MPISTAGE_STAGE_DIR=f"{shared_tmpfs}{os.pathsep}{second}")
    env.update(MPISTAGE_EMULATE_NODES="2", MPISTAGE_BOOT="no")  # no boot copy there
    args = ["-c", PIECES, "--bundle", bundle, "--trust", "--keep", "-c", "pass"]
    result, status = mpirun_status(2, args, env)
    assert result.returncode == 0 and status == {0: 0, 1: 0}, result
    kept = job_dirs(shared_tmpfs) + job_dirs(second)
    assert len(kept) == 2 and job_dirs(second), kept
    for copy in kept:
        assert len(list((copy / "r0").iterdir())) == 96, copy

    env["MPISTAGE_STAGE_DIR"] = str(shared_tmpfs)
    for copy in job_dirs(shared_tmpfs):
        subprocess.run(["rm", "-rf", copy], check=True)
    result, status = mpirun_status(2, args[:5] + ["-c", "pass"], env)
    words = ["no usable place for the node's copy", "ran out of space"]
    one_line_everywhere(result, status, words=words)
    assert job_dirs(shared_tmpfs) == []


def test_a_stage_dir_full_mid_pass_is_one_line(tmp_path, stage_env, shared_tmpfs):
    bundle = six_mib(tmp_path / "six.mpistage", "env")
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    args = ["-c", PIECES, "stage", bundle, "--to", shared_tmpfs / "env{node}"]
    result, status = mpirun_status(2, args, env)
    one_line_everywhere(result, status, words=["no space left", str(shared_tmpfs)])
    assert list(shared_tmpfs.iterdir()) == []  # the stage made them, and removed them


# -- 7. messages -----------------------------------------------------------------


def test_missing_script_is_found_before_staging(tmp_path, stage_env, stage_dir):
    never = tmp_path / "never-read.mpistage"  # does not exist: never opened
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    args = ["-m", "mpistage", "--bundle", never, tmp_path / "no-such-app.py"]
    result, status = mpirun_status(2, args, env)
    one_line_everywhere(result, status, words=["no-such-app.py"])
    assert job_dirs(stage_dir) == []
