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
import sysconfig

import pytest

from recordtools import need_report, recorded, replay
from stagetools import (
    PYTHON,
    job_dirs,
    make_site,
    mpirun_status,
    mpistage,
    results,
    run,
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


def poison_bytecode(source, text):
    """Write bytecode for *source* that plain python takes, with other code in it."""
    import importlib.util
    from importlib._bootstrap_external import _code_to_timestamp_pyc

    st = source.stat()
    code = compile(f"TEXT = {text!r}\n", str(source), "exec")
    cached = importlib.util.cache_from_source(str(source))
    data = _code_to_timestamp_pyc(code, int(st.st_mtime), st.st_size)
    with open(cached, "wb") as f:
        f.write(data)


def test_a_plain_run_leaves_a_packed_bundle_fresh(tmp_path, stage_env):
    """``pack``, then any plain run writes ``__pycache__``: the bundle is still fresh.

    Bytecode in the original is never what a staged module runs: here the
    original's is planted (plain python would take it), and every rank
    still gets the packed source's code.
    """
    site = make_site(tmp_path / "site")
    env = dict(stage_env, PYTHONPATH=str(site))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    bundle = tmp_path / "tiny.mpistage"
    result = mpistage(["pack", "-o", bundle, "tinypkg"], env)
    assert result.returncode == 0, result
    assert not list(site.rglob("__pycache__"))
    plain = run([PYTHON, "-c", "import tinypkg.sub; print(tinypkg.sub.TEXT)"], env=env)
    assert plain.returncode == 0 and "tiny data" in plain.stdout, plain
    assert (site / "tinypkg" / "sub" / "__pycache__").is_dir()
    poison_bytecode(site / "tinypkg" / "data.py", "planted bytecode")
    plain = run([PYTHON, "-c", "import tinypkg.sub; print(tinypkg.sub.TEXT)"], env=env)
    assert "planted bytecode" in plain.stdout, plain  # plain python takes it
    script = write_target(tmp_path / "app.py", APP)
    env = dict(env, MPISTAGE_EMULATE_NODES="2")
    args = ["-m", "mpistage", "--bundle", bundle, script]
    result, status = mpirun_status(RANKS, args, env)
    assert result.returncode == 0, result
    assert status == {r: 0 for r in range(RANKS)}, result
    assert [r["text"] for r in results(env, RANKS)] == ["tiny data"] * RANKS


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
    assert result.returncode == 2, result  # a usage error (docs/api.md)
    assert result.stderr.startswith("mpistage: error: --validate"), result
    assert len(result.errors()) == 1
    assert "ran" not in result.stdout


# -- what the default check catches -------------------------------------------------


def owned_site(site):
    """A site with ``sixish.py``, a single-file module a distribution owns."""
    site.mkdir()
    (site / "sixish.py").write_text("WHO = 'original'\n")
    info = site / "sixish-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: sixish\nVersion: 1.0\n"
    )
    rows = ["sixish.py,,", f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(rows) + "\n")
    return site


def rename_replace(path, text, keep_stat=True):
    """Replace *path* as ``sed -i`` does: a new file renamed over it.

    With *keep_stat*, the new file has the old size and mtime: only its
    inode tells.
    """
    st = path.stat()
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    if keep_stat:
        assert tmp.stat().st_size == st.st_size
        os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, path)


SIX_APP = "import sixish\nemit(sixish.WHO)\n"


@pytest.fixture
def six(tmp_path, stage_env):
    site = owned_site(tmp_path / "site")
    env = dict(stage_env, PYTHONPATH=str(site))
    bundle = tmp_path / "six.mpistage"
    assert mpistage(["pack", "-o", bundle, "sixish"], env).returncode == 0
    script = write_target(tmp_path / "app.py", SIX_APP)
    return {"site": site, "env": env, "bundle": bundle, "script": script}


def run_six(six):
    args = ["-m", "mpistage", "--bundle", six["bundle"], six["script"]]
    return mpirun_status(RANKS, args, dict(six["env"], MPISTAGE_EMULATE_NODES="2"))


def test_a_top_level_module_replaced_by_rename_is_stale(six):
    result, status = run_six(six)
    assert result.returncode == 0, result
    rename_replace(six["site"] / "sixish.py", "WHO = 'replaced'\n")
    expect_stale(*run_six(six), six["site"] / "sixish.py")


