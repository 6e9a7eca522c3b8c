"""``mpistage-env`` played by two ordinary users on one node: the victim and another.

Every launch here runs as the victim (``mpistage-victim``), never as root;
what the other user (``mpistage-other``) does, their own processes do,
with files of their own, at the moment they could (a hook in the victim's
node Python says when: it waits for the other user's move, as a slow
node would let them). Each test checks what the victim would notice:
none of the other user's code or files is run, the job runs or ends with
one line, and nothing is left for good. The rules are docs/usage.md's
"Security model" and docs/stage.md's "Where to broadcast to"; the Slurm
cases are in tests/test_envlaunch_launchers.py.
"""

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from stagetools import MPIEXEC, clean_environ, mpistage
from test_envlaunch import APP, SCRIPT, results
from usertools import BASE, OTHER, VICTIM, Subreaper, ensure, missing, python_for

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reap_mpich_shm")]

if missing():  # the whole module, with one line
    pytest.skip(
        f"tests as two ordinary users skipped: {missing()}", allow_module_level=True
    )

# The other user's interpreter, in their own environment bundle: what a
# victim running it would run.
PWNED = "import os\nopen(os.environ.get('PWNED', '/dev/null'), 'a').write('pwned')\n"
# A job's id, as the schedulers' variables carry it.
JOB = "4711"


@pytest.fixture(scope="session")
def victim():
    return ensure(VICTIM)


@pytest.fixture(scope="session")
def other():
    return ensure(OTHER)


@pytest.fixture(scope="session")
def files(victim, env_bundle, run_file):
    """The victim's own copies of the small environment, plain and self-extracting."""
    folder = victim.home / "files"
    folder.mkdir(mode=0o700, exist_ok=True)
    for source, name in ((env_bundle, "env.mpistage"), (run_file, "env.run")):
        subprocess.run(["cp", "--preserve=mode", source, folder / name], check=True)
    (folder / "app.py").write_text(APP)
    victim.own(folder)
    return folder


@pytest.fixture(scope="session")
def attackers_run(other, tmp_path_factory):
    """The other user's self-extracting bundle: the small venv with a
    ``sitecustomize`` that leaves ``pwned`` wherever ``$PWNED`` says."""
    from envtools import small_venv

    venv = small_venv(tmp_path_factory).prefix
    copy = tmp_path_factory.mktemp("attacker") / "V"
    subprocess.run(["cp", "-a", venv, copy], check=True)
    site = next(copy.glob("lib/python3*/site-packages"))
    (site / "sitecustomize.py").write_text(PWNED)
    path = other.home / "evil.run"
    done = mpistage(["pack", "--env", copy, "--self-extracting", "-o", path],
                    clean_environ())  # fmt: skip
    assert done.returncode == 0, done
    path.chmod(0o755)
    other.home.chmod(0o755)  # the victim may read it, as a link makes them
    other.own(path)
    return path


@pytest.fixture
def place(victim, request):
    """A private place of the victim's: MPISTAGE_STAGE_DIR, no fallback."""
    folder = victim.folder(f"place-{os.getpid()}-{request.node.name[:40]}")
    yield folder
    subprocess.run(["rm", "-rf", str(folder)], check=False)


@pytest.fixture
def shared(request):
    """A place every user may write, sticky and root's, as /dev/shm is."""
    folder = BASE / f"shared-{os.getpid()}-{request.node.name[:40]}"
    subprocess.run(["rm", "-rf", str(folder)], check=False)
    folder.mkdir()
    folder.chmod(0o1777)
    yield folder
    subprocess.run(["rm", "-rf", str(folder)], check=False)


def environ(user, place, nodes=2, **extra):
    """The victim's launch environment with *place* as the only place."""
    env = user.environ(MPISTAGE_STAGE_DIR=place, MPISTAGE_STAGE_FALLBACK="no", **extra)
    env["MPISTAGE_EMULATE_NODES"] = str(nodes)
    return env


def launch(user, bundle, env, files, n=4, timeout=120):
    """``mpiexec -n N mpistage-env BUNDLE -- python app.py``, or the
    self-extracting *bundle* itself when it is a ``.run``, as *user*."""
    head = [bundle] if str(bundle).endswith(".run") else [SCRIPT, bundle]
    command = [MPIEXEC, "-n", n, *head, "--", "python", files / "app.py"]
    return user.run(command, env, timeout=timeout)


