"""The launcher tier: ``mpistage run`` under real Slurm, Open MPI and Hydra.

Each test writes a launch line as a user would, runs it through ``mpistage
run`` (or submits a job script), and checks what a user would notice:

- the stage step started the shared environment's python exactly once on
  each node of the job (``Shared`` counts the starts and where they ran);
- every rank ran its own node's staged interpreter (the executable lives on
  the same tmpfs as the node's /dev/shm, and the nodes' tmpfs differ);
- nothing is left on any node afterwards, on every exit path: a failing
  run step, a failing stage step, SIGINT or SIGTERM during the stage step;
- a failure of the clean step itself shows in the exit status.

The Slurm cluster is scripts/slurm-cluster (n1 and n2 on this machine, each
with a private /dev/shm, seen here through ``nsenter``); Open MPI's mpi4py
is scripts/openmpi-venv's; Hydra is the MPICH wheel's ``mpiexec``. Without
root or the Debian packages, the tier is skipped with one line.
"""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from launchertools import (
    HOST,
    NODES,
    ROOT,
    Shared,
    assert_on_own_node,
    errors,
    finish,
    kill_session,
    launcher_env,
    missing,
    on_node,
    openmpi_venv,
    rank_results,
    run,
    shm,
    shm_exists,
    staged_dir,
    stages,
    start,
    wait_for,
    write_app,
)
from mpistage.cli.steps import children
from stagetools import MPIEXEC, PYTHON, clean_environ, make_site, mpistage, pack

pytestmark = pytest.mark.launchers

if missing():  # the whole tier, with one line
    pytest.skip(f"launcher tier skipped: {missing()}", allow_module_level=True)


@pytest.fixture(scope="session")
def ompi(tmp_path_factory):
    """The Open MPI venv's python and its environment, packed once."""
    python = openmpi_venv()
    path = tmp_path_factory.mktemp("ompi-env") / "ompi.mpistage"
    venv = python.parent.parent
    result = mpistage(["pack", "--env", venv, "-o", path], clean_environ())
    assert result.returncode == 0, result
    return python, path


@pytest.fixture
def app(tmp_path):
    return write_app(tmp_path)


@pytest.fixture
def out(tmp_path):
    path = tmp_path / "out"
    path.mkdir()
    return path


@pytest.fixture
def shared(tmp_path):
    """The shared environment's python, counting its starts (MPICH wheel)."""
    return Shared(tmp_path / "shared")


@pytest.fixture
def shared_ompi(tmp_path, ompi):
    """The shared environment's python, counting its starts (Open MPI)."""
    return Shared(tmp_path / "shared-ompi", python=ompi[0])


def left_on_nodes(before):
    """The stage directories on n1 and n2 that were not there *before*."""
    return {node: stages(shm(node)) - before[node] for node in NODES}


def node_stages():
    return {node: stages(shm(node)) for node in NODES}


def local_stages():
    return {p.name for p in Path("/dev/shm").glob("mpistage-env-*")}


def split(line):
    return line.split()


# -- Slurm ------------------------------------------------------------------------


def test_sbatch_job_script(slurm, env_bundle, shared, app, out, tmp_path):
    """docs/examples/slurm.sh as a batch job: staged once per node, cleaned."""
    before = node_stages()
    env = dict(slurm, ENV_BUNDLE=str(env_bundle), VENV=str(shared.root))
    log = tmp_path / "job.out"
    script = ROOT / "docs" / "examples" / "slurm.sh"
    args = ["-N", "2", "--ntasks-per-node=2", "--wait", "--parsable", "-o", log]
    result = run(["sbatch", *args, script, app, out], env=env, cwd=tmp_path)
    job_log = log.read_text() if log.exists() else "(no job output)"
    assert result.returncode == 0, (result, job_log)
    job = result.stdout.split(";")[0].strip()

    results = rank_results(out, 4)
    folder = staged_dir(results)
    assert folder.name.startswith(f"mpistage-env-{os.getuid()}-{job}."), folder
    assert_on_own_node(results, folder)
    assert sorted(r["node"] for r in results) == ["n1", "n1", "n2", "n2"]
    assert shared.starts() == []  # sbcast and the nodes' own python: no shared one
    assert left_on_nodes(before) == {"n1": set(), "n2": set()}
    assert errors(job_log) == [], job_log


