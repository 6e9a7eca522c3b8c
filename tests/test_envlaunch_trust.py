"""``mpistage-env`` on a shared node: what another user can and cannot do.

Each test plays the attacker as another user would, with the files and
directories they could make (owned by uid 65534), at the moment they
could make them, and checks what the victim would notice: none of the
attacker's code runs as the victim, the job runs or ends with one line,
and nothing is left behind for good. The rules are docs/usage.md's
"Security model" (``mpistage-env`` on shared nodes).
"""

import base64
import json
import os
import signal
import subprocess
import time
import zlib
from pathlib import Path

import pytest

from stagetools import MPIEXEC, PYTHON, pack, rewrite_manifest, run
from test_envlaunch import APP, SCRIPT, environ, launch, results, settled

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reap_mpich_shm")]

NOBODY = 65534
# The attacker's interpreter: what a planted copy would run as the victim.
PLANTED_PYTHON = "#!/bin/sh\necho pwned > {pwned}\nexit 0\n"


@pytest.fixture
def place(tmp_path):
    """A private staging place for the test: MPISTAGE_STAGE_DIR, no fallback."""
    folder = tmp_path / "shm"
    folder.mkdir(mode=0o700)
    return folder


@pytest.fixture
def sticky(tmp_path):
    """A place every user may write, sticky, as /dev/shm and /tmp are."""
    folder = tmp_path / "sticky"
    folder.mkdir()
    folder.chmod(0o1777)
    yield folder
    remove_all(folder)


def remove_all(folder):
    for path in folder.iterdir():
        subprocess.run(["rm", "-rf", str(path)], check=True)


def give_away(path):
    """Make *path*, and everything below it, the attacker's."""
    for entry in [path, *path.rglob("*")] if not path.is_symlink() else [path]:
        os.lchown(entry, NOBODY, NOBODY)


def planted_copy(folder, pwned):
    """A directory that looks like a complete copy, its python the attacker's."""
    (folder / "bin").mkdir(parents=True)
    (folder / ".mpistage-stage").write_text("state=complete\n")
    python = folder / "bin" / "python"
    python.write_text(PLANTED_PYTHON.format(pwned=pwned))
    python.chmod(0o755)
    folder.chmod(0o755)


def node_python(tmp_path, body):
    """A node Python that runs *body* (sh) first: the attacker's timing."""
    wrapper = tmp_path / "node-python"
    wrapper.write_text(f'#!/bin/sh\n{body}\nexec /usr/bin/python3 "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


# -- 1. a planted copy never runs -----------------------------------------------------

# Plants DIR (the argument that names it) between the claim and the unpacker.
PLANT = """for a in "$@"; do
  case $a in */mpistage-env-*.in) ;; */mpistage-env-*) dir=$a ;; esac
done
{plant}
"""


@pytest.mark.parametrize("kind", ["directory", "symlink"])
def test_a_copy_planted_after_the_claim_never_runs(env_bundle, tmp_path, sticky, kind):
    pwned = tmp_path / "pwned"
    attacker = tmp_path / "attacker"
    planted_copy(attacker, pwned)
    give_away(attacker)
    if kind == "symlink":
        plant = f'ln -s {attacker} "$dir" && chown -h {NOBODY}:{NOBODY} "$dir"'
    else:
        plant = f'cp -a {attacker} "$dir"'
    python = node_python(tmp_path, PLANT.format(plant=plant))
    env = environ(sticky, MPISTAGE_NODE_PYTHON=python)
    result = launch(env_bundle, tmp_path, env, timeout=120)
    assert not pwned.exists(), result
    assert result.returncode != 0 and results(result) == {}, result
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "mpistage-env: error: on" in ln]
    assert errors and len(errors) >= len(lines) - 8, lines  # Hydra's own lines


# -- 2. the unpacker imports nothing from the job's directory -------------------------


def test_the_unpacker_imports_nothing_from_the_job_directory(
    env_bundle, tmp_path, place
):
    job = tmp_path / "job"
    job.mkdir()
    pwned = tmp_path / "pwned"
    for name in ("base64", "hashlib", "json", "struct", "zlib", "stat"):
        (job / f"{name}.py").write_text(f"open({str(pwned)!r}, 'a').write('{name}')\n")
    app = tmp_path / "app.py"
    app.write_text(APP)
    command = [MPIEXEC, "-n", "4", SCRIPT, env_bundle, "--", "python", app]
    result = run(command, environ(place), cwd=job, timeout=120)
    assert not pwned.exists(), pwned.read_text()
    assert result.returncode == 0 and sorted(results(result)) == [0, 1, 2, 3], result
    assert settled(place) == []


