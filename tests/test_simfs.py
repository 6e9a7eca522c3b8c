"""Tests of the simulated shared file system (needs FUSE; skipped without it).

The exact counts below were measured on Linux 6.x with libfuse 3.14 and the
kernel caches off. The high-level libfuse API answers the kernel's LOOKUPs
with ``getattr``, so resolving ``a/b.txt`` costs one getattr per component and
``stat`` one more; glibc's ``opendir`` adds an ``fstat`` (one getattr).
"""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mpistage.bench import simfs
from mpistage.bench.simfs import SimFS, SimFSError

FUSE_REASON = simfs.fuse_available()
requires_fuse = pytest.mark.skipif(FUSE_REASON is not None, reason=str(FUSE_REASON))

SMALL = b"hello\n"
BLOB = bytes(range(256)) * 12  # 3072 bytes: one page, one FUSE read


@pytest.fixture
def tree(tmp_path):
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    (src / "a").mkdir(parents=True)
    (src / "a" / "b.txt").write_bytes(SMALL)
    (src / "blob.bin").write_bytes(BLOB)
    (src / "f").write_bytes(b"x")
    (src / "link").symlink_to("a/b.txt")
    mnt.mkdir()
    return src, mnt


@pytest.fixture
def mount(tree):
    """Mount factory; every mount is undone even when the test fails."""
    mounts = []

    def _mount(**options):
        fs = SimFS(*tree, **options)
        mounts.append(fs)
        return fs.mount()

    yield _mount
    for fs in mounts:
        fs.unmount()


def client_script(mnt, code):
    prelude = f"import os, json, time\nM = {str(mnt)!r}\n"
    return prelude + textwrap.dedent(code)


def start_client(mnt, code):
    return subprocess.Popen(
        [sys.executable, "-c", client_script(mnt, code)],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )


def settled_stats(fs, done, timeout=5.0):
    """Stats once ``done(stats)``: the kernel sends release asynchronously."""
    deadline = time.monotonic() + timeout
    while True:
        stats = fs.stats()
        if done(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def finish(process):
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0
    return json.loads(out)


CLIENT_A = """
    os.stat(M + "/a/b.txt")                 # getattr 3
    os.listdir(M + "/a")                    # getattr 2, opendir, readdir, releasedir
    fd = os.open(M + "/a/b.txt", os.O_RDONLY)   # getattr 2, open
    data = os.read(fd, 6)                   # read (within the size: no getattr)
    os.close(fd)                            # release
    print(json.dumps({"pid": os.getpid(), "n": len(data)}))
"""
EXPECTED_A = {
    "getattr": 7,
    "opendir": 1,
    "readdir": 1,
    "releasedir": 1,
    "open": 1,
    "read": 1,
    "release": 1,
}

CLIENT_B = """
    os.stat(M)                              # getattr 1
    os.stat(M)                              # getattr 1
    os.listdir(M)                           # getattr 1, opendir, readdir, releasedir
    os.readlink(M + "/link")                # getattr 1, readlink
    fd = os.open(M + "/blob.bin", os.O_RDONLY)  # getattr 1, open
    data = os.read(fd, 3072)                # read
    os.close(fd)                            # release
    try:
        os.stat(M + "/a/missing")           # getattr 2 (negative lookup)
    except FileNotFoundError:
        pass
    print(json.dumps({"pid": os.getpid(), "n": len(data)}))
"""
EXPECTED_B = {
    "getattr": 7,
    "opendir": 1,
    "readdir": 1,
    "releasedir": 1,
    "readlink": 1,
    "open": 1,
    "read": 1,
    "release": 1,
}


@requires_fuse
def test_exact_counts_per_process(mount):
    fs = mount(latency=0)
    a, b = start_client(fs.mountpoint, CLIENT_A), start_client(fs.mountpoint, CLIENT_B)
    res_a, res_b = finish(a), finish(b)
    stats = settled_stats(
        fs, lambda s: s["ops"].get("release") == 2 and s["ops"].get("releasedir") == 2
    )
    pid_a, pid_b = str(res_a["pid"]), str(res_b["pid"])
    assert pid_a != pid_b
    assert set(stats["per_pid"]) == {pid_a, pid_b}
    assert stats["per_pid"][pid_a]["ops"] == EXPECTED_A
    assert stats["per_pid"][pid_b]["ops"] == EXPECTED_B
    assert stats["per_pid"][pid_a]["bytes"] == len(SMALL) == res_a["n"]
    assert stats["per_pid"][pid_b]["bytes"] == len(BLOB) == res_b["n"]
    assert stats["per_pid"][pid_a]["total"] == sum(EXPECTED_A.values())
    assert stats["total"] == sum(EXPECTED_A.values()) + sum(EXPECTED_B.values())
    assert stats["bytes"] == len(SMALL) + len(BLOB)
    assert stats["ops"]["getattr"] == 14


STAT_LOOP = """
    start = time.time()
    for _ in range({k}):
        os.stat(M + "/f")                   # lookup + getattr: 2 operations
    print(json.dumps({{"pid": os.getpid(), "start": start, "end": time.time()}}))
"""


def timed_clients(fs, count, k):
    procs = [start_client(fs.mountpoint, STAT_LOOP.format(k=k)) for _ in range(count)]
    results = [finish(p) for p in procs]
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    return results, span


@requires_fuse
def test_latency_serializes_clients(mount):
    k, latency = 100, 0.005
    fs = mount(latency=latency)
    _, single = timed_clients(fs, 1, k)
    ops_single = fs.stats()["total"]
    assert ops_single == 2 * k
    assert ops_single * latency * 0.95 <= single < ops_single * latency * 2.5
    fs.reset()
    results, both = timed_clients(fs, 2, k)
    assert max(r["start"] for r in results) < min(r["end"] for r in results)
    ops_both = fs.stats()["total"]
    assert ops_both == 4 * k
    assert both >= 0.8 * ops_both * latency  # = 1.6 * (ops of one client) * latency
    assert both > single
    print(f"single {single:.3f} s, two clients {both:.3f} s")


@requires_fuse
def test_stats_file_is_free_and_live(mount):
    fs = mount(latency=0.005)
    start = time.monotonic()
    for _ in range(20):
        data = json.loads((fs.mountpoint / simfs.STATS_FILE).read_text())
    assert time.monotonic() - start < 20 * 0.005
    assert data["total"] == 0 and data["per_pid"] == {}
    assert data["config"]["latency"] == 0.005
    finish(start_client(fs.mountpoint, 'os.stat(M + "/f"); print(1)'))
    assert fs.stats()["ops"] == {"getattr": 2}
    assert simfs.STATS_FILE not in [p.name for p in fs.mountpoint.iterdir()]
    fs.reset()
    assert fs.stats()["total"] == 0


@requires_fuse
def test_bandwidth_limits_reads(mount):
    fs = mount(latency=0, bandwidth=100_000)
    code = """
        start = time.time()
        with open(M + "/blob.bin", "rb") as f:
            f.read()
        print(json.dumps(time.time() - start))
    """
    assert finish(start_client(fs.mountpoint, code)) >= 0.9 * len(BLOB) / 100_000
    assert fs.stats()["bytes"] == len(BLOB)


@requires_fuse
def test_read_only_and_contents(mount):
    fs = mount(latency=0)
    assert (fs.mountpoint / "a" / "b.txt").read_bytes() == SMALL
    assert (fs.mountpoint / "link").read_bytes() == SMALL
    assert sorted(p.name for p in fs.mountpoint.iterdir()) == [
        "a",
        "blob.bin",
        "f",
        "link",
    ]
    with pytest.raises(OSError):
        (fs.mountpoint / "new.txt").write_text("no")
    with pytest.raises(OSError):
        (fs.mountpoint / "f").write_text("no")


@requires_fuse
def test_missing_mountpoint_is_a_clear_error(tree, capsys):
    src, mnt = tree
    missing = mnt.parent / "nope"
    with pytest.raises(SimFSError, match="mountpoint does not exist: '.*nope'"):
        SimFS(src, missing).mount()
    assert simfs.cli_simfs([str(src), str(missing)]) == 1
    err = capsys.readouterr().err
    assert err == f"mpistage: error: mountpoint does not exist: {str(missing)!r}\n"


@requires_fuse
def test_cli_background_mount_stats_unmount(tree, capsys):
    src, mnt = tree
    try:
        assert simfs.cli_simfs([str(src), str(mnt), "--latency", "0"]) == 0
        assert "mpistage bench unmount" in capsys.readouterr().out
        assert simfs.mount_type(mnt) == simfs.FS_TYPE
        assert (mnt / "f").read_bytes() == b"x"
        assert simfs.cli_stats([str(mnt), "--reset"]) == 0
        assert json.loads(capsys.readouterr().out)["ops"]["open"] == 1
        assert simfs.read_stats(mnt)["total"] == 0
        assert simfs.cli_simfs([str(src), str(mnt)]) == 1
        assert "already mounted" in capsys.readouterr().err
        assert simfs.cli_unmount([str(mnt)]) == 0
        assert simfs.mount_type(mnt) is None
    finally:
        if simfs.mount_type(mnt) is not None:
            simfs.unmount_path(mnt)
        Path(simfs.detached_log_path(mnt)).unlink(missing_ok=True)


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert simfs.cli_unmount([str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        f"mpistage: error: nothing is mounted at {str(tmp_path)!r}\n"
    )
    assert simfs.cli_simfs([str(tmp_path), str(tmp_path), "--latency", "5xs"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mpistage: error: argument --latency: invalid latency: '5xs'")
    assert err.count("\n") == 1
    assert simfs.cli_stats([str(tmp_path)]) == 1
    assert "not a simfs mount" in capsys.readouterr().err


def pretend_fuse(monkeypatch, missing):
    """Make every piece simfs needs look present here, except *missing*."""
    import importlib.util

    from mpistage.bench.simfs import common

    exists, find_spec = os.path.exists, importlib.util.find_spec
    monkeypatch.setattr(
        common.os.path,
        "exists",
        lambda p: missing != "/dev/fuse" if p == "/dev/fuse" else exists(p),
    )
    monkeypatch.setattr(
        common.shutil,
        "which",
        lambda name: None if name == missing else f"/usr/bin/{name}",
    )
    monkeypatch.setattr(
        common,
        "find_library",
        lambda name: None if missing == "libfuse3" else f"lib{name}.so.3",
    )
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == missing else find_spec(name, *a),
    )


@pytest.mark.parametrize(
    ("missing", "reason"),
    [
        (None, None),
        ("/dev/fuse", "FUSE not available: /dev/fuse missing (load the fuse module"),
        ("fusermount3", "fusermount3 not found: install with `apt-get install fuse3`"),
        ("libfuse3", "libfuse3 not found: install with `apt-get install fuse3"),
        ("mfusepy", "mfusepy not installed: pip install 'mpistage[bench]'"),
    ],
)
def test_fuse_available_names_what_is_missing_in_one_line(monkeypatch, missing, reason):
    pretend_fuse(monkeypatch, missing)
    found = simfs.fuse_available()
    if reason is None:
        assert found is None
    else:
        assert found.startswith(reason) and "\n" not in found


@requires_fuse
def test_server_failure_is_reported(tree, monkeypatch):
    fs = SimFS(*tree)
    failing = [sys.executable, "-c", "import sys; sys.exit('fuse: boom')"]
    monkeypatch.setattr(fs, "server_command", lambda: failing)
    with pytest.raises(SimFSError, match="simfs server failed: fuse: boom"):
        fs.mount()
    assert fs.process is None and fs.log_path is None


@requires_fuse
def test_mount_timeout_stops_the_server(tree, monkeypatch):
    fs = SimFS(*tree)
    hanging = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(fs, "server_command", lambda: hanging)
    start = time.monotonic()
    with pytest.raises(SimFSError, match="did not come up .* within 0.5 s"):
        fs.mount(timeout=0.5)
    assert time.monotonic() - start < 10
    assert fs.process is None


@requires_fuse
def test_the_live_reader_reads_a_file_for_three_metadata_operations(mount):
    """A lookup, an open and a getattr: not Python's two more reads past the end."""
    from mpistage.runtime.live.reader import Reader

    fs = mount(latency=0)
    reader = Reader()
    reader.dir_fd(fs.mountpoint)  # the directory's descriptor, held from here
    fs.reset()
    got = [reader.read(str(fs.mountpoint), name) for name in ("blob.bin", "f")]
    stats = settled_stats(fs, lambda s: s["ops"].get("release") == 2)
    assert [data for data, _mode, _mtime in got] == [BLOB, b"x"]
    assert stats["ops"] == {"getattr": 4, "open": 2, "read": 2, "release": 2}
