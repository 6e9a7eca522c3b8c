"""Staging roots: private, refused when unsafe, removed or cleaned up."""

import os
import socket
import stat
import subprocess

import pytest

from mpistage import StageError
from mpistage.node import cleanup
from mpistage.node import place as stage
from mpistage.runtime.extract import Footprint
from stagetools import EMIT, job_dirs, mpirun_status, mpistage, results, uid_dir

pytestmark = pytest.mark.usefixtures("reap_mpich_shm")

TARGET = "import tinypkg; emit(tinypkg.__file__)"


def run_tiny(stage_env, tiny, ranks=2, nodes="2", extra=()):
    """Run a job that imports tinypkg from the bundle and emits its __file__."""
    stage_env.update(PYTHONPATH=str(tiny["site"]), MPISTAGE_EMULATE_NODES=nodes)
    args = ["-m", "mpistage", "--bundle", tiny["bundle"], *extra, "-c", EMIT + TARGET]
    return mpirun_status(ranks, args, stage_env)


def owner_of(root):
    """The owner record of a node's place (``key=value`` lines)."""
    lines = (root / ".mpistage-owner").read_text().splitlines()
    return dict(line.partition("=")[::2] for line in lines)


def write_owner(root, **fields):
    """Write an owner record as a job's leader does."""
    text = "".join(f"{k}={v}\n" for k, v in dict(kind="job", **fields).items())
    (root / ".mpistage-owner").write_text(text)


def footprint(size):
    """What a bundle of one file of *size* bytes takes."""
    return Footprint({"members": [{"type": "file", "size": size}]})


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_roots_are_private_and_kept_with_keep(stage_env, stage_dir, tiny):
    result, status = run_tiny(stage_env, tiny, extra=["--keep"])
    assert result.returncode == 0 and status == {0: 0, 1: 0}, result
    roots = job_dirs(stage_dir)
    assert len(roots) == 2, roots
    assert mode(uid_dir(stage_dir)) == 0o700
    assert os.lstat(uid_dir(stage_dir)).st_uid == os.getuid()
    for root in roots:
        assert mode(root) == 0o700
        assert mode(root / "r0") == 0o700
        owner = owner_of(root)
        assert owner["host"] == socket.gethostname()
        assert owner["pid"].isdigit()
        assert root.name.startswith(f"job-{owner['job']}.n")
    files = sorted(r for r in results(stage_env, 2))
    assert files == sorted(str(r / "r0" / "tinypkg" / "__init__.py") for r in roots)


def test_roots_removed_at_exit(stage_env, stage_dir, tiny):
    result, status = run_tiny(stage_env, tiny)
    assert result.returncode == 0 and status == {0: 0, 1: 0}, result
    files = results(stage_env, 2)
    assert all(f.startswith(str(uid_dir(stage_dir)) + os.sep) for f in files)
    assert job_dirs(stage_dir) == []
    assert not any(os.path.exists(f) for f in files)


def test_clean_removes_roots_of_ended_jobs(tmp_path, stage_env, stage_dir, tiny):
    result, _ = run_tiny(stage_env, tiny, extra=["--keep"])
    assert result.returncode == 0, result
    kept = job_dirs(stage_dir)
    assert len(kept) == 2

    # roots that clean must leave alone: a live leader, another host
    live = uid_dir(stage_dir) / "job-live.n0"
    live.mkdir(mode=0o700)
    write_owner(live, host=socket.gethostname(), pid=os.getpid(), job="live")
    remote = uid_dir(stage_dir) / "job-remote.n0"
    remote.mkdir(mode=0o700)
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that is dead here: only the host protects this root
    write_owner(remote, host="some-other-host.invalid", pid=gone.pid, job="remote")

    dry = mpistage(["clean", "--dry-run"], env=stage_env)
    assert dry.returncode == 0, dry
    assert sorted(dry.stdout.splitlines()) == [f"would remove {r}" for r in kept]
    assert job_dirs(stage_dir) == sorted([*kept, live, remote])

    done = mpistage(["clean"], env=stage_env)
    assert done.returncode == 0, done
    assert sorted(done.stdout.splitlines()) == [f"removed {r}" for r in kept]
    assert job_dirs(stage_dir) == sorted([live, remote])

    again = mpistage(["clean"], env=stage_env)
    assert again.returncode == 0 and again.stdout == ""