# -- 3. a bundle runs no code of its own before it is checked -------------------------


def with_other_code(manifest, pwned):
    launch_field = manifest["launch"]
    sources = json.loads(zlib.decompress(base64.b64decode(launch_field["modules"])))
    source, package = sources["mpistage.runtime.envlaunch"]
    payload = f"open({str(pwned)!r}, 'w').write('pwned')\n"
    sources["mpistage.runtime.envlaunch"] = [payload + source, package]
    packed = zlib.compress(json.dumps(sources, sort_keys=True).encode())
    launch_field["modules"] = base64.b64encode(packed).decode()


def test_a_bundle_with_other_unpacking_code_runs_none_of_it(
    env_bundle, tmp_path, place
):
    pwned = tmp_path / "pwned"
    bundle = rewrite_manifest(
        env_bundle, tmp_path / "theirs.mpistage", lambda m: with_other_code(m, pwned)
    )
    command = [MPIEXEC, "-n", "2", SCRIPT, bundle, "--", "/bin/true"]
    result = run(command, environ(place, nodes=1), cwd=tmp_path, timeout=120)
    assert not pwned.exists()
    assert result.returncode != 0, result
    errors = [ln for ln in result.stderr.splitlines() if "mpistage-env: error" in ln]
    assert errors and all("unpacking code" in ln for ln in errors), result.stderr


def test_the_script_knows_the_unpacking_code_it_installs_with():
    from mpistage.bundle.envboot import launch_digest

    line = next(ln for ln in SCRIPT.read_text().splitlines() if "LAUNCH_SHA256=" in ln)
    assert line == f"LAUNCH_SHA256={launch_digest()}", (
        "the unpacking code changed: run scripts/launch-digest --update"
    )


# -- 4. clean-up that nobody else steers, and that happens ----------------------------


def test_the_watchdog_moves_the_copy_nowhere_another_user_named(tmp_path, sticky):
    """The attacker plants, for the next pids, every name the watchdog could
    pick beside the copy; the copy and its claim still go, and nothing of
    the victim's reaches the attacker's directory."""
    folder = sticky / f"mpistage-env-{os.getuid()}-p1-2"
    claim = Path(f"{folder}.in")
    for made in (folder, claim):
        made.mkdir(mode=0o700)
        (made / "file").write_text("the victim's\n")
    attacker = tmp_path / "attacker"
    attacker.mkdir(mode=0o777)
    give_away(attacker)
    last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
    for pid in range(last + 1, last + 300):
        planted = sticky / f"{folder.name}.removing-{pid}"
        planted.symlink_to(attacker)
        os.lchown(planted, NOBODY, NOBODY)
    ended = subprocess.Popen(["true"])
    ended.wait()
    args = [str(ended.pid), "1", folder, claim]
    watchdog = ["/bin/sh", "-c", watchdog_code(), "mpistage-env-watchdog", *args]
    subprocess.run(watchdog, timeout=60, check=False)
    assert list(attacker.iterdir()) == []
    assert not folder.exists() and not claim.exists()


def watchdog_code():
    """The watchdog's code, as bin/mpistage-env starts it."""
    text = SCRIPT.read_text()
    return text.partition("\nWATCHDOG='")[2].partition("'\n")[0]


def names(folder):
    return sorted(p.name for p in folder.iterdir())


# Stand-ins for the schedulers' commands, each saying that any job has ended.
ENDED = {
    "qstat": "echo 'qstat: Unknown Job Id' >&2; exit 153",
    "bjobs": "echo 'Job is not found' >&2; exit 255",
    "flux": "echo INACTIVE",
    "squeue": "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1",
}


def ended_jobs(tmp_path):
    """A PATH whose schedulers say every job has ended."""
    folder = tmp_path / "schedulers"
    folder.mkdir(exist_ok=True)
    for name, body in ENDED.items():
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    return f"{folder}:{os.environ.get('PATH', '/usr/bin:/bin')}"


@pytest.mark.parametrize("var", ["PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID"])
def test_a_copy_of_an_ended_job_of_any_scheduler_goes_with_the_next(
    env_bundle, tmp_path, place, var
):
    first = launch(env_bundle, tmp_path, environ(place, **{var: "4711.server"}))
    assert first.returncode == 0, first
    left = names(place)
    assert len(left) == 4 and all("-4711-" in n for n in left), left
    env = environ(place, PATH=ended_jobs(tmp_path), **{var: "4712.server"})
    second = launch(env_bundle, tmp_path, env)
    assert second.returncode == 0, second
    now = names(place)
    assert len(now) == 4 and all("-4712-" in n for n in now), now
    remove_all(place)


