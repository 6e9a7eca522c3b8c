"""Trust, round 4: each rule tested by the class it comes from.

Another user is played by root with ``chown`` to :data:`OTHER`; those tests
are skipped without root. The classes:

1. the ``--auto`` cache is a private place, like a node's place, and what
   is replayed was written by this user; no process mpistage starts for
   its own work imports from the start directory;
2. ``mpistage run``'s clean step removes only what its run made;
3. the default ``DIR`` of ``mpistage run`` cannot be taken first;
8. a node boot follower uses only a place of its own launch instance, and
   checks every field of the record;
9. launch lines: a single-dash option is never split into an option and
   letters it does not take.
"""

import marshal
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from mpistage import StageError
from mpistage.cli.clean import REMOVE_STAGE
from mpistage.cli.launchers import HYDRA, OPENMPI, understand
from mpistage.cli.run import default_dir
from mpistage.cli.slurmstage import PREPARE
from mpistage.node.boot import Meeting
from mpistage.node.imports import VERSION, Declined, identity
from recordtools import need_report, replay
from stagetools import (
    MPIEXEC,
    PYTHON,
    clean_environ,
    make_site,
    mpirun,
    results,
    run,
    write_target,
)
from test_security import env_like  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("reap_mpich_shm")
OTHER = 4242
ROOT = os.geteuid() == 0
MPISTAGE = str(Path(PYTHON).parent / "mpistage")  # the command


def error_lines(text):
    return [ln for ln in text.splitlines() if "mpistage: error" in ln]


# -- 1. the --auto cache is a private place ------------------------------------------

APP = """
import tinypkg
emit({"file": tinypkg.__file__})
"""


def swap_for_symlink(path, owner=None):
    """Move *path* aside and put a symlink to it in its place."""
    aside = path.with_name(path.name + ".real")
    path.rename(aside)
    path.symlink_to(aside)
    if owner is not None:
        os.lchown(path, owner, owner)


HOSTILE_CACHES = {
    "cache of another user": lambda c, b: os.chown(c, OTHER, OTHER),
    "cache others can write": lambda c, b: c.chmod(0o777),
    "ancestor others can write": lambda c, b: c.parent.chmod(0o777),
    "cache through another user's symlink": lambda c, b: swap_for_symlink(c, OTHER),
    "bundle of another user": lambda c, b: os.chown(b, OTHER, OTHER),
    "bundle others can write": lambda c, b: b.chmod(0o666),
    "bundle is a symlink": lambda c, b: swap_for_symlink(b),
}


@pytest.mark.skipif(not ROOT, reason="needs root to play another user")
@pytest.mark.parametrize("form", sorted(HOSTILE_CACHES))
def test_a_cache_that_is_not_private_is_never_replayed(
    tmp_path, stage_env, stage_dir, form
):
    site = make_site(tmp_path / "site")
    (tmp_path / "app").mkdir()
    script = write_target(tmp_path / "app" / "app.py", APP)
    env = dict(stage_env, PYTHONPATH=str(site))
    (tmp_path / "shared").mkdir()
    cache = tmp_path / "shared" / "cache"
    options = ["--auto", "--cache-dir", cache]
    result, facts = replay(2, options, script, env, tmp_path / "r.json")
    assert need_report(result, facts)["auto"].startswith("recorded"), result
    (bundle,) = cache.glob("*.mpistage")
    HOSTILE_CACHES[form](cache, bundle)

    result, facts = replay(2, options, script, env, tmp_path / "r.json")
    assert facts is None or facts["auto"] != "replayed", (form, facts)
    assert result.returncode == 1, (form, result)
    assert len(error_lines(result.stderr)) == 1, (form, result.stderr)
    assert "--auto" in error_lines(result.stderr)[0], (form, result.stderr)


PLANTED = """\
import os
open(os.path.join({out!r}, {name!r}), "w").close()
"""

# mpistage itself, and standard library modules its tools import lazily
SHADOWED = ("mpistage", "json", "argparse", "shlex", "shutil", "subprocess",
            "tempfile", "zipfile", "signal", "glob", "secrets", "hashlib")  # fmt: skip