def test_a_pth_added_to_a_bundled_root_is_stale(six):
    (six["site"] / "extra.pth").write_text("/nonexistent-dir\n")
    expect_stale(*run_six(six), six["site"] / "extra.pth")


def test_a_replaced_root_is_stale(setup):
    site = setup["site"]  # the user's own tree: no distribution owns it
    result, status = run_bundle(setup)
    assert result.returncode == 0, result
    os.rename(site, site.with_name("site.old"))
    shutil.copytree(site.with_name("site.old"), site)  # same names, sizes, mtimes
    expect_stale(*run_bundle(setup), site)


# -- the staleness table of docs/usage.md, cell by cell ------------------------------

EXT = sysconfig.get_config_var("EXT_SUFFIX")


def table_setup(tmp_path, monkeypatch):
    """Pack an installed distribution (a package, a module) and the user's tree.

    Returns the site, the user's tree and the manifest.
    """
    import mpistage

    site, own = tmp_path / "site", tmp_path / "own"
    (site / "tabpkg").mkdir(parents=True)
    own.mkdir()
    (site / "tabpkg" / "__init__.py").write_text("A = 1\n")
    (site / "tabpkg" / "mod.py").write_text("B = 2\n")
    (site / "tabpkg" / "table.dat").write_text("1 2 3\n")
    (site / "tabpkg" / f"_native{EXT}").write_bytes(b"\x7fELF not really")
    (site / "tabmod.py").write_text("C = 3\n")
    info = site / "tabpkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tabpkg\nVersion: 1\n")
    rows = [f"{p.relative_to(site)},," for p in sorted(site.rglob("*")) if p.is_file()]
    (info / "RECORD").write_text("\n".join([*rows, f"{info.name}/RECORD,,"]) + "\n")
    (own / "mine.py").write_text("D = 4\n")
    monkeypatch.syspath_prepend(str(site))
    out = str(tmp_path / "t.mpistage")
    manifest = mpistage.pack(out, ["tabpkg", "tabmod"], paths=[str(own)])
    return site, own, manifest


def in_place(path, text=None, keep_stat=False):
    """Edit *path* in place (same inode); a new mtime unless *keep_stat*."""
    st = path.stat()
    data = path.read_bytes()
    new = text.encode() if text is not None else bytes(reversed(data))
    with open(path, "r+b") as f:
        f.write(new)
    if keep_stat:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:
        later(path)


def upgrade(site, own):
    rename_replace(site / "tabpkg" / "mod.py", "B = 22\n", keep_stat=False)
    record = site / "tabpkg-1.0.dist-info" / "RECORD"
    rename_replace(record, record.read_text() + "\n", keep_stat=False)


def uninstall(site, own):
    shutil.rmtree(site / "tabpkg")
    shutil.rmtree(site / "tabpkg-1.0.dist-info")
    (site / "tabmod.py").unlink()


def install(site, own):
    (site / "newdist").mkdir()
    (site / "newdist" / "__init__.py").write_text("")
    (site / "newdist-1.0.dist-info").mkdir()


def replace_root(site, own):
    os.rename(site, site.with_name("site.old"))
    shutil.copytree(site.with_name("site.old"), site)  # same names, sizes, mtimes


def run_python(site, own):
    """Run the packed code once, the plain way: ``__pycache__`` appears beside it."""
    import subprocess
    import sys

    code = "import tabpkg, tabpkg.mod, tabmod, mine"
    env = dict(os.environ, PYTHONPATH=f"{site}:{own}")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    assert (site / "tabpkg" / "__pycache__").is_dir()
    assert (own / "__pycache__").is_dir()


def run_python_then_replace(site, own):
    run_python(site, own)
    rename_replace(site / "tabpkg" / "mod.py", "B = 9\n")


