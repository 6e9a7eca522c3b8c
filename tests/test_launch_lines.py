"""How ``mpistage run`` reads launch lines: one task per node, options kept.

No launcher runs here (the launcher tier, test_launchers.py, runs them for
real): these tests pin down, for each form users write, the stage step's
prefix, the node count, and the one-line refusal of forms not understood.
The environment is set as the launcher would set it (an allocation's
``SLURM_*``, ``MPISTAGE_EMULATE_NODES``).
"""

import os
import shutil
import sys

import pytest

from mpistage import StageError
from mpistage.cli.launchers import Hydra, OpenMPI, hostnames, understand
from mpistage.cli.run import main, node_index
from stagetools import clean_environ, mpistage

ALLOCATION = {
    "SLURM_JOB_ID": "7",
    "SLURM_NNODES": "3",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_JOB_NODELIST": "n[1-3]",
    "SLURM_NTASKS": "12",
}


@pytest.fixture
def environ(monkeypatch):
    """Set launcher variables for one test; none from the outside leak in."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "PBS_", "FLUX_", "MPISTAGE_")):
            monkeypatch.delenv(name)

    def setenv(values):
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return setenv


def stage_prefix(line, launcher=None):
    launch = understand([*line.split(), "python", "app.py"], launcher)
    return " ".join(launch.stage_prefix())


@pytest.mark.parametrize(
    "line,prefix",
    [
        ("srun -n 12", "srun -N 3 -n 3 --ntasks-per-node=1 --overlap"),
        (
            "srun -n12 --mpi=pmix",
            "srun -N 3 -n 3 --ntasks-per-node=1 --overlap --mpi=pmix",
        ),
        (
            "srun -N 1 -n 4 --mpi pmi2",
            "srun -N 3 -n 3 --ntasks-per-node=1 --overlap --mpi pmi2",
        ),
        ("srun -w n2 -n 2", "srun -N 3 -n 3 --ntasks-per-node=1 --overlap"),
        (
            "srun -x n[1-2] -n 2",
            "srun -N 1 -n 1 --ntasks-per-node=1 --overlap -x n[1-2]",
        ),
        (
            "srun --ntasks-per-node=4 -c 2 --cpu-bind=cores -p big -t 10 --export=ALL",
            "srun -N 3 -n 3 --ntasks-per-node=1 --overlap --export=ALL",
        ),
        ("srun -n 4 -o out.txt -l", "srun -N 3 -n 3 --ntasks-per-node=1 --overlap -l"),
        (
            "srun -n 4 env OMP_NUM_THREADS=1",
            "srun -N 3 -n 3 --ntasks-per-node=1 --overlap env OMP_NUM_THREADS=1",
        ),
    ],
)
def test_srun_in_an_allocation_stages_every_node(environ, line, prefix):
    environ(ALLOCATION)
    assert stage_prefix(line) == prefix


def test_srun_outside_an_allocation_makes_one(environ):
    line = "srun -N 2 -n 8 --mpi=pmix -p debug -t 5 -w n[1-2] --cpu-bind=cores python"
    launch = understand([*line.split(), "app.py"])
    allocation = "salloc --quiet -N 2 -n 8 -p debug -t 5 -w n[1-2] --cpu-bind=cores"
    assert launch.allocation() == allocation.split()
    environ(
        dict(
            ALLOCATION,
            SLURM_NNODES="2",
            SLURM_JOB_NUM_NODES="2",
            SLURM_JOB_NODELIST="n[1-2]",
        )
    )
    assert launch.allocation() is None
    assert launch.stage_prefix() == [
        "srun",
        "-N",
        "2",
        "-n",
        "2",
        "--ntasks-per-node=1",
        "--overlap",
        "--mpi=pmix",
    ]


@pytest.fixture
def hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# the job's hosts\nnode1 slots=4\nnode2:4\n\nnode3\nnode1\n")
    return path


@pytest.mark.parametrize(
    "line,prefix",
    [
        ("mpirun -np 8 --oversubscribe", "mpirun --map-by ppr:1:node --oversubscribe"),
        (
            "mpirun -n 8 -H a:4,b:4 --mca btl self,tcp -x FOO",
            "mpirun --map-by ppr:1:node -H a:4,b:4 --mca btl self,tcp -x FOO",
        ),
        (
            "mpirun --hostfile {hosts} --map-by ppr:4:node --bind-to core -N 4",
            "mpirun --map-by ppr:1:node --hostfile {hosts}",
        ),
        (
            "mpirun -np 4 -mca pml ob1 -host a,b",
            "mpirun --map-by ppr:1:node -mca pml ob1 -host a,b",
        ),
    ],
)
def test_open_mpi(environ, hostfile, line, prefix, monkeypatch):
    monkeypatch.setattr("mpistage.cli.launchers.mpi_family", lambda word: OpenMPI)
    assert stage_prefix(line.format(hosts=hostfile)) == prefix.format(hosts=hostfile)


@pytest.mark.parametrize(
    "line,prefix",
    [
        ("mpiexec -n 8 -ppn 4 -f {hosts}", "mpiexec -n 3 -ppn 1 -f {hosts}"),
        ("mpiexec -np 8 -hostfile {hosts}", "mpiexec -n 3 -ppn 1 -hostfile {hosts}"),
        (
            "mpiexec -n 8 -hosts a:4,b:4 -genv A 1",
            "mpiexec -n 2 -ppn 1 -hosts a:4,b:4 -genv A 1",
        ),
        ("mpiexec -n 8 --bind-to core", "mpiexec -n 1 -ppn 1"),
    ],
)
def test_hydra(environ, hostfile, line, prefix, monkeypatch):
    monkeypatch.setattr("mpistage.cli.launchers.mpi_family", lambda word: Hydra)
    assert stage_prefix(line.format(hosts=hostfile)) == prefix.format(hosts=hostfile)


def test_hydra_and_open_mpi_take_the_allocation(environ, monkeypatch):
    environ(ALLOCATION)
    monkeypatch.setattr("mpistage.cli.launchers.mpi_family", lambda word: Hydra)
    assert stage_prefix("mpiexec -n 12") == "mpiexec -n 3 -ppn 1"
    monkeypatch.setattr("mpistage.cli.launchers.mpi_family", lambda word: OpenMPI)
    assert understand("mpirun -np 12 python".split()).nodes() == 3


def test_emulated_nodes(environ, monkeypatch):
    environ({"MPISTAGE_EMULATE_NODES": "2"})
    monkeypatch.setattr("mpistage.cli.launchers.mpi_family", lambda word: OpenMPI)
    assert stage_prefix("mpirun -np 4 --oversubscribe") == (
        "mpirun -np 2 --oversubscribe"
    )
    monkeypatch.setattr("mpistage.cli.launchers.mpi_family", lambda word: Hydra)
    assert stage_prefix("mpiexec -n 4") == "mpiexec -n 2 -ppn 1"


def test_flux(environ):
    assert stage_prefix("flux run -N 4 -n 16 -o cpu-affinity=per-task") == (
        "flux run -N 4 --tasks-per-node=1 -o cpu-affinity=per-task"
    )


def test_stage_launcher_replaces_the_prefix(environ):
    assert stage_prefix("aprun -n 64", "aprun -n 2 -N 1") == "aprun -n 2 -N 1"


def test_mpi_family_by_name_and_by_version():
    from mpistage.cli.launchers import mpi_family

    if shutil.which("mpirun.openmpi"):
        assert mpi_family("mpirun.openmpi") is OpenMPI
    wheel = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(wheel):
        assert mpi_family(wheel) is Hydra  # asked with --version


@pytest.mark.parametrize(
    "line,words",
    [
        (
            "srun --het-group=0 -n 4 python app.py",
            ["--het-group=0", "--stage-launcher"],
        ),
        ("srun --multi-prog conf", ["no python"]),
        ("aprun -n 64 python app.py", ["unknown launcher 'aprun'", "--stage-launcher"]),
        ("mpiexec.hydra -n 4 -configfile f python app.py", ["-configfile", "(Hydra)"]),
        ("mpiexec.hydra -n 2 python a.py : -n 2 python b.py", ["several programs"]),
        ("mpirun.openmpi --app f python app.py", ["'--app'", "(Open MPI)"]),
        ("flux submit -n 4 python app.py", ["flux run"]),
    ],
)
def test_a_form_not_understood_gets_one_line(environ, line, words):
    with pytest.raises(StageError) as caught:
        understand(line.split())
    message = str(caught.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_refusal_is_one_line_from_the_command(tmp_path):
    bundle = tmp_path / "env.mpistage"
    bundle.write_bytes(b"")
    line = ["srun", "--het-group=0", "python", "app.py"]
    result = mpistage(["run", "--env", bundle, "--", *line], clean_environ())
    assert result.returncode == 1, result
    assert result.stderr.count("\n") == 1, result
    assert "--stage-launcher" in result.stderr, result


def test_host_lists():
    assert hostnames("n[1-3,07],gpu01,r[1-2]n[01-02]") == [
        "n1",
        "n2",
        "n3",
        "n07",
        "gpu01",
        "r1n01",
        "r1n02",
        "r2n01",
        "r2n02",
    ]


def test_node_index_follows_each_launchers_rank(environ, tmp_path):
    """The run step's shell finds a rank's node from each launcher's variables."""
    import subprocess

    def index(variables):
        env = {"PATH": "/usr/bin:/bin", **variables}
        script = f"echo {node_index(2)}"
        return subprocess.run(
            ["sh", "-c", script], env=env, capture_output=True, text=True, timeout=10
        ).stdout.strip()

    environ({"MPISTAGE_EMULATE_NODES": "2"})
    cases = [
        ({"PMI_RANK": "3", "PMI_SIZE": "4"}, "1"),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}, "0"),
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"}, "1"),
        ({"PMIX_RANK": "3", "SLURM_NTASKS": "4"}, "1"),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_NODEID": "1"}, "0"),
        ({"FLUX_TASK_RANK": "2", "FLUX_JOB_SIZE": "4"}, "1"),
    ]
    for variables, expected in cases:
        assert index(variables) == expected, variables