def start_launch(user, bundle, env, files, n=4):
    head = [bundle] if str(bundle).endswith(".run") else [SCRIPT, bundle]
    command = [MPIEXEC, "-n", n, *head, "--", "python", files / "app.py"]
    return user.start(command, env)


def errors(result):
    return [ln for ln in result.stderr.splitlines() if "mpistage-env: error" in ln]


def names(folder):
    return sorted(p.name for p in folder.iterdir())


def settled(folder, keep=(), timeout=15):
    """What is left in *folder* (but *keep*) once the watchdogs had their time."""
    deadline = time.time() + timeout
    while time.time() < deadline and set(names(folder)) - set(keep):
        time.sleep(0.2)
    return sorted(set(names(folder)) - set(keep))


def clean(user, env):
    """``mpistage clean`` as *user*, with the user's own venv of it."""
    return user.run([python_for(user), "-m", "mpistage", "clean"], env, timeout=120)


def schedulers(user, answers):
    """A folder of stand-in scheduler commands that answer as *answers* says.

    *answers*: ``{command: (status, stdout, stderr)}``. Put first on PATH:
    the reaper asks them about a job, as it asks the real ones.
    """
    folder = user.home / f"bin-{os.getpid()}"
    folder.mkdir(mode=0o755, exist_ok=True)
    for command, (status, out, err) in answers.items():
        path = folder / command
        path.write_text(
            f"#!/bin/sh\nprintf '%s' '{out}'\nprintf '%s' '{err}' >&2\nexit {status}\n"
        )
        path.chmod(0o755)
    user.own(folder)
    return folder


def with_path(env, folder):
    return dict(env, PATH=f"{folder}:{env['PATH']}")


# -- the launch's own process is root's, as Slurm's slurmstepd is -------------------


@pytest.fixture
def roots_starter(tmp_path):
    """A root process named ``slurmstepd`` that starts the victim's ranks: a copy
    of ``/bin/sh`` under that name, in a directory of root's."""
    folder = BASE / "root-bin"
    folder.mkdir(mode=0o755, exist_ok=True)
    starter = folder / "slurmstepd"
    subprocess.run(["cp", "/bin/sh", starter], check=True)
    return starter


def test_a_launch_whose_process_is_roots_runs_and_leaves_nothing(
    victim, files, place, roots_starter
):
    """Two ranks of a self-extracting bundle in a place, started by a root
    process (as ``srun --bcast`` starts them, from root's ``slurmstepd``):
    both run their node's copy, and once that process ended, nothing of
    the launch (copy, claim, the launcher's copy of the file) is left."""
    run_file = place / "env.run"
    subprocess.run(["cp", "--preserve=mode", files / "env.run", run_file], check=True)
    victim.own(run_file)
    env = environ(victim, place, MPISTAGE_ENV_WAIT=60)
    del env["MPISTAGE_EMULATE_NODES"]
    ranks = " & ".join(
        f"SLURM_PROCID={r} {' '.join(victim.command([run_file]))} -- "
        f"python -c 'import sys; print(\"RAN\", sys.executable)'"
        for r in range(2)
    )
    script = f"cd / && {ranks} & wait"
    done = subprocess.run(
        [roots_starter, "-c", script], env=env, capture_output=True, text=True,
        timeout=120, start_new_session=True,
    )  # fmt: skip
    ran = [ln.split()[1] for ln in done.stdout.splitlines() if ln.startswith("RAN")]
    assert len(ran) == 2 and ran[0] == ran[1], done
    assert Path(ran[0]).is_relative_to(place), done
    assert settled(place) == []


# -- the launcher's copy runs only if it is the victim's own file -----------------


def hooked_python(victim, hook):
    """A node Python that waits for the other user's move before it starts."""
    wrapper = victim.home / f"node-python-{os.getpid()}"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"touch {hook}/ready\n"
        f"for i in $(seq 200); do [ -e {hook}/done ] && break; sleep 0.05; done\n"
        'exec /usr/bin/python3 "$@"\n'
    )
    wrapper.chmod(0o755)
    victim.own(wrapper)
    return wrapper


def move_when_ready(other, hook, move):
    """The other user's process: once the victim's node is slow, *move* (sh)."""
    script = (
        f"for i in $(seq 600); do [ -e {hook}/ready ] && break; sleep 0.05; done; "
        f"[ -e {hook}/ready ] && {{ {move}; }}; touch {hook}/done"
    )
    return other.start(["sh", "-c", script], other.environ())


