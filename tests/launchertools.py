"""Helpers of the launcher tier: the Slurm test cluster, Open MPI, counted starts.

The tier runs ``mpistage run`` under real launchers: Slurm 22.05 (two
``slurmd``, n1 and n2, on this machine, each with its own /dev/shm; see
scripts/slurm-cluster), Debian's Open MPI (a venv whose mpi4py is built
against it: scripts/openmpi-venv) and the MPICH wheel's Hydra ``mpiexec``.
It needs root (slurmd, mount namespaces) and the Debian packages that
``make test`` installs; without them the whole tier is skipped with one
line.

Open MPI refuses to run as root unless told: every launch here sets
``OMPI_ALLOW_RUN_AS_ROOT=1`` and ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``.
"""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from stagetools import PYTHON, Result, clean_environ

TIMEOUT = 180

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
STATE = Path(os.environ.get("MPISTAGE_SLURM_STATE", "/var/lib/mpistage-ci/slurm"))
NODES = ("n1", "n2")
PACKAGES = "slurm-wlm munge openmpi-bin libopenmpi-dev"
NEEDED = ("slurmctld", "slurmd", "munged", "srun", "mpirun.openmpi", "mpicc.openmpi")
HOST = os.uname().nodename


def run(args, env=None, cwd=None, timeout=TIMEOUT):
    """Run *args*; on timeout kill every process of its session.

    ``salloc`` moves the command it starts to a process group of its own, so
    killing the group is not enough: the session is what they all share.
    """
    start_time = time.monotonic()
    proc = start(args, env, cwd)
    status, out, err = finish(proc, timeout)
    return Result(proc.args, status, out, err, time.monotonic() - start_time)