SRUN_FORMS = [
    # (allocation, launch line, ranks, nodes the stage step must run on)
    ("salloc -N 2", "srun -n 4", 4, ["n1", "n2"]),
    ("salloc -N 2", "srun -N 2 --ntasks-per-node=2 --mpi=pmi2", 4, ["n1", "n2"]),
    ("salloc -N 2", "srun -w n2 -n 2", 2, ["n1", "n2"]),
    ("salloc -N 2", "srun --nodelist=n[1-2] -n 3", 3, ["n1", "n2"]),
    ("salloc -N 2", "srun -N 1 -n 2", 2, ["n1", "n2"]),
    ("", "srun -N 2 -n 3", 3, ["n1", "n2"]),
    ("", "srun -w n2 -n 2", 2, ["n2"]),
]


@pytest.mark.parametrize("alloc,line,ranks,staged_on", SRUN_FORMS)
def test_srun(slurm, env_bundle, shared, app, out, alloc, line, ranks, staged_on):
    """srun inside ``salloc`` and outside any allocation."""
    before = node_stages()
    launch = [*split(line), shared.python, app, out]
    command = ["mpistage", "run", "--env", env_bundle, "--", *launch]
    if alloc:
        command = [*split(alloc), "--quiet", *command]
    result = run(command, env=slurm)
    assert result.returncode == 0, result
    results = rank_results(out, ranks)
    folder = staged_dir(results)
    assert_on_own_node(results, folder)
    assert {r["node"] for r in results} <= set(staged_on), results
    assert shared.starts() == []  # sbcast and the nodes' own python: no shared one
    assert left_on_nodes(before) == {"n1": set(), "n2": set()}
    assert errors(result.stderr) == [], result


DATA_APP = """
import json, os, sys
from mpi4py import MPI
rank, path = MPI.COMM_WORLD.rank, os.environ["MPISTAGE_DATA_DIR"]
found = {"node": os.environ["SLURMD_NODENAME"], "path": path,
         "files": sorted(os.listdir(path))}
with open(os.path.join(sys.argv[1], f"{rank}.json"), "w") as f:
    json.dump(found, f)
"""


