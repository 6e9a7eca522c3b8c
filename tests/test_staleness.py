"""Staleness: a bundle that no longer matches its originals is refused.

Rank 0 checks the originals before the broadcast; a stale bundle ends the
job on every rank with one error line, ``--trust`` skips the check,
``--validate=strict`` also compares checksums, and ``--auto`` rebuilds a
stale cached bundle instead of failing. The default check compares files no
installed distribution owns one by one, and installed distributions by
their ``RECORD`` and directories.
"""

import os
import shutil

import pytest

from recordtools import need_report, recorded, replay
from stagetools import (
    job_dirs,
    make_site,
    mpirun_status,
    mpistage,
    results,
    write_target,
)

pytestmark = pytest.mark.usefixtures("reap_mpich_shm")

RANKS = 4

APP = """
import tinypkg, tinypkg.sub
print(tinypkg.sub.TEXT)
emit({"text": tinypkg.sub.TEXT, "file": tinypkg.sub.__file__})
"""


@pytest.fixture
def setup(tmp_path, stage_env):
    """A site with tinypkg (no distribution owns it), an app, a recorded bundle."""
    site = make_site(tmp_path / "site")
    shutil.rmtree(site / "tinypkg-1.0.dist-info")
    (tmp_path / "app").mkdir()
    script = write_target(tmp_path / "app" / "app.py", APP)
    env = dict(stage_env, PYTHONPATH=str(site))
    out = tmp_path / "record-out"
    out.mkdir()
    path = tmp_path / "app.mpistage"
    recorded(path, script, dict(env, MPISTAGE_TEST_OUT=str(out)), cwd=tmp_path)
    return {"site": site, "script": script, "env": env, "bundle": path}


def run_bundle(setup, *options):
    env = dict(setup["env"], MPISTAGE_EMULATE_NODES="2")
    args = ["-m", "mpistage", "--bundle", setup["bundle"], *options, setup["script"]]
    return mpirun_status(RANKS, args, env)


def later(path, seconds=10):
    """Move *path*'s mtime forward, leaving its content alone."""
    st = path.stat()
    ns = st.st_mtime_ns + seconds * 10**9
    os.utime(path, ns=(ns, ns))


def expect_stale(result, status, path):
    assert result.returncode == 1, result
    assert status == {r: 1 for r in range(RANKS)}, result
    errors = result.errors()
    assert len(errors) == 1, result
    assert repr(str(path)) in errors[0] and "stale" in errors[0], errors
    assert "Traceback" not in result.stderr, result


def test_touched_member_fails_every_rank(setup, stage_env, stage_dir):
    member = setup["site"] / "tinypkg" / "data.py"
    later(member)
    result, status = run_bundle(setup)
    expect_stale(result, status, member)
    assert "--trust" in result.errors()[0]
    assert not list((stage_dir.parent / "out").iterdir()), "the target ran"
    assert job_dirs(stage_dir) == []


def test_trust_uses_a_stale_bundle(setup, stage_env, stage_dir):
    member = setup["site"] / "tinypkg" / "data.py"
    member.write_text("TEXT = 'changed after recording'\n")
    later(member)
    result, status = run_bundle(setup, "--trust")
    assert result.returncode == 0, result
    assert status == {r: 0 for r in range(RANKS)}, result
    for res in results(stage_env, RANKS):
        assert res["text"] == "tiny data"  # the bundled copy, as trusted
        assert res["file"] == str(setup["site"] / "tinypkg" / "sub" / "__init__.py")