def test_run_refuses_before_launching_anything(environ, tmp_path):
    with pytest.raises(StageError):
        main(["--env", str(tmp_path / "e.mpistage"), "--", "aprun", "python", "x.py"])
    to = str(tmp_path / "n{node}")
    with pytest.raises(StageError, match="is for emulated nodes"):
        main(["--env", "e.mpistage", "--to", to, "--", "srun", "python", "x.py"])


def test_srun_arbitrary_allocates_the_host_files_nodes(environ, tmp_path):
    """``-m arbitrary``: ``salloc`` gets the file's distinct nodes, never the file."""
    hosts = tmp_path / "hosts"
    hosts.write_text("n1\nn1\nn1\nn2\n")
    environ({"SLURM_HOSTFILE": str(hosts), "PATH": "/usr/bin:/bin"})
    launch = understand("srun -m arbitrary -n 4 -p debug python app.py".split())
    assert launch.allocation() == [
        "salloc", "--quiet", "-n", "4", "-p", "debug", "-N", "2", "-w", "n1,n2",
        "env", f"SLURM_HOSTFILE={hosts}",
    ]  # fmt: skip
    assert "SLURM_HOSTFILE" not in launch.step_environ()
    plain = understand("srun -n 4 python app.py".split())
    assert plain.allocation() == "salloc --quiet -n 4".split()
