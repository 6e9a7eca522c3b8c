"""``--auto``: the first run records a bundle into the cache, later runs replay it."""

import json
import os
import signal
import subprocess
import time

import pytest

from mpistage.runtime.read import read_manifest
from recordtools import below, need_report, replay
from stagetools import (
    MPIEXEC,
    PYTHON,
    TIMEOUT,
    flip_byte,
    install_record,
    make_site,
    mpistage,
    results,
    write_target,
)

pytestmark = pytest.mark.usefixtures("reap_mpich_shm")

APP = """
import tinypkg, tinypkg.sub
from mpi4py import MPI
print(tinypkg.sub.TEXT)
emit({"rank": MPI.COMM_WORLD.rank, "file": where(tinypkg.sub),
      "text": tinypkg.sub.TEXT})
"""


@pytest.fixture
def app(tmp_path, stage_env):
    site = make_site(tmp_path / "site")
    (tmp_path / "app").mkdir()
    script = write_target(tmp_path / "app" / "app.py", APP)
    return script, dict(stage_env, PYTHONPATH=str(site))


def bundles(folder):
    return sorted(folder.glob("*.mpistage"))


def temporaries(folder):
    return sorted(folder.glob(".mpistage-*"))


def test_first_run_records_then_replays(tmp_path, stage_env, stage_dir, app):
    script, env = app
    cache = tmp_path / "cache"
    options = ["--auto", "--cache-dir", cache, "--report"]
    result, facts = replay(4, options, script, env, tmp_path / "r.json")
    facts = need_report(result, facts)
    assert facts["auto"].startswith("recorded"), facts
    assert facts["modules"]["served"] == 0 and facts["stage_roots"] == []
    assert result.stdout == ["tiny data\n"] * 4, result
    assert "--auto: recorded" in result.stderr
    (cached,) = bundles(cache)
    assert cached.name.startswith("app-")
    assert temporaries(cache) == []
    assert cache.stat().st_mode & 0o077 == 0
    manifest = read_manifest(cached)
    assert manifest["created_by"] == "auto"
    assert "tinypkg" in manifest["packages"]
    assert facts["bundle"] == str(cached)

    for path in (tmp_path / "out").iterdir():
        path.unlink()
    result, facts = replay(4, options, script, env, tmp_path / "r.json")
    facts = need_report(result, facts)
    assert facts["auto"] == "replayed", facts
    assert facts["modules"]["served"] > 0, facts
    assert facts["modules"]["missed"] == 0, facts
    assert facts["bundle_bytes"] == cached.stat().st_size
    assert facts["seconds"]["read"] > 0, facts  # the cached bundle was read
    assert result.stdout == ["tiny data\n"] * 4, result
    for res in results(stage_env, 4):
        assert below(res["file"], stage_dir), res
    assert bundles(cache) == [cached]

    other = write_target(tmp_path / "app" / "other.py", APP)
    result, facts = replay(2, options, other, env, tmp_path / "r.json")
    assert need_report(result, facts)["auto"].startswith("recorded")
    names = [p.name for p in bundles(cache)]
    assert len(names) == 2 and cached.name in names, names
    assert any(n.startswith("other-") for n in names), names


# Rank 0 of each job waits for the other job's target to start, so both
# jobs found no cached bundle, both record, and both write the same key.
RENDEZVOUS_APP = (
    APP
    + """
import os, time
meet = os.environ.get("RENDEZVOUS")
if meet and MPI.COMM_WORLD.rank == 0:
    open(os.path.join(meet, os.environ["JOB"]), "w").close()
    deadline = time.monotonic() + 30
    while len(os.listdir(meet)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
MPI.COMM_WORLD.Barrier()
"""
)