def missing():
    """Why the tier cannot run here, or ``None``."""
    if os.geteuid() != 0:
        return "needs root (slurmd and its mount namespaces)"
    absent = [name for name in NEEDED if shutil.which(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed (apt-get install {PACKAGES})"
    if shutil.which("nsenter") is None:
        return "nsenter not installed (util-linux)"
    return None


def launcher_env():
    """The environment of every launch: Slurm's configuration, Open MPI as root."""
    env = clean_environ()
    env.update(
        SLURM_CONF=str(STATE / "slurm.conf"),
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        PATH=f"{Path(PYTHON).parent}:{env.get('PATH', '/usr/bin:/bin')}",
    )
    for name in list(env):
        if name.startswith(("SLURM_", "OMPI_", "PMI", "FLUX_")) and name not in (
            "SLURM_CONF",
            "OMPI_ALLOW_RUN_AS_ROOT",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
        ):
            del env[name]
    return env


def bring_up():
    """Start the Slurm cluster (idempotent); fail with its log if it cannot."""
    result = run([SCRIPTS / "slurm-cluster", "up"], timeout=120)
    assert result.returncode == 0, result
    return launcher_env()


def source_venv(mpi):
    """Return the python of the venv whose mpi4py is built against *mpi*.

    *mpi* is ``openmpi`` or ``mpich`` (scripts/source-venv; built once, cached).
    """
    result = run([SCRIPTS / "source-venv", mpi], cwd=ROOT, timeout=1200)
    assert result.returncode == 0, result
    return Path(result.stdout.split()[-1])


def openmpi_venv():
    """Return the python of the Open MPI venv (built once, cached)."""
    return source_venv("openmpi")


# What scripts/source-venv needs of each MPI: its launcher and compiler wrapper.
SOURCE_MPIS = {
    "openmpi": ("openmpi-bin libopenmpi-dev", ("mpiexec.openmpi", "mpicc.openmpi")),
    "mpich": ("mpich libmpich-dev", ("mpiexec.mpich", "mpicc.mpich")),
}


def source_missing():
    """Why the source-built MPI venvs cannot be made here, or ``None``."""
    packages = [
        p for p, tools in SOURCE_MPIS.values() if not all(map(shutil.which, tools))
    ]
    if packages:
        return f"not installed (apt-get install {' '.join(packages)})"
    return None


# -- what a node holds ----------------------------------------------------------


def slurmd_pid(node):
    """The pid of *node*'s slurmd, whose mount namespace is the node's."""
    return int((STATE / f"slurmd-{node}.pid").read_text())


def on_node(node, *command):
    """Run *command* in *node*'s mount namespace (its own /dev/shm)."""
    prefix = ["nsenter", "-t", str(slurmd_pid(node)), "-m", "--"]
    return run([*prefix, *command], timeout=30)


def shm(node):
    """The names in *node*'s /dev/shm."""
    result = on_node(node, "ls", "-A", "/dev/shm")
    assert result.returncode == 0, result
    return set(result.stdout.split())


def shm_exists(node, path):
    """Whether *path* exists in *node*'s mount namespace."""
    return on_node(node, "test", "-e", str(path)).returncode == 0


def stages(names):
    """The ``mpistage run`` stage directories among *names* (of /dev/shm)."""
    return {n for n in names if n.startswith("mpistage-env-")}


# -- counting the Python starts of the shared environment -----------------------

COUNTER = """#!/bin/sh
echo "start ${{SLURMD_NODENAME:-${{PMI_HOSTNAME:-$(uname -n)}}}} $*" >> {log}
exec {python} "$@"
"""


class Shared:
    """A stand-in for the shared environment: ``bin/python`` counts its starts.

    ``bin/python`` logs one line per start (with the node it ran on) and
    execs *python*; ``bin/mpistage`` is *python*'s. Only the stage step
    should start it: the run step starts the staged python, and the clean
    step starts no Python at all.
    """

    def __init__(self, root, python=PYTHON):
        self.root = Path(root)
        self.bin = self.root / "bin"
        self.bin.mkdir(parents=True)
        self.log = self.root / "starts.log"
        self.python = self.bin / "python"
        self.python.write_text(COUNTER.format(log=self.log, python=python))
        self.python.chmod(0o755)
        (self.bin / "mpistage").symlink_to(Path(python).parent / "mpistage")

    def starts(self):
        """[(node, arguments)] of every start so far."""
        if not self.log.exists():
            return []
        lines = self.log.read_text().splitlines()
        return [tuple(line.split(" ", 2)[1:]) for line in lines]

    def stage_nodes(self):
        """The sorted nodes the stage step ran on, one entry per start."""
        starts = self.starts()
        assert all(" stage " in f" {args} " for _node, args in starts), starts
        return sorted(node for node, _args in starts)


# -- the application -------------------------------------------------------------

APP = """\
import json, os, sys, time
from mpi4py import MPI
world = MPI.COMM_WORLD
exe = os.path.realpath("/proc/self/exe")
node = (os.environ.get("SLURMD_NODENAME") or os.environ.get("PMI_HOSTNAME")
        or os.uname().nodename)
info = {"rank": world.rank, "size": world.size, "sum": world.allreduce(1),
        "executable": sys.executable, "exe": exe, "prefix": sys.prefix,
        "mpi": MPI.__file__, "library": MPI.Get_library_version().splitlines()[0],
        "node": node, "exe_dev": os.stat(exe).st_dev,
        "shm_dev": os.stat("/dev/shm").st_dev}
with open(os.path.join(sys.argv[1], f"{world.rank}.json"), "w") as f:
    json.dump(info, f)
if len(sys.argv) > 2:
    exec(sys.argv[2])
"""


def write_app(folder):
    """Write the application: one JSON file per rank into ``argv[1]``."""
    path = Path(folder) / "app.py"
    path.write_text(APP)
    return path


def rank_results(out, ranks):
    """The results of ranks 0..ranks-1 in *out*, checking all are there."""
    found = {p.stem: json.loads(p.read_text()) for p in Path(out).glob("*.json")}
    assert sorted(found) == sorted(str(r) for r in range(ranks)), found
    return [found[str(r)] for r in range(ranks)]


def staged_dir(results):
    """The one directory every rank's interpreter came from (``DIR``)."""
    dirs = {str(Path(r["executable"]).parent.parent) for r in results}
    assert len(dirs) == 1, dirs
    return Path(dirs.pop())


def assert_on_own_node(results, folder):
    """Every rank ran ``folder/bin/python`` from its own node's /dev/shm."""
    for info in results:
        assert info["executable"] == f"{folder}/bin/python", info
        assert Path(info["exe"]).is_relative_to(folder), info
        assert info["exe_dev"] == info["shm_dev"], info
        assert info["sum"] == info["size"] == len(results), info
    devices = {}
    for info in results:
        devices.setdefault(info["node"], set()).add(info["shm_dev"])
    assert all(len(d) == 1 for d in devices.values()), devices
    assert len({d.pop() for d in devices.values()}) == len(devices), devices


# -- runs that are interrupted -------------------------------------------------


def start(args, env, cwd=None):
    """Start *args* in its own session; return the process."""
    return subprocess.Popen(
        [str(a) for a in args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for(check, timeout=60, what="the condition"):
    """Poll *check* until true; fail after *timeout* seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def finish(proc, timeout=TIMEOUT):
    """Wait for *proc*; return (status, stdout, stderr), killing its session if late."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s: {proc.args!r}\n{out}\n{err}")
    finally:
        kill_session(proc.pid)  # whatever outlived it
    return proc.returncode, out, err


def kill_session(sid):
    """SIGKILL every process of the session *sid*."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == sid:
            try:
                os.kill(int(stat.parent.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def errors(text):
    """The ``mpistage: error:`` lines of *text*."""
    return [line for line in text.splitlines() if line.startswith("mpistage: error:")]