# What another user made before the victim's first --auto run
SHARED_CACHES = {
    "cache of another user": (OTHER, 0o755),
    "cache others can write": (os.getuid(), 0o777),
    "cache of another user others can write": (OTHER, 0o777),
}


@pytest.mark.skipif(not ROOT, reason="needs root to play another user")
@pytest.mark.parametrize("form", sorted(SHARED_CACHES))
def test_a_cache_another_user_made_first_runs_none_of_their_code(
    tmp_path, stage_env, stage_dir, form
):
    """The learning run refuses the cache before the program, and whatever
    was planted in it (modules named like mpistage's, a bundle) never runs."""
    site = make_site(tmp_path / "site")
    (tmp_path / "app").mkdir()
    script = write_target(tmp_path / "app" / "app.py", APP)
    env = dict(stage_env, PYTHONPATH=str(site))
    out, cache = tmp_path / "ran", tmp_path / "shared" / "cache"
    out.mkdir()
    cache.mkdir(parents=True)
    for name in SHADOWED:
        (cache / f"{name}.py").write_text(PLANTED.format(out=str(out), name=name))
    owner, mode = SHARED_CACHES[form]
    os.chown(cache, owner, owner)
    cache.chmod(mode)
    options = ["--auto", "--cache-dir", cache]
    result, facts = replay(2, options, script, env, tmp_path / "r.json")
    assert sorted(p.name for p in out.iterdir()) == [], (form, result)
    assert result.returncode == 1 and facts is None, (form, result)
    assert len(error_lines(result.stderr)) == 1, (form, result.stderr)
    assert "--auto" in error_lines(result.stderr)[0], (form, result.stderr)
    assert list(cache.glob("*.mpistage")) == [], form
    assert not list((tmp_path / "out").iterdir()), form  # the program did not run


def test_no_mpistage_process_imports_from_the_start_directory(
    tmp_path,
    env_like,  # noqa: F811
):
    """A start directory others can write holds modules named like ours."""
    planted, out = tmp_path / "shared", tmp_path / "ran"
    planted.mkdir()
    planted.chmod(0o777)
    out.mkdir()
    for name in SHADOWED:
        (planted / f"{name}.py").write_text(PLANTED.format(out=str(out), name=name))
    bare = tmp_path / "bare"  # a python with no mpistage command beside it
    bare.mkdir()
    (bare / "python").write_text(f'#!/bin/sh\nexec {PYTHON} "$@"\n')
    (bare / "python").chmod(0o755)
    env = clean_environ()
    for python in (PYTHON, str(bare / "python")):
        folder = tmp_path / f"env-{Path(python).parent.name}"
        command = [MPIEXEC, "-n", "2", python, "-c", "pass"]
        args = ["run", "--env", env_like, "--to", folder, "--", *command]
        result = run([MPISTAGE, *args], env=env, cwd=planted, timeout=120)
        assert result.returncode == 0, result
        assert not folder.exists(), result
    assert sorted(p.name for p in out.iterdir()) == []


# -- 2. the clean step removes only what its run made --------------------------------


def run_env(env_like_bundle, folder, cwd, keep=False):  # noqa: F811
    """``mpistage run --env BUNDLE --to FOLDER -- mpiexec -n 2 python -c pass``."""
    command = [MPIEXEC, "-n", "2", PYTHON, "-c", "pass"]
    options = ["--keep"] if keep else []
    args = ["run", "--env", env_like_bundle, "--to", folder, *options]
    return run([MPISTAGE, *args, "--", *command], env=clean_environ(), cwd=cwd)


def results_file(folder):
    """Something of the user's in *folder* that must survive."""
    (folder / "results.txt").write_text("a week of work\n")
    return folder / "results.txt"


def kept_stage_of_another_bundle(tmp_path, bundle):
    """``--to`` a stage of another bundle, kept from an earlier run."""
    other = tmp_path / "other.mpistage"
    other.write_bytes(Path(bundle).read_bytes())
    folder = tmp_path / "kept"
    done = run([MPISTAGE, "stage", other, "--to", folder], clean_environ())
    assert done.returncode == 0, done
    marker = folder / ".mpistage-stage"
    marker.write_text(marker.read_text().replace("sha256=", "sha256=0"))
    return folder, [marker, folder / "bin" / "python"]


