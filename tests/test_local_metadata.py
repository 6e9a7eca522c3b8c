"""Replayed jobs leave the shared file system alone (simulated with simfs).

A site directory (the generated workload and a tiny distribution
``probe_dist``) is served by simfs with no latency and the kernel caches
off, so every metadata operation of every process is counted. The program
puts the mounted site on ``sys.path`` itself, so interpreter start-up does
not touch the mount, records once, and is replayed at 4 ranks on 2 emulated
nodes. Metadata lookups (``importlib.metadata``), resources, absent modules
and late submodule imports must then be answered from the staged copy.
"""

import compileall
import json
import time

import pytest

from mpistage.bench import simfs
from mpistage.bench.simfs import SimFS
from mpistage.runtime.read import read_manifest
from recordtools import WORKLOAD, below, make_workload, need_report, replay
from recordtools import recorded as record_ok
from stagetools import PYTHON, clean_environ, results, run, write_target

FUSE_REASON = simfs.fuse_available()
pytestmark = [
    pytest.mark.skipif(FUSE_REASON is not None, reason=str(FUSE_REASON)),
    pytest.mark.usefixtures("reap_mpich_shm"),
]
RANKS = 4

APP = """
import os, sys
SITE, MOUNT = {site!r}, {mount!r}
sys.path.insert(0, SITE)
import importlib.metadata, importlib.resources
from mpi4py import MPI
import {ws}.driver, probepkg

comm = MPI.COMM_WORLD
summary = {ws}.driver.main()
comm.Barrier()
if comm.rank == 0 and not os.environ.get("APP_WHOLE_RUN"):
    open(os.path.join(MOUNT, ".simfs-reset")).close()  # counts from here on
comm.Barrier()
res = {{"summary": summary}}
res["version"] = importlib.metadata.version("probe_dist")
eps = importlib.metadata.entry_points(group="mpistage_test_group")
res["eps"] = sorted((e.name, e.value) for e in eps)
res["hello"] = [e.load()() for e in eps]
res["data"] = importlib.resources.files("probepkg").joinpath("data.txt").read_text()
try:
    import surely_absent_module
    res["absent"] = False
except ImportError:
    res["absent"] = True
import {ws}.late_probe
comm.Barrier()
res["late"] = where({ws}.late_probe)
res["files"] = [where(probepkg), where({ws}.driver)]
res["pid"] = os.getpid()
res["rank"] = comm.rank
emit(res)
"""


def add_probe_dist(site):
    """Add ``probepkg`` and its distribution ``probe_dist`` 1.0 to *site*."""
    pkg = site / "probepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("def hello():\n    return 'hello from probe'\n")
    (pkg / "data.txt").write_text("probe data\n")
    info = site / "probe_dist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: probe_dist\nVersion: 1.0\n"
    )
    (info / "top_level.txt").write_text("probepkg\n")
    (info / "entry_points.txt").write_text(
        "[mpistage_test_group]\nhello = probepkg:hello\n"
    )
    files = ["probepkg/__init__.py", "probepkg/data.txt"] + [
        f"probe_dist-1.0.dist-info/{n}"
        for n in ("METADATA", "RECORD", "top_level.txt", "entry_points.txt")
    ]
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    compileall.compile_dir(str(pkg), quiet=2)


@pytest.fixture(scope="module")
def mounted(tmp_path_factory):
    """The mounted site, the app outside it, and its bundle on the mount."""
    base = tmp_path_factory.mktemp("simfs")
    src, mnt = base / "src", base / "mnt"
    site = make_workload(src / "site")
    (site / WORKLOAD / "late_probe.py").write_text("LATE = 1\n")
    compileall.compile_file(str(site / WORKLOAD / "late_probe.py"), quiet=2)
    add_probe_dist(site)
    mnt.mkdir()
    (base / "app").mkdir()
    app = write_target(
        base / "app" / "app.py",
        APP.format(site=str(mnt / "site"), mount=str(mnt), ws=WORKLOAD),
    )
    out = base / "record-out"
    out.mkdir()
    env = dict(clean_environ(), MPISTAGE_TEST_OUT=str(out))
    with SimFS(src, mnt, latency=0, cache=False) as fs:
        # the bundle lies on the shared file system too, next to the site
        record_ok(src / "app.mpistage", app, env, cwd=base)
        assert fs.stats()["total"] > 0, "simfs counted nothing"
        (expected,) = [json.loads(p.read_text()) for p in out.iterdir()]
        yield {
            "fs": fs,
            "app": app,
            "site": mnt / "site",
            "bundle": mnt / "app.mpistage",
            "expected": expected,
        }