@pytest.mark.parametrize("how", ["a link to your own file", "a link swapped later"])
def test_the_launchers_copy_runs_only_if_it_is_your_file(
    victim, other, files, attackers_run, shared, how
):
    """The other user plants, at the name the launcher's copy would have in a
    shared place, a link to the victim's own self-extracting file; then,
    while the victim's node is slow, swaps it for their own bundle. The
    victim's launch runs neither, and says so in one line."""
    link = shared / f"env-{JOB}.run"
    hook = shared / "hook"
    hook.mkdir(mode=0o777)
    hook.chmod(0o777)
    mover = None
    subprocess.run(
        other.command(["ln", "-s", files / "env.run", link]), check=True, timeout=30
    )
    pwned = victim.home / f"pwned-{os.getpid()}"
    extra = {"PWNED": pwned}
    if how == "a link swapped later":
        extra["MPISTAGE_NODE_PYTHON"] = hooked_python(victim, hook)
        mover = move_when_ready(other, hook, f"ln -sfn {attackers_run} {link}")
    try:
        env = environ(victim, shared, **extra)
        result = launch(victim, link, env, files, n=2, timeout=120)
    finally:
        if mover is not None:
            mover.kill()
            mover.communicate(timeout=60)
    assert not pwned.exists(), result
    assert result.returncode != 0 and results(result) == {}, result
    lines = errors(result)
    assert lines and all("is not a file of yours alone" in ln for ln in lines), result
    assert not [n for n in names(shared) if n.startswith("mpistage-env-")]
    pwned.unlink(missing_ok=True)


# -- what a launch killed outright leaves, and a reaper cut short --------------------


def killed_launch(victim, bundle, env, files):
    """Start a launch, let every rank run, then kill all of the victim's processes."""
    proc = start_launch(victim, bundle, dict(env, SLEEP="120"), files)
    deadline = time.time() + 90
    place = Path(env["MPISTAGE_STAGE_DIR"])
    while time.time() < deadline:
        copies = [p for p in place.glob("mpistage-env-*") if not p.name.endswith(".in")]
        marks = [p / ".mpistage-stage" for p in copies]
        if len(copies) == 2 and all(
            m.exists() and "state=complete" in m.read_text() for m in marks
        ):
            break
        time.sleep(0.2)
    time.sleep(1)
    victim.kill_all()
    proc.communicate(timeout=60)
    return names(place)


def test_a_broadcast_file_of_a_launch_killed_outright_goes_with_the_next(
    victim, files, place
):
    """A self-extracting bundle in the place (the launcher's copy), its launch
    killed outright, watchdogs and all: the next launch removes the copies,
    the claims and that file."""
    run_file = place / "env.run"
    subprocess.run(["cp", "--preserve=mode", files / "env.run", run_file], check=True)
    victim.own(run_file)
    env = environ(victim, place)
    left = killed_launch(victim, run_file, env, files)
    assert "env.run" in left and len(left) == 5, left
    again = launch(victim, files / "env.mpistage", env, files)
    assert again.returncode == 0, again
    assert settled(place) == []


@pytest.mark.parametrize(("status", "out", "err", "kept"), [
    (1, "", "slurm_load_jobs error: Invalid job id specified", False),
    (0, "COMPLETED", "", False),
    (0, "RUNNING", "", True),
])  # fmt: skip
def test_a_broadcast_directory_goes_once_its_job_has_ended(
    victim, place, status, out, err, kept
):
    """``mpistage-env-UID-JOB.bcast`` (docs/stage.md: the victim's directory
    for ``srun --bcast``) goes with the job its name gives, once Slurm
    says that job has ended, and not before."""
    folder = place / f"mpistage-env-{victim.uid}-{JOB}.bcast"
    folder.mkdir(mode=0o700)
    (folder / f"slurm_bcast_{JOB}.0_n1").write_text("#!/bin/sh\n")
    victim.own(folder)
    bin_dir = schedulers(victim, {"squeue": (status, out, err)})
    done = clean(victim, with_path(environ(victim, place), bin_dir))
    assert done.returncode == 0, done
    assert names(place) == ([folder.name] if kept else []), done