def test_srun_data(slurm, tmp_path, out):
    """``mpistage run --data DIR -- srun``: each node's ranks find the node's copy;
    the clean step leaves nothing on either node."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    for name in ("config.json", "model.safetensors"):
        (checkpoint / name).write_bytes(os.urandom(1000))
    app = tmp_path / "data_app.py"
    app.write_text(DATA_APP)
    before = node_stages()
    line = ["srun", "-N", "2", "-n", "4", PYTHON, app, out]
    result = mpistage(["run", "--data", checkpoint, "--", *line], slurm)
    assert result.returncode == 0, result
    found = [json.loads((out / f"{r}.json").read_text()) for r in range(4)]
    assert {f["node"] for f in found} == set(NODES)
    assert all(f["files"] == ["config.json", "model.safetensors"] for f in found)
    assert len({f["path"] for f in found}) == 1  # the same path, on each node
    assert left_on_nodes(before) == {node: set() for node in NODES}


@pytest.mark.parametrize("alloc", ["salloc -N 2", ""])
def test_srun_arbitrary_with_a_host_file(
    slurm, env_bundle, shared, app, out, tmp_path, alloc
):
    """``srun -m arbitrary`` places tasks as ``SLURM_HOSTFILE`` lists them.

    Outside an allocation the ``salloc`` asks for the file's distinct nodes,
    not for the tasks; inside one the stage and clean steps ignore the file.
    """
    hosts = tmp_path / "hosts"
    hosts.write_text("n1\nn1\nn1\nn2\n")
    before = node_stages()
    launch = ["srun", "-m", "arbitrary", "-n", "4", shared.python, app, out]
    command = ["mpistage", "run", "--env", env_bundle, "--", *launch]
    command = ["env", f"SLURM_HOSTFILE={hosts}", *command]  # for srun, not salloc
    if alloc:
        command = [*split(alloc), "--quiet", *command]
    result = run(command, env=slurm)
    assert result.returncode == 0, result
    results = rank_results(out, 4)
    assert [r["node"] for r in results] == ["n1", "n1", "n1", "n2"], results
    assert_on_own_node(results, staged_dir(results))
    assert shared.starts() == []
    assert left_on_nodes(before) == {"n1": set(), "n2": set()}
    assert errors(result.stderr) == [], result


def test_runner_counts_nodes_of_an_arbitrary_placement(slurm, tmp_path):
    """The runner's nodes are Slurm's, also when MPI's own view is per rank.

    Under ``-m arbitrary`` the MPICH wheel sees every rank as a node of its
    own; the report must say 2 nodes for a 2-node step, with one copy each.
    ``mpistage.data`` still shares memory only where MPI can.
    """
    hosts = tmp_path / "hosts"
    hosts.write_text("n1\nn1\nn1\nn2\n")
    (tmp_path / "blob").write_bytes(bytes(range(256)) * 16)
    (tmp_path / "ok.py").write_text(
        "import sys\nfrom mpi4py import MPI\nimport mpistage.data\n"
        "buf = mpistage.data.read(sys.argv[1], comm=MPI.COMM_WORLD)\n"
        "assert len(buf) == 4096 and bytes(buf.view[:3]) == bytes([0, 1, 2])\n"
    )
    report = tmp_path / "report.json"
    env = dict(slurm, MPISTAGE_REPORT=str(report))
    runner = [PYTHON, Path(PYTHON).parent / "mpistage"]
    srun = ["salloc", "-N", "2", "--quiet", "env", f"SLURM_HOSTFILE={hosts}"]
    srun += ["srun", "-m", "arbitrary", "-n", "4"]
    result = run([*srun, *runner, tmp_path / "ok.py", tmp_path / "blob"], env=env)
    assert result.returncode == 0, result
    data = json.loads(report.read_text())
    assert (data["ranks"], data["nodes"]) == (4, 2), data


TWO_RUNS = """\
mpistage run --env "$1" -- srun {first} "$2" "$3" "$4/one" "time.sleep(8)" &
first=$!
sleep 2
mpistage run --env "$1" -- srun {second} "$2" "$3" "$4/two" &
second=$!
wait $first; one=$?
wait $second; two=$?
echo "status $one $two"
"""

# The two ways two steps of one allocation run at once: every CPU held by
# the first run step, the second sharing them (--overlap); or each run step
# on CPUs of its own (--exclusive), with none left for a stage step.
STEPS = {
    "overlap": ("-n 8", "--overlap -n 8", 8),
    "exclusive": ("--exclusive -n 4", "--exclusive -n 4", 4),
}


@pytest.mark.parametrize("steps", sorted(STEPS))
def test_two_runs_at_once_in_one_allocation(
    slurm, env_bundle, shared, app, tmp_path, steps
):
    """Two ``mpistage run`` of one allocation at once, every CPU busy: both run.

    The first one's run step holds every CPU, or the run steps hold them
    all between them (``--exclusive``). The second one's stage step does not
    wait for the first one's run step (the stage and clean steps overlap
    other steps), and each has its own ``DIR``: the first one's clean step
    does not take the second one's.
    """
    first, second, ranks = STEPS[steps]
    before = node_stages()
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    script = tmp_path / "two.sh"
    script.write_text(TWO_RUNS.format(first=first, second=second))
    command = ["salloc", "-N", "2", "--quiet", "sh", script, env_bundle]
    result = run([*command, shared.python, app, tmp_path], env=slurm)
    assert result.returncode == 0, result
    assert "status 0 0" in result.stdout, result
    one = rank_results(tmp_path / "one", ranks)
    two = rank_results(tmp_path / "two", ranks)
    ended = min((tmp_path / "one" / f"{r}.json").stat().st_mtime for r in range(ranks))
    began = max((tmp_path / "two" / f"{r}.json").stat().st_mtime for r in range(ranks))
    assert began < ended + 8, "the second run waited for the first"
    assert staged_dir(one) != staged_dir(two)
    for results in (one, two):
        assert_on_own_node(results, staged_dir(results))
    assert left_on_nodes(before) == {"n1": set(), "n2": set()}


def slurm_state(job):
    """The state Slurm gives *job* (``""`` once it forgot it)."""
    done = run(["squeue", "-h", "-j", job, "-o", "%T"], env=launcher_env())
    return done.stdout.strip()


@pytest.mark.parametrize(
    "end", ["scancel", pytest.param("time limit", marks=pytest.mark.extended)]
)  # a time limit waits a minute, Slurm's least, and ends the job as scancel does
def test_a_job_ended_before_its_clean_step_is_reaped(
    slurm, env_bundle, shared, app, tmp_path, end
):
    """A job cancelled, or at its time limit, leaves ``DIR``; the next one reaps it.

    The stage marker is the owner record: ``mpistage clean`` lists the stage
    once its job ended, and the next job's stage step removes it.
    """
    before = node_stages()
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    code = "open(sys.argv[1] + '/job', 'w').write(os.environ['SLURM_JOB_ID']); "
    code += "time.sleep(300)"
    launch = ["srun", "-n", "2", shared.python, app]
    command = ["salloc", "-N", "2", "--quiet", "mpistage", "run", "--env", env_bundle]
    limit = ["-t", "1"] if end == "time limit" else []  # a minute, Slurm's least
    first = start(
        [*command[:4], *limit, *command[4:], "--", *launch, one, code], env=slurm
    )
    try:
        wait_for(lambda: (one / "job").exists(), what="the first job's run step")
        job = (one / "job").read_text()
        if end == "scancel":
            assert run(["scancel", job], env=slurm).returncode == 0
        finish(first)
    finally:
        kill_session(first.pid)
    left = left_on_nodes(before)
    assert all(len(names) == 1 for names in left.values()), left  # no clean step
    wait_for(lambda: slurm_state(job) not in ("RUNNING", "COMPLETING"), timeout=60)
    clean = ["env", f"SLURM_CONF={slurm['SLURM_CONF']}", PYTHON, "-m", "mpistage"]
    listed = on_node("n1", *clean, "clean", "--dry-run")
    assert listed.returncode == 0, listed
    assert f"/dev/shm/{left['n1'].pop()}" in listed.stdout, listed

    result = run([*command, "--", *launch, two], env=slurm)
    assert result.returncode == 0, result
    assert left_on_nodes(before) == {"n1": set(), "n2": set()}


def test_srun_stages_with_sbcast_and_the_nodes_own_python(
    slurm, env_bundle, shared, app, out
):
    """Under srun the stage step starts no Python from the shared environment.

    With ``--keep`` the stage stays: complete on both nodes (its marker), and
    the inputs ``sbcast`` brought are gone.
    """
    job = f"keep-{os.getpid()}"
    folder = Path(f"/dev/shm/mpistage-env-test-{job}")
    launch = ["srun", "-n", "4", shared.python, app, out]
    command = ["mpistage", "run", "--env", env_bundle, "--to", folder, "--keep"]
    try:
        result = run(["salloc", "-N", "2", "--quiet", *command, "--", *launch], slurm)
        assert result.returncode == 0, result
        assert_on_own_node(rank_results(out, 4), folder)
        assert shared.starts() == []
        for node in NODES:
            marker = on_node(node, "cat", f"{folder}/.mpistage-stage")
            assert "state=complete" in marker.stdout, (node, marker)
            assert not shm_exists(node, f"{folder}.in"), node
    finally:
        for node in NODES:
            on_node(node, "rm", "-rf", str(folder), f"{folder}.in")


def test_an_inputs_directory_already_on_a_node_is_left_alone(
    slurm, env_bundle, shared, app, out
):
    """``DIR.in`` that exists on a node (the user's own, with results in it)
    is neither adopted nor removed: the stage step refuses on that node."""
    folder = Path(f"/dev/shm/mpistage-env-test-in-{os.getpid()}")
    inputs, kept = f"{folder}.in", f"{folder}.in/results.txt"
    launch = ["srun", "-n", "4", shared.python, app, out]
    command = ["mpistage", "run", "--env", env_bundle, "--to", folder]
    try:
        assert on_node("n1", "mkdir", "-m", "700", inputs).returncode == 0
        assert on_node("n1", "sh", "-c", f"echo work > {kept}").returncode == 0
        result = run(["salloc", "-N", "2", "--quiet", *command, "--", *launch], slurm)
        assert on_node("n1", "cat", kept).stdout == "work\n", result
        assert result.returncode != 0, result
        assert any(inputs in line for line in errors(result.stderr)), result
        assert not shm_exists("n2", inputs)
    finally:
        for node in NODES:
            on_node(node, "rm", "-rf", str(folder), inputs)


@pytest.mark.parametrize(
    "alloc,line,ranks,staged_on",
    [
        ("", "srun --mpi=pmix -N 1 -n 2", 2, ["n1"]),
        ("salloc -N 2", "srun --mpi=pmix -n 4", 4, ["n1", "n2"]),
    ],
)
def test_srun_pmix_open_mpi(
    slurm, ompi, shared_ompi, app, out, alloc, line, ranks, staged_on
):
    """``srun --mpi=pmix`` with Open MPI: the plugin option reaches every step."""
    before = node_stages()
    launch = [*split(line), shared_ompi.python, app, out]
    command = ["mpistage", "run", "--env", ompi[1], "--", *launch]
    if alloc:
        command = [*split(alloc), "--quiet", *command]
    result = run(command, env=slurm)
    assert result.returncode == 0, result
    results = rank_results(out, ranks)
    assert all(r["library"].startswith("Open MPI") for r in results), results
    assert_on_own_node(results, staged_dir(results))
    assert shared_ompi.starts() == []  # sbcast and the nodes' own python
    assert left_on_nodes(before) == {"n1": set(), "n2": set()}


def test_manual_steps_in_an_allocation(slurm, env_bundle, shared, app, out, tmp_path):
    """docs/stage.md's steps by hand, inside ``salloc -N 2``."""
    before = node_stages()
    script = tmp_path / "steps.sh"
    script.write_text(
        "set -eu\n"
        "STAGE=/dev/shm/$USER-$SLURM_JOB_ID-env\n"
        'PER_NODE="srun -N $SLURM_NNODES -n $SLURM_NNODES --ntasks-per-node=1"\n'
        'eval "$($PER_NODE mpistage stage "$1" --to "$STAGE" --print-env)"\n'
        'srun -n 4 python "$2" "$3"\n'
        '$PER_NODE mpistage clean "$STAGE"\n'
    )
    env = dict(slurm, USER="root", PATH=f"{shared.bin}:{slurm['PATH']}")
    command = ["salloc", "-N", "2", "--quiet", "sh", script, env_bundle, app, out]
    result = run(command, env=env)
    assert result.returncode == 0, result
    results = rank_results(out, 4)
    assert_on_own_node(results, staged_dir(results))
    assert left_on_nodes(before) == {"n1": set(), "n2": set()}


# -- Open MPI ------------------------------------------------------------------------


OMPI_FORMS = [
    # (launch line, ranks, emulated nodes)
    ("mpirun -np 4 --oversubscribe", 4, 0),
    ("mpiexec.openmpi -n 2 -H localhost:2 --mca btl self,vader,tcp", 2, 0),
    ("mpirun --hostfile {hostfile} --map-by core -np 3", 3, 0),
    ("mpirun -np 4 --oversubscribe", 4, 2),
]


@pytest.mark.parametrize("line,ranks,emulated", OMPI_FORMS)
def test_open_mpi_mpirun(ompi, shared_ompi, app, out, tmp_path, line, ranks, emulated):
    """Open MPI's mpirun: ``--map-by ppr:1:node`` stages, its rank variables map."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"localhost slots={ranks}\n")
    # As a user of Debian's Open MPI: its mpirun first on PATH, not the wheel's.
    env = dict(launcher_env(), PATH=f"{shared_ompi.bin}:/usr/bin:/bin")
    to = []
    if emulated:
        env["MPISTAGE_EMULATE_NODES"] = str(emulated)
        to = ["--to", tmp_path / "stage" / "n{node}"]
    before = local_stages()
    launch = [*split(line.format(hostfile=hostfile)), shared_ompi.python, app, out]
    command = ["mpistage", "run", "--env", ompi[1], *to, "--", *launch]
    result = run(command, env=env)
    assert result.returncode == 0, result
    results = rank_results(out, ranks)
    assert all(r["library"].startswith("Open MPI") for r in results), results
    assert len(shared_ompi.starts()) == (emulated or 1), shared_ompi.starts()
    if emulated:
        for info in results:
            node = tmp_path / "stage" / f"n{info['rank'] * emulated // ranks}"
            assert info["executable"] == f"{node}/bin/python", info
        assert not (tmp_path / "stage").exists()
    else:
        assert_on_own_node(results, staged_dir(results))
    assert local_stages() - before == set()  # a dead one of before may be reaped


def test_open_mpi_in_an_allocation(slurm, ompi, shared_ompi, app, out):
    """mpirun inside ``salloc -N 2`` starts its daemons with srun: both nodes."""
    before = node_stages()
    launch = ["mpirun", "--map-by", "ppr:2:node", shared_ompi.python, app, out]
    command = ["salloc", "-N", "2", "--quiet", "mpistage", "run", "--env", ompi[1]]
    env = dict(slurm, PATH=f"{shared_ompi.bin}:/usr/bin:/bin")
    result = run([*command, "--", *launch], env=env)
    assert result.returncode == 0, result
    results = rank_results(out, 4)
    assert_on_own_node(results, staged_dir(results))
    assert sorted(r["node"] for r in results) == ["n1", "n1", "n2", "n2"]
    assert shared_ompi.stage_nodes() == ["n1", "n2"], shared_ompi.starts()
    assert left_on_nodes(before) == {"n1": set(), "n2": set()}


# -- Hydra (the MPICH wheel's mpiexec) -----------------------------------------------


def test_hydra_host_file_example(env_bundle, shared, app, out, tmp_path):
    """docs/examples/mpiexec.sh with a two-line host file: both hosts staged.

    Both lines name this machine (``localhost`` and its host name), which
    Hydra starts as two hosts; two emulated nodes give them a copy each.
    """
    hosts = tmp_path / "hosts"
    hosts.write_text(f"localhost\n{HOST}\n")
    env = dict(
        launcher_env(),
        ENV_BUNDLE=str(env_bundle),
        VENV=str(shared.root),
        MPISTAGE_EMULATE_NODES="2",
    )
    before = local_stages()
    script = ROOT / "docs" / "examples" / "mpiexec.sh"
    result = run(["bash", script, hosts, 2, app, out], env=env)
    assert result.returncode == 0, result
    assert sorted(node for node, _ in shared.starts()) == sorted(["localhost", HOST])
    results = rank_results(out, 4)
    folder = staged_dir([results[0]]).parent
    for info in results:
        assert info["executable"] == f"{folder}/n{info['rank'] // 2}/bin/python"
    assert sorted(r["node"] for r in results) == sorted(["localhost", HOST] * 2)
    assert local_stages() == before


@pytest.mark.parametrize(
    "line,ranks,starts",
    [
        ("{mpiexec} -hosts localhost -n 2 -ppn 2", 2, 1),
        ("{mpiexec} -n 3", 3, 1),
    ],
)
def test_hydra(env_bundle, shared, app, out, line, ranks, starts):
    launch = [*split(line.format(mpiexec=MPIEXEC)), shared.python, app, out]
    before = local_stages()
    command = ["mpistage", "run", "--env", env_bundle, "--", *launch]
    result = run(command, env=launcher_env())
    assert result.returncode == 0, result
    results = rank_results(out, ranks)
    assert_on_own_node(results, staged_dir(results))
    assert len(shared.starts()) == starts, shared.starts()
    assert local_stages() == before


def test_hydra_in_an_allocation(slurm, env_bundle, shared, app, out):
    """Hydra inside ``salloc -N 2`` takes the allocation's nodes: both staged."""
    before = node_stages()
    launch = [MPIEXEC, "-n", "4", "-ppn", "2", shared.python, app, out]
    command = ["salloc", "-N", "2", "--quiet", "mpistage", "run", "--env", env_bundle]
    result = run([*command, "--", *launch], env=slurm)
    assert result.returncode == 0, result
    results = rank_results(out, 4)
    assert_on_own_node(results, staged_dir(results))
    assert sorted(r["node"] for r in results) == ["n1", "n1", "n2", "n2"]
    assert shared.stage_nodes() == ["n1", "n2"], shared.starts()
    assert left_on_nodes(before) == {"n1": set(), "n2": set()}


# -- every exit path cleans ------------------------------------------------------------


@pytest.mark.parametrize(
    "alloc,signum",
    [("salloc -N 2", signal.SIGTERM), ("", signal.SIGINT), ("", signal.SIGTERM)],
    ids=["in-salloc-SIGTERM", "outside-SIGINT", "outside-SIGTERM"],
)
def test_signal_during_the_stage_step_cleans(
    slurm, env_bundle, shared, app, out, alloc, signum
):
    """SIGINT or SIGTERM to ``mpistage run`` while the stage step writes.

    Inside ``salloc``, the signal goes to ``mpistage run`` (``salloc`` itself
    would give up the allocation, and no clean step could run); outside an
    allocation, to the ``mpistage run`` that made one.
    """
    before = node_stages()
    launch = ["srun", "-N", "2", "-n", "4", shared.python, app, out]
    command = ["mpistage", "run", "--env", env_bundle, "--", *launch]
    if alloc:
        command = [*split(alloc), "--quiet", *command]
    proc = start(command, slurm)

    def writing():
        return any(node_stages()[n] - before[n] for n in NODES)

    wait_for(writing, what="the stage step to create its directory")
    target = children(proc.pid)[0] if alloc else proc.pid
    os.kill(target, signum)
    status, _out, err = finish(proc)
    assert status == 128 + signum, err
    assert errors(err) == [
        f"mpistage: error: {signum.name} during the stage step; cleaning up"
    ], err
    assert list(out.iterdir()) == []  # the run step never started
    assert left_on_nodes(before) == {"n1": set(), "n2": set()}


def test_failing_run_step_cleans(slurm, env_bundle, shared, app, out):
    """A rank exits 3 under srun: mpistage run says 3, and every node is clean."""
    before = node_stages()
    fail = "MPI.COMM_WORLD.Barrier(); sys.exit(3 if world.rank == 1 else 0)"
    launch = ["srun", "-n", "4", shared.python, app, out, fail]
    command = ["salloc", "-N", "2", "--quiet", "mpistage", "run", "--env", env_bundle]
    result = run([*command, "--", *launch], env=slurm)
    assert result.returncode == 3, result
    assert len(rank_results(out, 4)) == 4
    assert errors(result.stderr) == [], result
    assert left_on_nodes(before) == {"n1": set(), "n2": set()}


def test_signal_during_the_run_step_cleans(slurm, env_bundle, shared, app, out):
    """SIGTERM to mpistage run while the ranks run: passed on, then cleaned."""
    before = node_stages()
    launch = ["srun", "-n", "4", shared.python, app, out, "time.sleep(60)"]
    command = ["mpistage", "run", "--env", env_bundle, "--", *launch]
    proc = start(["salloc", "-N", "2", "--quiet", *command], slurm)
    wait_for(lambda: len(list(out.iterdir())) == 4, what="the ranks to start")
    os.kill(children(proc.pid)[0], signal.SIGTERM)
    status, _out, err = finish(proc)
    assert status == 143, err
    assert errors(err) == ["mpistage: error: SIGTERM during the run step; cleaning up"]
    assert "Traceback" not in err, err
    assert left_on_nodes(before) == {"n1": set(), "n2": set()}


def test_signal_during_the_stage_step_cleans_emulated_nodes(
    env_bundle, shared, app, out, tmp_path
):
    env = dict(launcher_env(), MPISTAGE_EMULATE_NODES="2")
    folder = tmp_path / "stage"
    launch = [MPIEXEC, "-n", "4", shared.python, app, out]
    command = ["mpistage", "run", "--env", env_bundle, "--to", folder / "n{node}"]
    proc = start([*command, "--", *launch], env)
    wait_for(lambda: any(folder.glob("n*/*")), what="the stage step to write")
    proc.send_signal(signal.SIGINT)
    status, _out, err = finish(proc)
    assert status == 130, err
    assert list(out.iterdir()) == []
    assert not folder.exists(), list(folder.rglob("*"))[:5]


@pytest.mark.parametrize(
    "signum", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name
)
def test_signal_during_the_run_step_is_one_line(
    env_bundle, shared, app, out, tmp_path, signum
):
    """SIGINT or SIGTERM while Hydra's ranks run: 128 + N, one line, no traceback.

    What a user sees after Ctrl-C: no rank's KeyboardInterrupt, no Hydra
    banner, the step named, and nothing left of the stage.
    """
    env = dict(launcher_env(), MPISTAGE_EMULATE_NODES="2")
    folder = tmp_path / "stage"
    launch = [MPIEXEC, "-n", "4", shared.python, app, out, "time.sleep(60)"]
    command = ["mpistage", "run", "--env", env_bundle, "--to", folder / "n{node}"]
    proc = start([*command, "--", *launch], env)
    wait_for(lambda: len(list(out.iterdir())) == 4, what="the ranks to start")
    proc.send_signal(signum)
    status, stdout, err = finish(proc)
    assert status == 128 + signum, err
    assert errors(err) == [
        f"mpistage: error: {signum.name} during the run step; cleaning up"
    ], err
    assert "Traceback" not in err and "Ctrl-C" not in stdout + err, (stdout, err)
    assert not folder.exists(), list(folder.rglob("*"))[:5]


def test_failed_stage_step_still_cleans(slurm, env_bundle, shared, app, out):
    """One node refuses the stage (its DIR is not ours): the other is cleaned."""
    folder = Path(f"/dev/shm/stage-refused-{os.getpid()}")
    made = on_node("n2", "sh", "-c", f"mkdir {folder} && echo mine > {folder}/notes")
    assert made.returncode == 0, made
    try:
        launch = ["srun", "-n", "4", shared.python, app, out]
        command = ["mpistage", "run", "--env", env_bundle, "--to", folder]
        result = run(
            ["salloc", "-N", "2", "--quiet", *command, "--", *launch],
            env=slurm,
        )
        assert result.returncode == 1, result
        lines = errors(result.stderr)
        assert len(lines) == 1 and "not empty" in lines[0], result  # said once
        assert list(out.iterdir()) == []
        assert not shm_exists("n1", folder)
        kept = on_node("n2", "cat", f"{folder}/notes")
        assert kept.stdout == "mine\n", kept
    finally:
        on_node("n2", "rm", "-rf", str(folder))


# Rank 0 moves DIR aside and leaves a symlink in its place: the clean step
# refuses the symlink, and mpistage run must say so in its exit status.
TAMPER = """
if world.rank == 0:
    d = os.path.dirname(os.path.dirname(sys.executable))
    os.rename(d, d + ".moved")
    os.symlink(d + ".moved", d)
"""


def test_failed_clean_step_shows_in_the_status(env_bundle, shared, app, out):
    before = local_stages()
    launch = [MPIEXEC, "-n", "2", shared.python, app, out, TAMPER]
    command = ["mpistage", "run", "--env", env_bundle, "--", *launch]
    result = run(command, env=launcher_env())
    folder = staged_dir(rank_results(out, 2))
    try:
        assert result.returncode == 1, result
        lines = errors(result.stderr)
        assert len(lines) == 2, result
        assert "is a symlink, not a stage" in lines[0], result
        assert "the clean step failed" in lines[1], result
    finally:
        folder.unlink(missing_ok=True)
        run(["rm", "-rf", f"{folder}.moved"])
    assert local_stages() == before


# -- the runner under srun -------------------------------------------------------------

FAIL = """\
import os, sys, tinypkg
from mpi4py import MPI
rank = MPI.COMM_WORLD.rank
if rank == 0:
    with open(sys.argv[1], "w") as f:
        f.write(os.environ["SLURM_JOB_ID"])
MPI.COMM_WORLD.Barrier()
if rank == 3:
    raise RuntimeError("rank 3 fails")
MPI.COMM_WORLD.Barrier()
"""


def test_failing_rank_under_srun_leaves_no_copy(slurm, tmp_path):
    """A rank raises under srun; once the next job ran, no copy of it is left.

    srun ends the whole step, the leaders' watchdogs included; the next
    job's leaders reap what dead jobs of this user left on their node.
    """
    site = make_site(tmp_path / "site")
    env = dict(slurm, PYTHONPATH=str(site))
    bundle = pack(tmp_path / "tiny.mpistage", "tinypkg", env=env)
    (tmp_path / "fail.py").write_text(FAIL)
    (tmp_path / "ok.py").write_text("import tinypkg\n")
    job_file = tmp_path / "job"
    runner = [PYTHON, "-m", "mpistage", "--bundle", bundle]
    srun = ["srun", "-w", "n[1-2]", "-N", "2", "-n", "4"]
    segments = {node: mpich_segments(node) for node in NODES}
    user_dir = f"/dev/shm/mpistage-{os.getuid()}"
    try:
        failed = run([*srun, *runner, tmp_path / "fail.py", job_file], env=env)
        assert failed.returncode != 0, failed
        assert "rank 3 fails" in failed.stderr, failed
        job = job_file.read_text()

        second = run([*srun, *runner, tmp_path / "ok.py"], env=env)
        assert second.returncode == 0, second
        time.sleep(0.5)
        for node in NODES:
            listing = on_node(node, "ls", "-A", user_dir)
            left = [n for n in listing.stdout.split() if n.startswith(f"job-{job}-")]
            assert left == [], (node, left)
    finally:
        # What a failing test leaves, and the segments MPICH cannot remove
        # after MPI_Abort, go: the nodes' /dev/shm outlive the test.
        for node in NODES:
            new = mpich_segments(node) - segments[node]
            if job_file.exists():
                on_node(
                    node, "sh", "-c", f"rm -rf {user_dir}/job-{job_file.read_text()}-*"
                )
            if new:
                on_node(node, "rm", "-f", *(f"/dev/shm/{name}" for name in new))


def mpich_segments(node):
    """The MPICH shared-memory segments in *node*'s /dev/shm."""
    return {name for name in shm(node) if name.startswith("mpich_shm_")}


# -- the node boot under real launchers --------------------------------------------


def test_node_boot_under_srun(slurm, tmp_path):
    """``srun -N 2 -n 4`` of the runner: one rank per node imports mpi4py.

    The ranks of each node meet at a place named for the Slurm step and the
    node; the other two take the copy; both places are gone afterwards.
    """
    (tmp_path / "ok.py").write_text("from mpi4py import MPI\n")
    report = tmp_path / "report.json"
    env = dict(slurm, MPISTAGE_REPORT=str(report))
    runner = [PYTHON, Path(PYTHON).parent / "mpistage"]
    srun = ["srun", "-w", "n[1-2]", "-N", "2", "-n", "4"]
    result = run([*srun, *runner, tmp_path / "ok.py"], env=env)
    assert result.returncode == 0, result
    start = json.loads(report.read_text())["start"]
    firsts = start["first"]
    assert len(firsts) == 2 and {r // 2 for r in firsts} == {0, 1}, start
    assert sorted(firsts + start["copy"]) == [0, 1, 2, 3] and start["normal"] == []
    places = {r: fact["place"] for r, fact in enumerate(start["ranks"])}
    assert places[0] == places[1] != places[2] == places[3], places
    assert all("/boot-slurm-" in place for place in places.values()), places
    user_dir = f"/dev/shm/mpistage-{os.getuid()}"
    for node in NODES:
        listing = on_node(node, "ls", "-A", user_dir).stdout.split()
        assert [n for n in listing if n.startswith("boot-")] == [], (node, listing)