def settled(fs, pids, timeout=3.0):
    """Stats once the asynchronous releases of *pids* have come in."""
    deadline = time.monotonic() + timeout
    while True:
        stats = fs.stats()
        per_pid = stats["per_pid"]
        opened = sum(
            per_pid.get(p, {}).get("ops", {}).get(op, 0)
            for p in pids
            for op in ("open", "opendir")
        )
        closed = sum(
            per_pid.get(p, {}).get("ops", {}).get(op, 0)
            for p in pids
            for op in ("release", "releasedir")
        )
        if closed >= opened or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def ops_of(stats, pid):
    return stats["per_pid"].get(str(pid), {"ops": {}, "total": 0, "bytes": 0})


def check_results(res, expected, stage_dir):
    for key in ("summary", "version", "eps", "hello", "data", "absent"):
        assert res[key] == expected[key], (key, res[key], expected[key])
    assert res["summary"]["ok"] is True
    assert res["version"] == "1.0"
    assert res["eps"] == [["hello", "probepkg:hello"]]
    assert res["data"] == "probe data\n" and res["absent"] is True
    assert below(res["late"], stage_dir), res
    assert all(below(f, stage_dir) for f in res["files"]), res


def test_probes_cost_no_shared_operations(mounted, tmp_path, stage_env, stage_dir):
    fs = mounted["fs"]
    # control: without mpistage the same probes go to the shared file system
    control_out = tmp_path / "control"
    control_out.mkdir()
    env = dict(stage_env, MPISTAGE_TEST_OUT=str(control_out))
    result = run([PYTHON, mounted["app"]], env=env, cwd=tmp_path)
    assert result.returncode == 0, result
    control = json.loads((control_out / "plain.json").read_text())
    assert control["late"].startswith(str(mounted["site"]))
    stats = settled(fs, [str(control["pid"])])
    assert ops_of(stats, control["pid"])["total"] > 0, stats

    result, facts = replay(
        RANKS,
        ["--bundle", mounted["bundle"]],
        mounted["app"],
        stage_env,
        tmp_path / "r.json",
    )
    facts = need_report(result, facts)
    assert facts["modules"]["missed"] == 0, facts
    ranks = results(stage_env, RANKS)
    pids = [str(r["pid"]) for r in ranks]
    stats = settled(fs, pids)
    for res in ranks:
        check_results(res, mounted["expected"], stage_dir)
        assert ops_of(stats, res["pid"])["total"] == 0, (res["rank"], stats)
    assert stats["total"] == 0, stats


def whole_run(mounted, tmp_path, stage_env, options):
    """Replay with the counters reset before the launch; return the stats."""
    fs = mounted["fs"]
    fs.reset()
    env = dict(stage_env, APP_WHOLE_RUN="1")
    result, facts = replay(
        RANKS,
        ["--bundle", mounted["bundle"], *options],
        mounted["app"],
        env,
        tmp_path / "r.json",
    )
    need_report(result, facts)
    ranks = results(stage_env, RANKS)
    return ranks, settled(fs, [str(r["pid"]) for r in ranks])


def test_whole_replay_spares_the_shared_fs(mounted, tmp_path, stage_env, stage_dir):
    ranks, stats = whole_run(mounted, tmp_path, stage_env, [])
    for res in ranks:
        check_results(res, mounted["expected"], stage_dir)
        if res["rank"]:
            assert ops_of(stats, res["pid"])["total"] == 0, (res["rank"], stats)
    zero = ops_of(stats, ranks[0]["pid"])
    size = (mounted["site"].parent / "app.mpistage").stat().st_size
    assert zero["bytes"] == size, zero  # rank 0 read the bundle, once
    assert zero["ops"].get("open") == 1, zero  # and opened no other file
    # the staleness check costs O(distributions + directories), not O(files):
    # one directory read, the RECORD, and a lookup plus a getattr per directory
    manifest = read_manifest(mounted["bundle"])
    index = [r["path"] for r in manifest["roots"]].index(str(mounted["site"]))
    mine = [m for m in manifest["members"] if m["root"] == index]
    dirs = sum(1 for m in mine if m["type"] == "dir" and "__pycache__" not in m["rel"])
    meta = zero["total"] - zero["ops"].get("read", 0)
    assert meta <= 2 * dirs + 30 < len(mine), (dirs, len(mine), zero)


def test_trusted_replay_reads_only_the_bundle(mounted, tmp_path, stage_env, stage_dir):
    ranks, stats = whole_run(mounted, tmp_path, stage_env, ["--trust"])
    for res in ranks:
        check_results(res, mounted["expected"], stage_dir)
        if res["rank"]:
            assert ops_of(stats, res["pid"])["total"] == 0, (res["rank"], stats)
    zero = ops_of(stats, ranks[0]["pid"])
    size = (mounted["site"].parent / "app.mpistage").stat().st_size
    assert zero["bytes"] == size, zero
    assert set(zero["ops"]) <= {"getattr", "open", "read", "release"}, zero
    assert zero["ops"]["open"] == 1 and zero["ops"].get("release") == 1, zero
    assert zero["ops"]["getattr"] <= 5, zero  # a handful: path lookup, fstat