def plant_symlink(stage_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    uid_dir(stage_dir).symlink_to(elsewhere)
    return elsewhere


def plant_dangling(stage_dir, tmp_path):
    target = tmp_path / "not-yet"
    uid_dir(stage_dir).symlink_to(target)
    return target


def plant_foreign(stage_dir, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to chown to another uid")
    planted = uid_dir(stage_dir)
    planted.mkdir(mode=0o700)
    os.chown(planted, 12345, 12345)
    return planted


def plant_writable(bits):
    def plant(stage_dir, tmp_path):
        planted = uid_dir(stage_dir)
        planted.mkdir()
        planted.chmod(bits)
        return planted

    return plant


PLANTED = {
    "symlink": plant_symlink,
    "dangling symlink": plant_dangling,
    "another user's": plant_foreign,
    "group-writable": plant_writable(0o770),
    "world-writable": plant_writable(0o707),
    "writable by all": plant_writable(0o777),
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_unsafe_user_dir_is_passed_over_for_a_private_one(
    tmp_path, stage_env, stage_dir, tiny, case
):
    planted = PLANTED[case](stage_dir, tmp_path)
    before = os.lstat(uid_dir(stage_dir))
    result, status = run_tiny(stage_env, tiny)
    assert result.returncode == 0 and status == {0: 0, 1: 0}, result
    for found in results(stage_env, 2):
        used = found[len(str(stage_dir)) + 1 :].split(os.sep)[0]
        assert used.startswith(f"mpistage-{os.getuid()}-"), found
    after = os.lstat(uid_dir(stage_dir))
    assert (after.st_mode, after.st_uid) == (before.st_mode, before.st_uid)
    assert not planted.exists() or planted.is_symlink() or not any(planted.iterdir())
    assert sorted(p.name for p in stage_dir.iterdir()) == [uid_dir(stage_dir).name]


def test_user_dir_of_an_earlier_job_is_reused(stage_env, stage_dir, tiny):
    planted = uid_dir(stage_dir)
    planted.mkdir(mode=0o700)
    (planted / "job-earlier.n0").mkdir(mode=0o700)
    result, _ = run_tiny(stage_env, tiny)
    assert result.returncode == 0, result
    assert job_dirs(stage_dir) == [planted / "job-earlier.n0"]


def test_candidate_order(monkeypatch, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    monkeypatch.setenv("MPISTAGE_STAGE_DIR", f"{first}{os.pathsep}{second}")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmpdir"))
    monkeypatch.delenv("MPISTAGE_STAGE_FALLBACK", raising=False)
    expected = [str(first), str(second), "/dev/shm", str(tmp_path / "tmpdir"), "/tmp"]
    assert stage.candidates() == expected

    monkeypatch.delenv("TMPDIR")
    assert stage.candidates() == [str(first), str(second), "/dev/shm", "/tmp"]

    for value in ("no", "0", "off", "False"):
        monkeypatch.setenv("MPISTAGE_STAGE_FALLBACK", value)
        assert stage.candidates() == [str(first), str(second)]

    monkeypatch.setenv("MPISTAGE_STAGE_FALLBACK", "sometimes")
    with pytest.raises(StageError, match="MPISTAGE_STAGE_FALLBACK"):
        stage.candidates()

    monkeypatch.setenv("MPISTAGE_STAGE_FALLBACK", "no")
    monkeypatch.setenv("MPISTAGE_STAGE_DIR", "")
    assert stage.candidates() == []
    refused = "no usable place for the node's copy: none given"
    with pytest.raises(StageError, match=refused):
        stage.make_root("job", 0, footprint(1))


def test_default_candidate_is_dev_shm(monkeypatch):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    monkeypatch.delenv("MPISTAGE_STAGE_DIR", raising=False)
    monkeypatch.delenv("MPISTAGE_STAGE_FALLBACK", raising=False)
    existed = uid_dir("/dev/shm").exists()
    root = stage.make_root(f"pytest-{os.getpid()}", 0, footprint(1))
    path = root.path
    try:
        assert path.startswith(f"/dev/shm/mpistage-{os.getuid()}/job-pytest-")
        assert mode(path) == 0o700
    finally:
        cleanup.remove(root)
        if not existed:
            uid_dir("/dev/shm").rmdir()
    assert not os.path.exists(path)


def test_candidates_without_room_are_refused(monkeypatch, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    monkeypatch.setenv("MPISTAGE_STAGE_DIR", f"{first}{os.pathsep}{second}")
    monkeypatch.setenv("MPISTAGE_STAGE_FALLBACK", "no")
    free = os.statvfs(first)
    need = free.f_bavail * free.f_frsize * 4 + 1
    with pytest.raises(StageError) as info:
        stage.make_root("job", 0, footprint(need))
    message = str(info.value)
    assert message.startswith("no usable place for the node's copy")
    assert str(first) in message and str(second) in message and "needed" in message
    assert not uid_dir(first).exists() and not uid_dir(second).exists()