def kept_stage_of_this_bundle(tmp_path, bundle):
    """A second run's ``DIR``: a run kept it, another run reuses it."""
    folder = tmp_path / "first-run"
    done = run_env(bundle, folder, tmp_path, keep=True)
    assert done.returncode == 0, done
    return folder, [folder / ".mpistage-stage", folder / "bin" / "python"]


def through_another_users_symlink(tmp_path, bundle):
    """``DIR`` below another user's symlink into a kept stage of ours."""
    victim, _ = kept_stage_of_this_bundle(tmp_path, bundle)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "link").symlink_to(victim.parent)
    os.lchown(shared / "link", OTHER, OTHER)
    return shared / "link" / victim.name, [victim / "bin" / "python"]


def marker_planted_by_another_user(tmp_path, bundle):
    """A group directory of ours in which another user planted a marker."""
    folder = tmp_path / "group"
    folder.mkdir()
    folder.chmod(0o770)
    marker = folder / ".mpistage-stage"
    marker.write_text("sha256=x\nstate=complete\n")
    os.chown(marker, OTHER, OTHER)
    return folder, [results_file(folder), marker]


def existing_dir(tmp_path, bundle):
    """An empty directory the user made (a mount point, a scratch directory)."""
    folder = tmp_path / "scratch"
    folder.mkdir(mode=0o700)
    return folder, [folder]


NOT_THIS_RUNS = {
    "kept stage of another bundle": kept_stage_of_another_bundle,
    "second run's DIR": kept_stage_of_this_bundle,
    "DIR through another user's symlink": through_another_users_symlink,
    "marker planted by another user": marker_planted_by_another_user,
    "an existing DIR": existing_dir,
}


@pytest.mark.parametrize("form", sorted(NOT_THIS_RUNS))
def test_the_clean_step_removes_only_what_its_run_made(
    tmp_path,
    env_like,  # noqa: F811
    form,
):
    if not ROOT and "another user" in form:
        pytest.skip("needs root to play another user")
    folder, survivors = NOT_THIS_RUNS[form](tmp_path, env_like)
    run_env(env_like, folder, tmp_path)
    for path in survivors:
        assert path.exists(), (form, path)


def test_the_clean_step_removes_what_its_run_made(tmp_path, env_like):  # noqa: F811
    folder = tmp_path / "new" / "env"
    done = run_env(env_like, folder, tmp_path)
    assert done.returncode == 0, done
    assert not folder.exists() and (tmp_path / "new").exists()


def test_an_existing_inputs_directory_is_never_adopted(tmp_path):
    """Slurm's ``DIR.in``: the stage step makes it anew, or refuses."""
    folder = tmp_path / "env"
    inputs = tmp_path / "env.in"
    inputs.mkdir(mode=0o700)
    kept = results_file(inputs)
    token = uuid.uuid4().hex
    prepare = ["/bin/sh", "-c", PREPARE, "mpistage-prepare", inputs, token]
    done = subprocess.run(prepare, capture_output=True, text=True)
    assert done.returncode == 1 and len(error_lines(done.stderr)) == 1, done
    clean = ["/bin/sh", "-c", REMOVE_STAGE, "mpistage-clean", token, folder, inputs]
    done = subprocess.run(clean, capture_output=True, text=True)
    assert kept.exists() and done.returncode == 0, done
    inputs.rename(tmp_path / "aside")  # a new one is made, marked and removed
    done = subprocess.run(prepare, capture_output=True, text=True)
    assert done.returncode == 0 and inputs.is_dir(), done
    done = subprocess.run(clean, capture_output=True, text=True)
    assert done.returncode == 0 and not inputs.exists(), done


# -- 3. the default DIR cannot be taken first -----------------------------------------


def test_the_default_dir_is_not_predictable():
    assert default_dir() != default_dir()