@pytest.mark.parametrize(
    "when", [*(pytest.param(w, marks=pytest.mark.extended) for w in (1, 2, 3)), 6, 12]
)
def test_a_reaper_cut_short_anywhere_leaves_what_the_next_finishes(
    victim, files, place, when
):
    """``mpistage clean`` killed at its *when*-th removal of an entry (strace's
    fault injection): the next ``mpistage clean`` removes all that is left."""
    env = environ(victim, place)
    left = killed_launch(victim, files / "env.mpistage", env, files)
    assert len(left) == 4, left
    python = python_for(victim)
    inject = f"inject=unlinkat:signal=KILL:when={when}"
    cleans = victim.command([python, "-m", "mpistage", "clean"])
    command = ["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=unlinkat",
               "-e", inject, *cleans]  # fmt: skip
    cut = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert cut.returncode != 0, cut  # killed, as asked
    assert clean(victim, env).returncode == 0
    assert names(place) == []


# -- liveness another user cannot forge ------------------------------------------


def test_another_users_process_named_as_the_step_keeps_nothing_alive(
    victim, other, files, place
):
    """A Slurm job's copy stays for the job's later steps; once Slurm says the
    job has ended, a process of the other user's named like the job's
    ``slurmstepd`` does not keep it."""
    env = environ(victim, place, SLURM_JOB_ID=JOB)
    first = launch(victim, files / "env.mpistage", env, files)
    assert first.returncode == 0 and len(names(place)) == 4, first
    forged = other.start(
        ["bash", "-c", f"exec -a 'slurmstepd: [{JOB}.0]' sleep 120"], other.environ()
    )
    try:
        time.sleep(0.5)
        bin_dir = schedulers(victim, {"squeue": (1, "", "Invalid job id specified")})
        done = clean(victim, with_path(environ(victim, place), bin_dir))
        assert done.returncode == 0, done
        assert names(place) == [], done
    finally:
        forged.kill()
        forged.communicate(timeout=30)


def take_pid(user, pid, tries=200):
    """Start a process of *user*'s whose pid is *pid* (root steers the next pid)."""
    last = Path("/proc/sys/kernel/ns_last_pid")
    for _ in range(tries):
        last.write_text(str(pid - 1))
        proc = user.start(["sleep", "120"], user.environ())
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.communicate(timeout=30)
    seen = Path(f"/proc/{pid}/stat")
    state = seen.read_text() if seen.exists() else "gone"
    pytest.skip(f"could not take pid {pid} in {tries} tries ({state})")


def test_a_pid_another_user_took_keeps_nothing_alive(victim, other, files, place):
    """A launch killed outright leaves its copies, owned by its launcher's
    process; the other user takes that pid: the copies still go."""
    env = environ(victim, place)
    with Subreaper() as orphans:
        left = killed_launch(victim, files / "env.mpistage", env, files)
        time.sleep(0.5)
        orphans.reap()
    claim = next(n for n in left if n.endswith(".in"))
    record = (place / claim / ".mpistage-stage").read_text()
    pid = int(re.search(r"^run=[^:\n]*:(\d+)", record, re.M).group(1))
    holder = take_pid(other, pid)
    try:
        done = clean(victim, env)
        assert done.returncode == 0, done
        assert names(place) == [], (done, record)
    finally:
        holder.kill()
        holder.communicate(timeout=30)


# -- a job keeps its copy while its scheduler says it runs --------------------------

# Each scheduler: its job variable, and its command's answers for a job that
# runs and for one that ended.
SCHEDULERS = {
    "PBS": ("PBS_JOBID", "qstat", (0, f"Job Id: {JOB}.server\n    job_state = R\n", ""),
            (153, "", f"qstat: Unknown Job Id {JOB}.server")),
    "LSF": ("LSB_JOBID", "bjobs", (0, "RUN\n", ""),
            (255, "", f"Job <{JOB}> is not found")),
    "Flux": ("FLUX_JOB_ID", "flux", (0, "RUN\n", ""), (0, "INACTIVE\n", "")),
}  # fmt: skip


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_a_job_keeps_its_copy_between_steps_while_its_scheduler_says_it_runs(
    victim, files, place, scheduler
):
    """Between two steps, on a node where the job's script does not run,
    nothing carries the job's variable: the copy stays while the scheduler
    says the job runs (the next step reuses it), and goes once it ended."""
    var, command, running, ended = SCHEDULERS[scheduler]
    env = environ(victim, place, **{var: f"{JOB}.server"})
    first = launch(victim, files / "env.mpistage", env, files)
    assert first.returncode == 0 and len(names(place)) == 4, first
    made = names(place)
    between = with_path(environ(victim, place), schedulers(victim, {command: running}))
    assert clean(victim, between).returncode == 0
    assert names(place) == made
    second = launch(victim, files / "env.mpistage", with_path(env, between["PATH"]),
                    files)  # fmt: skip
    assert second.returncode == 0 and names(place) == made, second
    after = with_path(environ(victim, place), schedulers(victim, {command: ended}))
    assert clean(victim, after).returncode == 0
    assert names(place) == []