def test_strict_catches_a_change_that_keeps_size_and_mtime(setup, stage_env):
    member = setup["site"] / "tinypkg" / "data.py"
    st = member.stat()
    text = member.read_text()
    changed = text.replace("tiny data", "TINY DATA")
    assert len(changed) == len(text) and changed != text
    member.write_text(changed)
    os.utime(member, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert member.stat().st_size == st.st_size

    result, status = run_bundle(setup)  # default: size and mtime only
    assert result.returncode == 0, result
    assert status == {r: 0 for r in range(RANKS)}, result
    result, status = run_bundle(setup, "--validate=strict")
    expect_stale(result, status, member)
    result, status = run_bundle(setup, "--validate", "strict")
    expect_stale(result, status, member)


def test_new_module_in_a_root_is_found_where_it_is(setup, stage_env):
    site = setup["site"]
    (site / "newmod.py").write_text("NEW = 'found'\n")  # after the bundle was made
    app = write_target(
        setup["script"].parent / "new.py",
        "import tinypkg, newmod\nemit([newmod.NEW, newmod.__file__])\n",
    )
    env = dict(setup["env"], MPISTAGE_EMULATE_NODES="2")
    args = ["-m", "mpistage", "--bundle", setup["bundle"], app]
    result, status = mpirun_status(RANKS, args, env)
    assert result.returncode == 0, result  # not stale: rank 0 sent a fresh listing
    for res in results(stage_env, RANKS):
        assert res == ["found", str(site / "newmod.py")]


def test_installed_distribution_is_checked_by_its_record(tmp_path, stage_env):
    site = make_site(tmp_path / "site")  # tinypkg-1.0.dist-info owns tinypkg
    bundle = tmp_path / "owned.mpistage"
    env = dict(stage_env, PYTHONPATH=str(site), MPISTAGE_EMULATE_NODES="2")
    assert mpistage(["pack", "-o", bundle, "tinypkg"], env).returncode == 0
    args = ["-m", "mpistage", "--bundle", bundle, "-c", "import tinypkg"]
    later(site / "tinypkg" / "data.py")  # an edit in place: pip never does this
    result, status = mpirun_status(2, args, env)
    assert result.returncode == 0, result  # the default does not look at it
    result, status = mpirun_status(2, args[:2] + ["--validate=files"] + args[2:], env)
    assert result.returncode == 1 and "data.py" in result.errors()[0], result
    record = site / "tinypkg-1.0.dist-info" / "RECORD"
    record.write_text(record.read_text())  # a reinstall rewrites RECORD
    result, status = mpirun_status(2, args, env)
    assert result.returncode == 1, result
    assert (
        "tinypkg-1.0.dist-info" in result.errors()[0] and "stale" in result.errors()[0]
    )


def test_auto_rebuilds_a_stale_cached_bundle(tmp_path, stage_env):
    site = make_site(tmp_path / "site")
    shutil.rmtree(site / "tinypkg-1.0.dist-info")  # the user's own tree
    (tmp_path / "app").mkdir()
    script = write_target(tmp_path / "app" / "app.py", APP)
    env = dict(stage_env, PYTHONPATH=str(site))
    cache = tmp_path / "cache"
    options = ["--auto", "--cache-dir", cache]

    def auto():
        result, facts = replay(2, options, script, env, tmp_path / "r.json")
        return need_report(result, facts)

    assert auto()["auto"].startswith("recorded")
    (cached,) = cache.glob("*.mpistage")
    assert auto()["auto"] == "replayed"
    first = cached.stat().st_mtime_ns

    later(site / "tinypkg" / "data.py")
    facts = auto()
    assert facts["auto"].startswith("recorded (") and "stale" in facts["auto"], facts
    assert str(site / "tinypkg" / "data.py") in facts["auto"]
    assert facts["modules"]["served"] == 0  # this run was not staged
    assert [p.name for p in cache.glob("*.mpistage")] == [cached.name]
    assert cached.stat().st_mtime_ns != first, "the bundle was not rewritten"
    facts = auto()
    assert facts["auto"] == "replayed", facts
    assert facts["modules"]["served"] > 0 and facts["modules"]["missed"] == 0


@pytest.mark.parametrize("option", ["--validate=bogus", "--validate="])
def test_bad_validate_mode(tmp_path, stage_env, option):
    script = write_target(tmp_path / "app.py", "print('ran')\n")
    result = mpistage([option, script], env=stage_env, cwd=tmp_path)
    assert result.returncode == 1, result
    assert result.stderr.startswith("mpistage: error: --validate"), result
    assert len(result.errors()) == 1
    assert "ran" not in result.stdout