@pytest.mark.skipif(not ROOT, reason="needs root to play another user")
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_another_user_taking_the_default_dir_first_does_not_stop_the_job(
    tmp_path,
    env_like,  # noqa: F811
):
    """The shell makes every name it can predict, as another user, then execs."""
    squat = f"/dev/shm/mpistage-env-{os.getuid()}-$$"
    shell = (
        f'for d in "{squat}" "{squat}".in; do mkdir "$d" && chown {OTHER} "$d"; done; '
        'echo "$$" > squatted; exec "$@"'
    )
    command = [MPIEXEC, "-n", "2", PYTHON, "-c", "pass"]
    args = [MPISTAGE, "run", "--env", env_like, "--", *command]
    launchers = ("SLURM_", "PBS_", "FLUX_", "PMIX_", "LSB_", "COBALT_")
    env = {k: v for k, v in clean_environ().items() if not k.startswith(launchers)}
    try:
        done = run(["/bin/sh", "-c", shell, "sh", *args], env=env, cwd=tmp_path)
    finally:
        pid = (tmp_path / "squatted").read_text().strip()
        for path in Path("/dev/shm").glob(f"mpistage-env-{os.getuid()}-{pid}*"):
            if path.stat().st_uid == OTHER:
                path.rmdir()
    assert done.returncode == 0, done
    assert not list(Path("/dev/shm").glob(f"mpistage-env-{os.getuid()}-{pid}.*"))


# -- 8. the node boot: one launch instance, every field checked ------------------------

HOLD = """
import os, sys, time
boot = sys.modules["mpistage.node.boot"].state
emit({"role": boot.role, "place": boot.path, "reason": boot.reason})
if os.environ.get("HOLD"):
    open(os.environ["HOLD"], "w").close()
    time.sleep(float(os.environ["HOLD_SECONDS"]))
"""


@pytest.mark.parametrize("entry", [(MPISTAGE,), ("-m", "mpistage")])
def test_launches_with_one_name_never_share_a_place(
    tmp_path, stage_env, stage_dir, entry
):
    """A launch holds its place while another with the same variables starts.

    Both inherit one ``FLUX_JOB_ID`` (``PMIX_NAMESPACE`` would make the
    MPICH wheel refuse to start; Slurm's variables would move the nodes).
    """
    variable = "FLUX_JOB_ID"
    target = write_target(tmp_path / "app.py", HOLD)
    name = f"inherited-{uuid.uuid4().hex}"
    first_out, second_out = tmp_path / "first-out", tmp_path / "second-out"
    first_out.mkdir()
    second_out.mkdir()
    held = tmp_path / "held"
    base = dict(stage_env, **{variable: name}, MPISTAGE_EMULATE_NODES="1")
    first_env = dict(base, MPISTAGE_TEST_OUT=str(first_out), HOLD=str(held))
    first_env["HOLD_SECONDS"] = "20"
    command = [MPIEXEC, "-n", "2", PYTHON, MPISTAGE, target]
    first = subprocess.Popen(command, env=first_env, cwd=tmp_path)
    try:
        for _ in range(600):
            if held.exists() or first.poll() is not None:
                break
            __import__("time").sleep(0.1)
        assert held.exists(), "the first launch did not start"
        second_env = dict(base, MPISTAGE_TEST_OUT=str(second_out))
        done = mpirun(2, [*entry, target], second_env, cwd=tmp_path, timeout=120)
        assert done.returncode == 0, done
    finally:
        first.terminate()
        try:
            first.wait(timeout=60)
        except subprocess.TimeoutExpired:
            first.kill()
            first.wait()
    held_place = results(first_env, 2)[0]["place"]
    assert held_place is not None, results(first_env, 2)
    for got in results(second_env, 2):
        assert got["role"] != "copy" or got["place"] != held_place, got
        if got["role"] == "normal":
            assert "another launch" in got["reason"], got


def good_record():
    """A node boot record of the right shape."""
    code = marshal.dumps(compile("X = 1", "m.py", "exec"))
    return {
        "version": VERSION,
        "launch": "flux-L",
        "instance": "123-456",
        "identity": identity(),
        "modules": {
            "m": ("code", "/x/m.py", "/x/__pycache__/m.pyc", False, [], code, "source"),
            "p": ("code", "/x/p/__init__.py", None, True, ["/x/p"], code, "sourceless"),
            "e": ("ext", "/x/e.so", "files/x/e.so", None, None),
            "MPI": ("ext", "/x/MPI.so", "files/x/MPI.so", "mpi4py.Finder", ["/x"]),
        },
        "missing": ["nope"],
        "libraries": {"/x/libmpi.so": "files/x/libmpi.so", "/x/l.so": ("error", "no")},
        "first": {"/x/libmpi.so": ["files/x/libdep.so"]},
        "files": 4,
        "bytes": 100,
        "declined": [("/x/big.so", "too large")],
    }