def launch(ranks, args, env):
    """Start ``mpiexec -n RANKS python ARGS`` in its own session."""
    return subprocess.Popen(
        [str(a) for a in [MPIEXEC, "-n", ranks, PYTHON, *args]],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc, deadline):
    """Wait for *proc* until *deadline*; kill its process group after."""
    try:
        out, err = proc.communicate(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out: {proc.args!r}\n{out}\n{err}")
    return proc.returncode, out, err


def test_concurrent_jobs_share_one_cache(tmp_path, stage_env, app):
    if MPIEXEC is None:
        pytest.skip("no mpiexec next to this Python nor on PATH")
    _, env = app
    script = write_target(tmp_path / "app" / "meet.py", RENDEZVOUS_APP)
    meet = tmp_path / "meet"
    meet.mkdir()
    cache = tmp_path / "cache"
    jobs = []
    for job in ("a", "b"):
        out = tmp_path / f"out-{job}"
        out.mkdir()
        jenv = dict(
            env,
            MPISTAGE_TEST_OUT=str(out),
            MPISTAGE_EMULATE_NODES="2",
            MPISTAGE_REPORT=str(tmp_path / f"report-{job}.json"),
            RENDEZVOUS=str(meet),
            JOB=job,
        )
        args = ["-m", "mpistage", "--auto", "--cache-dir", cache, script]
        jobs.append(launch(2, args, jenv))
    deadline = time.monotonic() + TIMEOUT
    try:
        done = [finish(proc, deadline) for proc in jobs]
    finally:
        for proc in jobs:  # and any rank that outlived its mpiexec
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for code, out, err in done:
        assert code == 0, (out, err)
    for job in ("a", "b"):
        facts = json.loads((tmp_path / f"report-{job}.json").read_text())
        assert facts["auto"] == "recorded (no cached bundle)", facts
        ranks = results(dict(env, MPISTAGE_TEST_OUT=str(tmp_path / f"out-{job}")), 2)
        assert [r["text"] for r in ranks] == ["tiny data"] * 2
    (cached,) = bundles(cache)
    assert temporaries(cache) == []
    result = mpistage(["inspect", cached], env=env)
    assert result.returncode == 0 and "made by: mpistage auto" in result.stdout

    result, facts = replay(
        2, ["--auto", "--cache-dir", cache], script, env, tmp_path / "r.json"
    )
    facts = need_report(result, facts)
    assert facts["auto"] == "replayed", facts
    assert facts["modules"]["missed"] == 0 and facts["modules"]["served"] > 0
    assert bundles(cache) == [cached]


def test_auto_and_bundle_exclude_each_other(tmp_path, stage_env):
    script = write_target(tmp_path / "app.py", "print('ran')\n")
    for args in (
        ["--auto", "--bundle", tmp_path / "x.mpistage", script],
        ["--bundle=" + str(tmp_path / "x.mpistage"), "--auto", script],
    ):
        result = mpistage(args, env=stage_env, cwd=tmp_path)
        assert result.returncode == 2, result  # a usage error (docs/api.md)
        errors = result.errors()
        assert len(errors) == 1 and "--auto and --bundle" in errors[0], result
        assert "ran" not in result.stdout
    assert not list(tmp_path.glob("*.mpistage"))


def test_auto_ignores_mpistage_bundle_variable(tmp_path, stage_env, app):
    """``MPISTAGE_BUNDLE`` names a bundle for plain runs; --auto uses its cache."""
    script, env = app
    env = dict(env, MPISTAGE_BUNDLE=str(tmp_path / "absent.mpistage"))
    cache = tmp_path / "cache"
    result, facts = replay(
        2, ["--auto", "--cache-dir", cache], script, env, tmp_path / "r.json"
    )
    assert need_report(result, facts)["auto"].startswith("recorded"), facts
    assert len(bundles(cache)) == 1


@pytest.fixture
def read_only(tmp_path):
    """Make a directory read-only for root too: a read-only bind mount of it."""
    mounted = []

    def make(folder):
        if os.geteuid() != 0:
            pytest.skip("a read-only bind mount needs root")
        for args in (["--bind", folder, folder], ["-o", "remount,bind,ro", folder]):
            subprocess.run(["mount", *map(str, args)], check=True)
        mounted.append(folder)

    yield make
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_read_only_cache_with_a_fresh_bundle_is_replayed(
    tmp_path, stage_env, stage_dir, app, read_only
):
    script, env = app
    cache = tmp_path / "cache"
    options = ["--auto", "--cache-dir", cache, "--report"]
    result, facts = replay(2, options, script, env, tmp_path / "r.json")
    assert need_report(result, facts)["auto"].startswith("recorded"), result
    (cached,) = bundles(cache)
    read_only(cache)
    assert not os.access(cache, os.W_OK)

    result, facts = replay(2, options, script, env, tmp_path / "r.json")
    facts = need_report(result, facts)
    assert facts["auto"] == "replayed", facts
    assert facts["modules"]["served"] > 0, facts
    for res in results(stage_env, 2):
        assert below(res["file"], stage_dir), res

    # another target has no bundle there: learning it would need a write
    other = write_target(tmp_path / "app" / "other.py", APP)
    result, facts = replay(2, options, other, env, tmp_path / "r.json")
    assert result.returncode != 0 and facts is None
    assert "cannot write the --auto cache" in result.stderr
    assert bundles(cache) == [cached]


def test_a_cached_bundle_corrupt_in_its_bytes_is_learned_again(
    tmp_path, stage_env, stage_dir, app
):
    """Its manifest is intact: the corrupt member shows while the bytes pass,
    and the run records instead, as for a bundle it could not use."""
    script, env = app
    cache = tmp_path / "cache"
    options = ["--auto", "--cache-dir", cache, "--report"]
    result, facts = replay(2, options, script, env, tmp_path / "r.json")
    assert need_report(result, facts)["auto"].startswith("recorded"), result
    (cached,) = bundles(cache)
    last = [m for m in read_manifest(cached)["members"] if m["type"] == "file"][-1]
    flip_byte(cached, cached, last["offset"] + last["size"] - 1)

    result, facts = replay(2, options, script, env, tmp_path / "r.json")
    facts = need_report(result, facts)
    assert facts["auto"].startswith("recorded ("), facts
    assert f"checksum mismatch in {last['rel']!r}" in facts["auto"], facts
    assert result.stdout == ["tiny data\n"] * 2, result
    result, facts = replay(2, options, script, env, tmp_path / "r.json")
    assert need_report(result, facts)["auto"] == "replayed", facts


# -- what a replay needs, and what it must not have (issue #25, item 3) ------------

CHECKED_APP = """
import checkpkg
from mpi4py import MPI
emit({"rank": MPI.COMM_WORLD.rank, "file": where(checkpkg), "tool": checkpkg.TOOL})
"""

CHECKING_PKG = """
import os
TOOL = os.path.join(os.path.dirname(__file__), "bin", "tool")
if not os.path.exists(TOOL):  # torch checks torch/bin/torch_shm_manager so
    raise ImportError(f"no {TOOL}")
"""


def test_a_file_only_checked_is_replayed(tmp_path, stage_env, stage_dir):
    """A package that refuses to import without a file it never opens."""
    site = tmp_path / "site"
    (site / "checkpkg" / "bin").mkdir(parents=True)
    (site / "checkpkg" / "__init__.py").write_text(CHECKING_PKG)
    (site / "checkpkg" / "bin" / "tool").write_text("#!/bin/sh\n")
    (site / "checkpkg" / "bin" / "unused").write_text("not checked\n")
    install_record(site, "checkpkg", "1.0")  # installed, owned by a distribution
    (tmp_path / "app").mkdir()
    script = write_target(tmp_path / "app" / "app.py", CHECKED_APP)
    env = dict(stage_env, PYTHONPATH=str(site))
    options = ["--auto", "--cache-dir", tmp_path / "cache"]
    for verdict in ("recorded", "replayed"):
        result, facts = replay(2, options, script, env, tmp_path / "r.json")
        assert need_report(result, facts)["auto"].startswith(verdict), facts
    (cached,) = bundles(tmp_path / "cache")
    rels = {m["rel"] for m in read_manifest(cached)["members"]}
    assert "checkpkg/bin/tool" in rels and "checkpkg/bin/unused" not in rels
    for res in results(stage_env, 2):
        # read from the copy; the file beside it is found where plain python
        # finds it (the copy's directory lacks bin/unused)
        assert below(res["file"], stage_dir), res
        assert res["tool"] == str(site / "checkpkg" / "bin" / "tool"), res


WRITING_APP = """
import importlib, os, sys, tempfile
from mpi4py import MPI
import tinypkg
comm = MPI.COMM_WORLD
folder = tempfile.mkdtemp(dir=os.environ["SCRATCH"]) if comm.rank == 0 else None
folder = comm.bcast(folder)
if comm.rank == 0:
    with open(os.path.join(folder, "made_here.py"), "w") as f:
        f.write("WHO = 'generated'\\n")
comm.Barrier()
sys.path.insert(0, folder)
import made_here
with open(os.path.join(os.path.dirname(__file__), "out.txt"), "w") as f:
    f.write("output beside the script")
emit({"rank": comm.rank, "who": made_here.WHO, "file": where(tinypkg)})
"""


def test_what_the_program_wrote_is_no_root(tmp_path, stage_env, stage_dir, app):
    """Modules the program writes and imports (autograph's in /tmp) are not learned."""
    _, env = app
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (tmp_path / "app" / "helper.py").write_text("HELP = 1\n")
    script = write_target(tmp_path / "app" / "writer.py", WRITING_APP)
    env = dict(env, SCRATCH=str(scratch))
    options = ["--auto", "--cache-dir", tmp_path / "cache", "--report"]
    result, facts = replay(2, options, script, env, tmp_path / "r.json")
    assert need_report(result, facts)["auto"].startswith("recorded"), facts
    (cached,) = bundles(tmp_path / "cache")
    manifest = read_manifest(cached)
    paths = [r["path"] for r in manifest["roots"]]
    assert not any(p.startswith(str(scratch)) for p in paths), paths
    assert str(tmp_path / "app") in paths  # the script's own directory stays one
    rels = {m["rel"] for m in manifest["members"]}
    assert "out.txt" not in rels and "made_here.py" not in rels, rels

    for _ in range(2):  # replayed, again and again: never stale
        result, facts = replay(2, options, script, env, tmp_path / "r.json")
        assert need_report(result, facts)["auto"] == "replayed", result
        ranks = results(env, 2)
        assert [r["who"] for r in ranks] == ["generated"] * 2
        assert all(below(r["file"], stage_dir) for r in ranks), ranks
    assert bundles(tmp_path / "cache") == [cached]