# change: (what it does, found: a name now found where it is, per mode: stale?)
TABLE = {
    "install another distribution": (install, "newdist", "----"),
    "upgrade": (upgrade, None, "SSS-"),
    "uninstall": (uninstall, None, "SSS-"),
    "add a module beside the bundled ones": (
        lambda s, o: (s / "newmod.py").write_text(""),
        "newmod",
        "----",
    ),
    "add a module in a bundled package": (
        lambda s, o: (s / "tabpkg" / "extra.py").write_text(""),
        None,
        "SSS-",
    ),
    "remove a module": (lambda s, o: (s / "tabpkg" / "mod.py").unlink(), None, "SSS-"),
    "rename-replace in a package": (
        lambda s, o: rename_replace(s / "tabpkg" / "mod.py", "B = 9\n"),
        None,
        "SSS-",
    ),
    "rename-replace a top-level module": (
        lambda s, o: rename_replace(s / "tabmod.py", "C = 9\n"),
        None,
        "SSS-",
    ),
    "in-place edit, new mtime, installed": (
        lambda s, o: in_place(s / "tabpkg" / "mod.py", "B = 9\n"),
        None,
        "-SS-",
    ),
    "in-place edit, new mtime, own code": (
        lambda s, o: in_place(o / "mine.py", "D = 9\n"),
        None,
        "SSS-",
    ),
    "in-place edit, same size and mtime": (
        lambda s, o: in_place(s / "tabpkg" / "mod.py", "B = 9\n", keep_stat=True),
        None,
        "--S-",
    ),
    "in-place edit, same size and mtime, own code": (
        lambda s, o: in_place(o / "mine.py", "D = 9\n", keep_stat=True),
        None,
        "--S-",
    ),
    ".so replaced by rename": (
        lambda s, o: rename_replace(s / "tabpkg" / f"_native{EXT}", "x" * 16, False),
        None,
        "SSS-",
    ),
    ".so overwritten in place": (
        lambda s, o: in_place(s / "tabpkg" / f"_native{EXT}"),
        None,
        "-SS-",
    ),
    "data edited in place": (
        lambda s, o: in_place(s / "tabpkg" / "table.dat", "3 2 1\n"),
        None,
        "-SS-",
    ),
    "python ran once (bytecode written)": (run_python, None, "----"),
    "python ran, then rename-replace in a package": (
        run_python_then_replace,
        None,
        "SSS-",
    ),
    ".pth added": (lambda s, o: (s / "new.pth").write_text("/x\n"), None, "SSS-"),
    "a bundled root replaced": (replace_root, None, "SSS-"),
    "shadowing module in another root": (
        lambda s, o: (o / "tabmod.py").write_text(""),
        "tabmod",
        "----",
    ),
}


@pytest.mark.parametrize("change", sorted(TABLE))
def test_staleness_table(tmp_path, monkeypatch, change):
    import copy

    from mpistage.runtime.roots import module_names
    from mpistage.runtime.validate import MODES, changed

    site, own, manifest = table_setup(tmp_path, monkeypatch)
    act, found, expected = TABLE[change]
    act(site, own)
    for mode, cell in zip(MODES, expected, strict=True):
        checked = copy.deepcopy(manifest)
        stale = changed(checked, mode)
        assert bool(stale) == (cell == "S"), (mode, stale)
        if found and mode != "trust":  # the fresh listing names it
            names = set().union(*(module_names(r["listing"]) for r in checked["roots"]))
            assert found in names, mode


# -- environment bundles: a few directories stand for the environment ------------------


def test_an_environment_change_is_seen_and_bytecode_is_not(tmp_path):
    """``envfresh``: install, reinstall and removal are changes; ``__pycache__`` not."""
    from mpistage.runtime.envfresh import changed, snapshot, watched

    site = tmp_path / "lib" / "python3.11" / "site-packages"
    stdlib = tmp_path / "base" / "lib" / "python3.11"
    (site / "pkg-1.0.dist-info").mkdir(parents=True)
    stdlib.mkdir(parents=True)
    (tmp_path / "lib64").symlink_to("lib")  # the same site-packages, named once
    dirs = watched(str(tmp_path), str(stdlib))
    assert dirs == [str(site), str(stdlib)]
    manifest = {"env": {"watch": snapshot(dirs)}}

    def after(change):
        change()
        os.utime(site, ns=(1, 1))  # an mtime that surely moved
        return changed(manifest)

    assert after(lambda: (site / "__pycache__").mkdir()) == []
    assert after(lambda: (site / "new-2.0.dist-info").mkdir()) == [str(site)]
    assert after(lambda: (site / "new-2.0.dist-info").rmdir()) == []
    old, stash = site / "pkg-1.0.dist-info", tmp_path / "stash"
    reinstall = (lambda: old.rename(stash), old.mkdir, stash.rmdir)  # as pip does
    assert after(lambda: [step() for step in reinstall]) == [str(site)]
    shutil.rmtree(stdlib)
    assert changed(manifest) == [str(site), str(stdlib)]
    assert changed({"env": {}}) == [] and changed({}) == []  # bundles made before