# -- one line, and nothing left, for launches that fail -----------------------------


def test_a_place_of_yours_whose_path_has_a_space_is_used(victim, files):
    folder = victim.folder("my place")
    try:
        result = launch(victim, files / "env.mpistage", environ(victim, folder), files)
        assert result.returncode == 0, result
        ranks = results(result)
        assert sorted(ranks) == [0, 1, 2, 3]
        assert all(Path(r["exe"]).is_relative_to(folder) for r in ranks.values())
        assert settled(folder) == []
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=False)


def test_a_place_of_yours_whose_path_has_a_newline_is_refused_for_that(victim, files):
    """A venv's ``pyvenv.cfg`` cannot name such a path: one line says so (not
    that others may write the place), and nothing is left."""
    folder = victim.folder("new\nline")
    try:
        result = launch(victim, files / "env.mpistage", environ(victim, folder), files)
        assert result.returncode != 0 and results(result) == {}, result
        lines = errors(result)
        assert lines and all("it holds a newline" in ln for ln in lines), result
        assert settled(folder) == []
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=False)


@pytest.mark.parametrize("job", [JOB, None], ids=["in a job", "no job"])
@pytest.mark.parametrize("cause", ["no node python", "no bundle"])
def test_a_launch_that_failed_early_leaves_nothing_once_it_ended(
    victim, files, place, job, cause
):
    extra = {"FLUX_JOB_ID": job} if job else {}
    bundle = files / "env.mpistage"
    if cause == "no node python":
        extra["MPISTAGE_NODE_PYTHON"] = victim.home / "none"
    else:
        bundle = files / "gone.mpistage"
    result = launch(victim, bundle, environ(victim, place, **extra), files)
    assert result.returncode != 0 and results(result) == {}, result
    says = (
        "to unpack the environment with"
        if cause == "no node python"
        else ("cannot use bundle")
    )
    lines = errors(result)
    assert lines and all(says in ln for ln in lines), result
    assert settled(place) == []


def test_a_copy_planted_while_the_first_rank_unpacks_ends_the_others_at_once(
    victim, other, files, shared
):
    """While the node's first rank is slow to unpack, the other user makes a
    directory of theirs at the copy's name: the rank waiting for the copy
    says so at once, rather than after the first rank's failure."""
    hook = shared / "hook"
    hook.mkdir(mode=0o777)
    hook.chmod(0o777)
    slow = victim.home / f"slow-python-{os.getpid()}"
    slow.write_text('#!/bin/sh\nsleep 8\nexec /usr/bin/python3 "$@"\n')
    slow.chmod(0o755)
    victim.own(slow)
    plant = (
        f"for d in {shared}/mpistage-env-{victim.uid}-*.in; do "
        'mkdir -m 700 "${d%.in}"; done'
    )
    hook_now = f"touch {hook}/ready"
    mover = move_when_ready(other, hook, plant)
    env = environ(victim, shared, nodes=1, MPISTAGE_NODE_PYTHON=slow)
    try:
        proc = start_launch(victim, files / "env.mpistage", env, files, n=2)
        deadline = time.time() + 30
        while not list(shared.glob("mpistage-env-*.in")) and time.time() < deadline:
            time.sleep(0.1)
        subprocess.run(["sh", "-c", hook_now], check=True)
        out, err = proc.communicate(timeout=120)
    finally:
        mover.kill()
        mover.communicate(timeout=60)
    assert proc.returncode != 0 and "RESULT" not in out, err
    assert "somebody else made it" in err, err
    subprocess.run(["rm", "-rf", *map(str, shared.glob("mpistage-env-*"))], check=False)
