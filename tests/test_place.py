"""Staging places, directly: the safe-directory rule, squatting, reaping, removal.

Each check of ``place`` is named for what it refuses; each is tried here on
the directory it must refuse and on one it must accept.
"""

import os
import stat
import subprocess

import pytest

from mpistage import StageError
from mpistage.node import cleanup, place
from mpistage.runtime.extract import Footprint

ROOT = os.geteuid() == 0


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def opened(path):
    """Open the directory *path* (a test helper, no checks)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


def test_open_safe_walks_to_the_resolved_path(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    found, fd = place.open_safe(tmp_path / "link")
    os.close(fd)
    assert found == str(real)


def test_open_safe_refuses_an_ancestor_writable_by_others(tmp_path):
    shared = tmp_path / "shared"
    (shared / "mine").mkdir(parents=True)
    shared.chmod(0o777)
    with pytest.raises(StageError, match="writable by others and not sticky"):
        place.open_safe(shared / "mine")
    shared.chmod(0o1777)  # sticky, like /tmp: fine
    os.close(place.open_safe(shared / "mine")[1])


@pytest.mark.skipif(not ROOT, reason="needs root to chown")
def test_open_safe_refuses_another_users_directory_and_symlink(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 4242, 4242)
    with pytest.raises(StageError, match="owned by uid 4242"):
        place.open_safe(theirs)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    os.chown(link, 4242, 4242, follow_symlinks=False)
    with pytest.raises(StageError, match="a symlink of uid 4242"):
        place.open_safe(link)


def test_own_dir_is_made_private_and_tightened(tmp_path):
    fd = opened(tmp_path)
    try:
        os.close(place.own_dir(fd, "new", str(tmp_path / "new")))
        assert mode(tmp_path / "new") == 0o700
        (tmp_path / "loose").mkdir(mode=0o755)
        os.chmod(tmp_path / "loose", 0o755)
        os.close(place.own_dir(fd, "loose", "loose"))
        assert mode(tmp_path / "loose") == 0o700
        (tmp_path / "open").mkdir()
        os.chmod(tmp_path / "open", 0o777)
        with pytest.raises(StageError, match="writable by others"):
            place.own_dir(fd, "open", "open")
        (tmp_path / "link").symlink_to(tmp_path / "new")
        with pytest.raises(StageError, match="is a symlink"):
            place.own_dir(fd, "link", "link")
    finally:
        os.close(fd)


@pytest.mark.parametrize("squat", ["symlink", "writable"])
def test_user_dir_falls_back_to_a_private_one(tmp_path, squat):
    user = tmp_path / f"mpistage-{os.getuid()}"
    if squat == "symlink":
        user.symlink_to(tmp_path)
    else:
        user.mkdir()
        user.chmod(0o777)
    fd = opened(tmp_path)
    try:
        name, user_fd, holder = place.user_dir(fd, str(tmp_path))
        os.close(user_fd)
    finally:
        os.close(fd)
    assert name.startswith(f"mpistage-{os.getuid()}-") and holder[1] == name
    assert mode(tmp_path / name) == 0o700
    assert user.is_symlink() or mode(user) == 0o777  # left as it was


def footprint(*sizes, dirs=0):
    members = [{"type": "file", "size": s} for s in sizes]
    return Footprint({"members": members + [{"type": "dir"}] * dirs})


def test_footprint_counts_whole_blocks():
    assert footprint(1, 4096, 4097, dirs=2).bytes(4096) == 4096 * (1 + 1 + 2 + 2)
    assert footprint(0).bytes(4096) == 0
    assert footprint(1, 1, 1).inodes == 3


def test_room_refuses_what_does_not_fit(tmp_path):
    fd = opened(tmp_path)
    try:
        free = os.statvfs(tmp_path)
        place.room(fd, "here", footprint(4096))
        with pytest.raises(StageError, match="no space left for the bundle in 'here'"):
            place.room(fd, "here", footprint(free.f_bavail * free.f_frsize + 1))
    finally:
        os.close(fd)


def test_room_names_a_directorys_files_not_a_bundle(tmp_path):
    """``mpistage.data.staged_dir`` stages a directory: its refusal says so."""
    from types import SimpleNamespace

    from mpistage.data.dirs import Room

    fd = opened(tmp_path)
    try:
        free = os.statvfs(tmp_path)
        big = SimpleNamespace(size=free.f_bavail * free.f_frsize + 1)
        tree = SimpleNamespace(files=[big], dirs=[])
        with pytest.raises(StageError, match="no space left for the directory's files"):
            place.room(fd, "here", Room(tree))
    finally:
        os.close(fd)


def dead_pid():
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def root_of(user, name, **fields):
    path = user / name
    path.mkdir(mode=0o700)
    fd = opened(path)
    try:
        fields = {"kind": "job", "host": os.uname().nodename, **fields}
        place.write_fields(fd, place.OWNER_FILE, fields, os.O_CREAT | os.O_EXCL)
    finally:
        os.close(fd)
    return path


def test_reap_removes_only_roots_of_dead_jobs_here(tmp_path):
    user = tmp_path / f"mpistage-{os.getuid()}"
    user.mkdir(mode=0o700)
    dead = root_of(user, "job-dead.n0", pid=dead_pid())
    kept = root_of(user, "job-kept.n0", pid=dead_pid(), keep="yes")
    live = root_of(user, "job-live.n0", pid=os.getpid())
    remote = root_of(user, "job-remote.n0", pid=dead_pid(), host="elsewhere")
    bare = user / "job-bare.n0"  # no owner record: nobody can tell
    bare.mkdir()
    private = tmp_path / f"mpistage-{os.getuid()}-abc"
    private.mkdir(mode=0o700)
    dead_private = root_of(private, "job-dead.n0", pid=dead_pid())
    fd = opened(tmp_path)
    try:
        cleanup.reap_dead_roots(fd)
    finally:
        os.close(fd)
    assert not dead.exists() and not dead_private.exists()
    assert kept.exists() and live.exists() and remote.exists() and bare.exists()


def test_stale_roots_with_kept_ones_for_clean(tmp_path):
    root_of(tmp_path, "job-kept.n0", pid=dead_pid(), keep="yes")
    root_of(tmp_path, "job-dead.n0", pid=dead_pid())
    fd = opened(tmp_path)
    try:
        assert list(cleanup.stale_roots(fd)) == ["job-dead.n0"]
        assert list(cleanup.stale_roots(fd, kept_too=True)) == [
            "job-dead.n0",
            "job-kept.n0",
        ]
    finally:
        os.close(fd)


def test_a_root_made_again_since_it_was_judged_dead_is_left(tmp_path):
    """Two ranks of a node reap at once: one removes the dead root and makes
    its own of the same name; the other, which judged the dead one, must not
    remove the new one (else both become the node's first rank)."""
    dead = root_of(tmp_path, "boot-x.n0", pid=dead_pid())
    judged = dead.stat().st_ino
    fd = opened(tmp_path)
    try:
        assert cleanup.stale_root(fd, dead.name) == judged
        cleanup.doom(fd, dead.name)  # the sibling's reaping
        new = root_of(tmp_path, "boot-x.n0", pid=os.getpid())  # and its new root
        # This rank's removal, a moment late, as remove_if_stale makes it:
        cleanup.doom(fd, dead.name, lambda d: not cleanup.dead_root(fd, d, judged))
    finally:
        os.close(fd)
    assert new.exists() and (new / place.OWNER_FILE).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["boot-x.n0"]


def deep_tree(top, depth):
    fd = opened(top)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        os.symlink("/etc", "link", dir_fd=fd)  # never followed
        new = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = new
    os.close(fd)


def test_removal_walks_any_depth_with_two_descriptors(tmp_path):
    (tmp_path / "t").mkdir()
    deep_tree(tmp_path / "t", 3000)
    fds_before = len(os.listdir("/proc/self/fd"))
    fd = opened(tmp_path)
    try:
        cleanup.remove_entry(fd, "t")
    finally:
        os.close(fd)
    assert not (tmp_path / "t").exists()
    assert os.path.isdir("/etc")
    assert len(os.listdir("/proc/self/fd")) == fds_before


def test_removal_of_what_is_gone_is_no_error(tmp_path):
    fd = opened(tmp_path)
    try:
        cleanup.remove_entry(fd, "never-there")
    finally:
        os.close(fd)


def test_fields_round_trip_and_refuse_a_symlink(tmp_path):
    fd = opened(tmp_path)
    try:
        place.write_fields(fd, "rec", {"a": 1, "b": "x=y"}, os.O_CREAT | os.O_EXCL)
        place.write_fields(fd, "rec", {"c": "z"}, os.O_APPEND)
        assert place.read_fields(fd, "rec") == {"a": "1", "b": "x=y", "c": "z"}
        (tmp_path / "victim").write_text("mine")
        (tmp_path / "link").symlink_to(tmp_path / "victim")
        with pytest.raises(OSError):
            place.write_fields(fd, "link", {"a": 1}, os.O_APPEND)
        assert (tmp_path / "victim").read_text() == "mine"
        assert place.read_fields(fd, "link") == {}
    finally:
        os.close(fd)


class FakeComm:
    """The one attribute :func:`cleanup.say_failure` reads."""

    def __init__(self, rank):
        self.rank = rank


def test_a_failure_inside_finalize_is_said_by_the_rank_it_hit(capsys):
    cleanup.say_failure(FakeComm(4), RuntimeError("boom"))
    assert capsys.readouterr().err == (
        "mpistage: error: rank 4: internal error: RuntimeError: boom\n"
    )
    cleanup.say_failure(FakeComm(4), StageError("agreed"))  # rank 0 says those
    assert capsys.readouterr().err == ""
    cleanup.say_failure(FakeComm(0), StageError("agreed"))
    assert capsys.readouterr().err == "mpistage: error: agreed\n"


def test_a_removal_cut_short_is_finished_by_the_next_job(tmp_path):
    """A watchdog killed while removing leaves a name the next job recognizes.

    The owner record may be gone already (half the tree is); the name says
    the tree is being removed, and the next job finishes it, whoever began
    it: a pid in a name decides nothing (another user may hold it), and two
    removers of one tree do no harm.
    """
    user = tmp_path / f"mpistage-{os.getuid()}"
    user.mkdir(mode=0o700)
    cut = user / f"job-gone.n0{cleanup.REMOVING}{dead_pid()}"
    going = user / f"job-going.n0{cleanup.REMOVING}{os.getpid()}"
    for tree in (cut, going):
        (tree / "r0" / "pkg").mkdir(parents=True)
        for i in range(50):
            (tree / "r0" / "pkg" / f"m{i}.py").write_text("")
    fd = opened(tmp_path)
    try:
        cleanup.reap_dead_roots(fd)
    finally:
        os.close(fd)
    assert not cut.exists() and not going.exists()


def test_the_watchdog_renames_the_root_before_removing_it(tmp_path):
    """What ``rm`` gets is the renamed root: cut short, it is known for garbage."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "rm.log"
    stub = bin_dir / "rm"
    stub.write_text(f'#!/bin/sh\necho "$@" > {log}\n')
    stub.chmod(0o755)
    os.symlink("/bin/mv", bin_dir / "mv")
    root = tmp_path / "job-x.n0"
    root.mkdir()
    command = ["/bin/sh", "-c", cleanup.WATCHDOG, "mpistage-watchdog", str(root)]
    done = subprocess.run(command, input=b"", env={"PATH": str(bin_dir)}, check=True)
    assert done.returncode == 0
    renamed = [p.name for p in tmp_path.iterdir() if p.name.startswith("job-x.n0")]
    assert not root.exists() and len(renamed) == 1, renamed
    assert cleanup.REMOVING in renamed[0]
    assert log.read_text().split() == ["-rf", "--", str(tmp_path / renamed[0])]


def test_an_environment_stage_is_dead_when_its_run_is_gone_here():
    from mpistage.runtime.envreap import dead

    here = os.uname().nodename
    gone, live = f"{here}:{dead_pid()}", f"{here}:{os.getpid()}"
    assert dead({"host": here, "run": gone})
    assert not dead({"host": here, "run": live})
    assert not dead({"host": "elsewhere", "run": gone})
    assert not dead({"host": here, "run": gone, "keep": "yes"})
    assert dead({"host": here, "run": gone, "keep": "yes"}, kept_too=True)
    assert not dead({"host": here})  # staged by hand, no scheduler: clean DIR
    assert not dead({"host": here, "run": f"other:{dead_pid()}"})


def test_the_one_writer_never_writes_through_a_link_or_over_a_file(tmp_path):
    fd = opened(tmp_path)
    try:
        (tmp_path / "secret").write_text("theirs")
        (tmp_path / "planted").symlink_to(tmp_path / "secret")
        for name in ("planted", "secret"):
            with pytest.raises(FileExistsError):
                place.write_new(fd, name, b"mine", 0o600)
        assert (tmp_path / "secret").read_text() == "theirs"
        place.write_new(fd, "new", memoryview(b"abc"), 0o640, 1_000_000_000)
        assert (tmp_path / "new").read_bytes() == b"abc"
        assert os.stat(tmp_path / "new").st_mtime_ns == 1_000_000_000
        assert mode(tmp_path / "new") == 0o640
    finally:
        os.close(fd)


def test_the_one_writer_removes_a_file_cut_short(tmp_path, monkeypatch):
    fd = opened(tmp_path)
    calls = []

    def write_once(out, data):
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return 1

    monkeypatch.setattr(place._os, "write", write_once)
    try:
        with pytest.raises(OSError):
            place.write_new(fd, "cut", b"abc", 0o600)
    finally:
        monkeypatch.undo()
        os.close(fd)
    assert not (tmp_path / "cut").exists()