def test_a_copy_of_an_ended_job_goes_with_the_next_runner_job(
    env_bundle, tmp_path, place
):
    """A job's copy outlives it (its time limit came before any clean step);
    the next mpistage process of any kind on the node removes it: here the
    runner, with a bundle of its own."""
    first = launch(env_bundle, tmp_path, environ(place, FLUX_JOB_ID="f7"))
    assert first.returncode == 0 and len(names(place)) == 4, first
    package = tmp_path / "src" / "tinypkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("X = 1\n")
    bundle = pack(tmp_path / "app.mpistage", "--path", package.parent)
    app = package.parent / "uses_tiny.py"
    app.write_text("import tinypkg\nprint('TINY', tinypkg.X)\n")
    command = [MPIEXEC, "-n", "2", PYTHON, "-m", "mpistage", "--bundle", bundle, app]
    env = environ(place, PATH=ended_jobs(tmp_path))
    result = run(command, env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0 and result.stdout.count("TINY 1") == 2, result
    assert not [n for n in names(place) if n.startswith("mpistage-env-")]
    remove_all(place)


def test_an_unpacker_whose_rank_was_killed_stops(env_bundle, tmp_path, place):
    """The rank that unpacks is killed while its node Python starts: that
    Python ends at once, unpacks nothing and holds nothing."""
    mark = tmp_path / "unpacker"
    python = node_python(
        tmp_path, f"echo $$ > {mark}.tmp; mv {mark}.tmp {mark}; sleep 3"
    )
    env = environ(place, nodes=1, MPISTAGE_NODE_PYTHON=python)
    proc = start_launch(env_bundle, tmp_path, env, 1)
    try:
        deadline = time.time() + 60
        while not mark.exists() and time.time() < deadline:
            time.sleep(0.05)
        unpacker = int(mark.read_text())
        rank = parent_of(unpacker)
        os.kill(rank, signal.SIGKILL)
        time.sleep(6)  # the sleep, then what an unpacking would take
        assert not running(unpacker)
        markers = list(place.glob("*/.mpistage-stage"))
        assert not any("state=complete" in m.read_text() for m in markers), markers
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        remove_all(place)


def start_launch(bundle, tmp_path, env, ranks):
    """Start a launch of the app in its own session, its output dropped."""
    app = tmp_path / "app.py"
    app.write_text(APP)
    command = [MPIEXEC, "-n", str(ranks), SCRIPT, bundle, "--", "python", app]
    return subprocess.Popen(
        [str(c) for c in command],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def parent_of(pid):
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def running(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_a_relative_stage_dir_is_cleaned_up(env_bundle, tmp_path):
    (tmp_path / "rel").mkdir(mode=0o700)
    env = environ(tmp_path / "rel")
    env["MPISTAGE_STAGE_DIR"] = "rel"
    result = launch(env_bundle, tmp_path, env)
    assert result.returncode == 0, result
    exes = {Path(r["exe"]) for r in results(result).values()}
    assert all((tmp_path / "rel") in e.parents for e in exes), exes
    assert settled(tmp_path / "rel") == []


# -- 5. one unpacking per node and launch ---------------------------------------------


def test_a_launch_killed_while_unpacking_is_taken_over_once_per_node(
    env_bundle, tmp_path, place
):
    """4 ranks per node find the claim of a launch killed mid-unpack: one of
    them unpacks again, the others wait, every rank runs."""
    mark = tmp_path / "started"
    python = node_python(tmp_path, f"touch {mark}; sleep 60")
    env = environ(place, FLUX_JOB_ID="f5", MPISTAGE_NODE_PYTHON=python)
    proc = start_launch(env_bundle, tmp_path, env, 4)
    deadline = time.time() + 60
    while not mark.exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    result = launch(env_bundle, tmp_path, environ(place, FLUX_JOB_ID="f5"), n=8)
    assert result.returncode == 0, result
    assert sorted(results(result)) == list(range(8)), result
    copies = {Path(r["exe"]).parent.parent for r in results(result).values()}
    assert len(copies) == 2, copies
    remove_all(place)


def test_runs_by_hand_are_launches_of_their_own(env_bundle, tmp_path, place):
    """Without a launcher, two runs from one shell: the second, after the
    bundle was packed again, runs from a copy of its own; none is left."""
    bundle = tmp_path / "env.mpistage"
    bundle.write_bytes(env_bundle.read_bytes())
    show = ["python", "-c", "import sys; print('EXE', sys.executable)"]
    env = environ(place, nodes=1)
    del env["MPISTAGE_EMULATE_NODES"]
    first = run([SCRIPT, bundle, "--", *show], env, cwd=tmp_path, timeout=120)
    replaced = tmp_path / "env.mpistage.new"
    replaced.write_bytes(env_bundle.read_bytes())
    replaced.rename(bundle)
    second = run([SCRIPT, bundle, "--", *show], env, cwd=tmp_path, timeout=120)
    exes = [r.stdout.partition("EXE ")[2].strip() for r in (first, second)]
    assert first.returncode == 0 and second.returncode == 0, (first, second)
    assert all(exes) and exes[0] != exes[1], exes
    assert settled(place) == []


def test_a_wrapper_per_rank_shares_the_node_copy(env_bundle, tmp_path, place):
    app = tmp_path / "app.py"
    app.write_text(APP)
    command = [MPIEXEC, "-n", "4", "timeout", "120", SCRIPT, env_bundle, "--"]
    result = run([*command, "python", app], environ(place), cwd=tmp_path, timeout=150)
    assert result.returncode == 0, result
    copies = {Path(r["exe"]).parent.parent for r in results(result).values()}
    assert len(copies) == 2, copies  # one per node, not one per rank
    assert settled(place) == []


# -- 6. another user cannot stop the job ----------------------------------------------


def test_a_place_others_may_write_is_passed_over(env_bundle, tmp_path, place):
    shared = tmp_path / "group"
    shared.mkdir()
    shared.chmod(0o770)  # a project directory: the group may write, not sticky
    env = environ(place)
    env["MPISTAGE_STAGE_DIR"] = f"{shared}:{place}"
    result = launch(env_bundle, tmp_path, env)
    assert result.returncode == 0, result
    exes = {Path(r["exe"]) for r in results(result).values()}
    assert all(place in e.parents for e in exes), exes
    assert list(shared.iterdir()) == []
    assert settled(place) == []


def test_names_planted_in_two_places_pass_to_the_third(env_bundle, tmp_path, place):
    firsts = [tmp_path / "one", tmp_path / "two"]
    env = environ(place, FLUX_JOB_ID="f6")
    env["MPISTAGE_STAGE_DIR"] = ":".join(map(str, [*firsts, place]))
    key = subprocess.run(
        ["cksum"], input=f"{env_bundle}\n", capture_output=True, text=True
    ).stdout.split()[0]
    for folder in firsts:
        folder.mkdir()
        folder.chmod(0o1777)
        for node in (0, 1):
            planted = folder / f"mpistage-env-{os.getuid()}-f6-{key}.n{node}"
            planted.mkdir()
            os.lchown(planted, NOBODY, NOBODY)
    result = launch(env_bundle, tmp_path, env)
    assert result.returncode == 0, result
    exes = {Path(r["exe"]) for r in results(result).values()}
    assert all(place in e.parents for e in exes), exes
    for folder in firsts:
        assert all(p.stat().st_uid == NOBODY for p in folder.iterdir())
    remove_all(place)


# -- 7. settings: one rule, one line --------------------------------------------------


@pytest.mark.parametrize(
    "name, value",
    [
        ("MPISTAGE_ENV_WAIT", "1e10"),
        ("MPISTAGE_ENV_WAIT", "inf"),
        ("MPISTAGE_ENV_WAIT", "-1"),
        ("MPISTAGE_ENV_WAIT", "86401"),
        ("MPISTAGE_ENV_WAIT", "99999999999999999999999"),
        ("MPISTAGE_EMULATE_NODES", "two"),
        ("MPISTAGE_EMULATE_NODES", "0"),
        ("MPISTAGE_STAGE_FALLBACK", "maybe"),
    ],
)
def test_a_setting_out_of_its_rule_is_one_line(
    env_bundle, tmp_path, place, name, value
):
    env = environ(place, **{name: value})
    result = launch(env_bundle, tmp_path, env, n=2, timeout=60)
    assert result.returncode != 0, result
    errors = [ln for ln in result.stderr.splitlines() if "mpistage-env: error" in ln]
    assert errors and all(f"{name}='{value}'" in ln for ln in errors), result.stderr
    assert results(result) == {}


@pytest.mark.parametrize("value", ["0600", "090", "120.5"])
def test_a_wait_is_read_as_decimal_seconds(env_bundle, tmp_path, place, value):
    result = launch(env_bundle, tmp_path, environ(place, MPISTAGE_ENV_WAIT=value))
    assert result.returncode == 0, result
    assert sorted(results(result)) == [0, 1, 2, 3]
    assert settled(place) == []