def wrong_shapes():
    """Records of the wrong shape: every field missing, of a wrong kind, or bent."""
    good = good_record()
    yield "not a dict", [("flux-L",)]
    for key in good:
        yield f"no {key}", {k: v for k, v in good.items() if k != key}
        for wrong in (None, 1.5, "x", [1], {"a": 1}, (1, 2), True):
            if type(wrong) is not type(good[key]):
                yield f"{key}={wrong!r}", dict(good, **{key: wrong})
    for name, entry in good["modules"].items():
        yield f"module {name} is a list", module(good, name, list(entry))
        yield f"module {name} too short", module(good, name, entry[:-1])
        yield f"module {name} too long", module(good, name, (*entry, None))
        for at in range(len(entry)):
            for wrong in (7, 1.5, b"x"):  # of no kind any field takes
                if type(wrong) is not type(entry[at]):
                    bent = (*entry[:at], wrong, *entry[at + 1 :])
                    yield f"module {name}[{at}]={wrong!r}", module(good, name, bent)
    for rel in ("/etc/passwd", "files/../../x", "", "files//x"):
        yield (
            f"ext copy {rel!r}",
            module(good, "e", ("ext", "/x/e.so", rel, None, None)),
        )
        libraries = dict(good["libraries"], **{"/x/libmpi.so": rel})
        yield f"library copy {rel!r}", dict(good, libraries=libraries)
        yield f"first copy {rel!r}", dict(good, first={"/x/libmpi.so": [rel]})
    yield "library error short", dict(good, libraries={"/x/l.so": ("error",)})
    yield "missing name no string", dict(good, missing=[7])
    yield "first not a list", dict(good, first={"/x/libmpi.so": "files/x"})
    yield "module name no string", dict(good, modules={7: good["modules"]["m"]})
    yield "how unknown", module(good, "m", (*good["modules"]["m"][:-1], "evil"))


def module(record, name, entry):
    return dict(record, modules=dict(record["modules"], **{name: entry}))


def follower():
    meeting = Meeting("flux-L", "boot-flux-L.h", None, None, "/nowhere/boot")
    meeting.instance = "123-456"
    return meeting


def test_a_record_of_the_right_shape_and_launch_is_used():
    record = good_record()
    assert follower().check(record) is record


@pytest.mark.parametrize("what,record", list(wrong_shapes()))
def test_a_record_of_the_wrong_shape_is_a_decline(what, record):
    with pytest.raises(Declined):
        follower().check(record)


def test_a_record_of_another_instance_is_a_decline():
    with pytest.raises(Declined, match="another launch"):
        follower().check(dict(good_record(), instance="999-1"))


# -- 9. launch lines: no option split into letters -------------------------------------


def single_letter_options(table):
    return sorted(k for k, (_role, arity) in table.items() if len(k) == 1 and arity)


@pytest.mark.parametrize(
    "launcher,table", [("mpirun.openmpi", OPENMPI), ("mpiexec.hydra", HYDRA)]
)
@pytest.mark.parametrize("rest", ["olocal", "xyz", "ppn4", "Hz"])
def test_a_single_dash_word_is_one_option_or_refused(launcher, table, rest):
    for letter in single_letter_options(table):
        word = f"-{letter}{rest}"
        if word.lstrip("-") in table:
            continue  # an option of the table: read as itself
        line = [launcher, word, "-n", "2", "python", "app.py"]
        with pytest.raises(StageError) as refused:
            understand(line)
        assert "\n" not in str(refused.value) and word in str(refused.value), word


@pytest.mark.parametrize(
    "launcher,table", [("mpirun.openmpi", OPENMPI), ("mpiexec.hydra", HYDRA)]
)
def test_a_number_attached_to_a_short_option_is_its_value(launcher, table):
    for letter in single_letter_options(table):
        launch = understand([launcher, f"-{letter}4", "python", "app.py"])
        assert launch.values(letter) == ["4"], letter
