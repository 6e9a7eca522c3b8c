"""Size in the suite: a GPU-shaped stack in every mode, on two MPIs.

The stack is ``fakegpu`` (tests/gpustack.py): a C extension linked to three
big libraries that live in sibling ``nvidia/fakecuN/lib`` distributions, as
CUDA wheels lay them out. Each mode runs it at 2 and 4 ranks on 2 emulated
nodes, on the MPICH wheel (``.venv``) and on Debian's Open MPI
(``.venv-openmpi``, scripts/source-venv):

- plain ``python app.py``;
- ``pack fakegpu``, then ``--bundle``;
- live imports, no bundle;
- ``--auto`` twice (the first run records, the second replays);
- ``mpistage record`` of one process, then ``--bundle``;
- ``pack --env`` of a venv holding the stack, then ``mpistage run --env``
  and ``mpistage-env``.

What a user notices, on every rank: it ran, the extension called into all
three libraries, the extension and the libraries were mapped from its
node's copy (from the originals in plain runs), and no rank held much more
than the stack once (its peak RSS below 1.5 times the stack's size plus a
constant); with a bundle or live imports, no rank held a quarter of it
(the bytes go in pieces, from file to file).

The pieces are small here (``MPISTAGE_PIECE_SIZE``, :data:`PIECES`), so
that even the 60 MB stack travels in many of them, in every mode.

The stack is ``MPISTAGE_GPUSIZE`` bytes (default 60MB, built once and
cached, see gpustack); ``MPISTAGE_GPUSIZE=2.5GB`` makes a run past what one
MPI message can hold (2^31-1 bytes), for the broadcast's chunks; that run
takes several minutes per MPI and several GB of disk. ``--auto`` and the
environment modes run at 4 ranks only, unless ``MPISTAGE_GPUSIZE_FULL=1``
(each of their launches unpacks a whole copy per node). Markers
``gpusize`` and ``slow``; ``pytest -m "not gpusize"`` leaves the tier out. The same
matrix at GB size, timed: ``python -m mpistage.bench.campaigns.gpusize``.
"""

import json
import os
import shutil
from pathlib import Path

import pytest

from launchertools import source_missing, source_venv
from mpistage.bench.generate import gpustack
from stagetools import MPIEXEC, PYTHON, clean_environ, mpistage, run

# Slow too, so that ``make test-fast`` leaves it out.
pytestmark = [
    pytest.mark.gpusize,
    pytest.mark.slow,
    pytest.mark.usefixtures("reap_mpich_shm"),
]

ROOT = Path(__file__).resolve().parent.parent
MPISTAGE_ENV = ROOT / "bin" / "mpistage-env"
SIZE = gpustack.parse_size(os.environ.get("MPISTAGE_GPUSIZE", "60MB"))
NODES = 2
RANK_COUNTS = (2, 4)
# The modes that unpack a whole environment or run twice cost about 25 s a
# launch on 2 cores: at 4 ranks only (two a node), unless the full matrix
# is asked for.
FULL = os.environ.get("MPISTAGE_GPUSIZE_FULL", "") not in ("", "0", "no")
HEAVY_RANK_COUNTS = RANK_COUNTS if FULL else (4,)
# Per launch: generous, so that a hang fails and a 2.5 GB run does not.
TIMEOUT = int(os.environ.get("MPISTAGE_GPUSIZE_TIMEOUT", 120 + SIZE // 10**7))
# What a rank holds besides the bundle: the interpreter, mpi4py, MPI's buffers.
RSS_CONSTANT = 256 << 20
PIECES = str(1 << 20)  # bytes: MPISTAGE_PIECE_SIZE, 60 pieces of the 60 MB stack
BUNDLE_HELD = 0.25  # of the stack, at most, held by a rank that stages a bundle

APP = """\
import json, os, resource, sys
from mpi4py import MPI
import fakegpu
world = MPI.COMM_WORLD
value = fakegpu.compute()
with open("/proc/self/status") as f:
    hwm = [int(line.split()[1]) for line in f if line.startswith("VmHWM:")][0]
peak = max(hwm, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
facts = {"rank": world.rank, "size": world.size, "sum": world.allreduce(1),
         "value": value, "maps": fakegpu.mapped(), "peak": peak,
         "executable": sys.executable}
out = os.environ["MPISTAGE_TEST_OUT"]
with open(os.path.join(out, f"{world.rank}.json"), "w") as f:
    json.dump(facts, f)
"""


class Flavour:
    """One MPI: its python, how to launch N ranks, its environment."""

    def __init__(self, mpi, python, base):
        self.mpi, self.python, self.base = mpi, Path(python), base
        self.bin = self.python.parent
        self.app = base / "app.py"
        self.app.write_text(APP)
        self.bundles = {}
        env = {
            k: v
            for k, v in clean_environ().items()
            if not k.startswith(("OMPI_", "PMI", "PMIX_", "HYDRA_", "SLURM_"))
        }
        env.pop("VIRTUAL_ENV", None)
        self.env = dict(
            env,
            PATH=f"{self.bin}:/usr/local/bin:/usr/bin:/bin",
            MPISTAGE_STAGE_FALLBACK="no",
            MPISTAGE_EMULATE_NODES=str(NODES),
            MPISTAGE_PIECE_SIZE=PIECES,
            OMPI_ALLOW_RUN_AS_ROOT="1",
            OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
            OMPI_MCA_rmaps_base_oversubscribe="1",
        )

    def launcher(self, ranks):
        """The command line that starts *ranks* processes."""
        if self.mpi == "openmpi":
            return ["mpiexec.openmpi", "--oversubscribe", "-n", str(ranks)]
        return [MPIEXEC, "-n", str(ranks)]

    def tool(self, args, env, cwd=None):
        """Run ``python -m mpistage ARGS`` of this MPI's venv, asserting success."""
        command = [self.python, "-m", "mpistage", *args]
        result = run(command, env=env, cwd=cwd or self.base, timeout=TIMEOUT)
        assert result.returncode == 0, repr(result)
        return result


@pytest.fixture(scope="session")
def stack():
    """The site directory of the stack, built once (cached across sessions)."""
    if shutil.which("objcopy") is None:
        pytest.skip("no objcopy (apt-get install binutils)")
    try:
        return gpustack.stack(SIZE)
    except RuntimeError as error:
        pytest.skip(f"cannot build the GPU-shaped stack: {error}")


@pytest.fixture(scope="module", params=["mpich", "openmpi"])
def flavour(request, tmp_path_factory):
    """Each MPI in turn: the MPICH wheel, then Debian's Open MPI."""
    if request.param == "openmpi":
        if source_missing():
            pytest.skip(f"no Open MPI venv: {source_missing()}")
        python = source_venv("openmpi")
    else:
        if MPIEXEC is None:
            pytest.skip("no mpiexec next to this Python nor on PATH")
        python = PYTHON
    return Flavour(request.param, python, tmp_path_factory.mktemp(request.param))


class Job:
    """One launch's place to stage and to write results."""

    def __init__(self, flavour, name):
        self.folder = flavour.base / name
        shutil.rmtree(self.folder, ignore_errors=True)
        self.out = self.folder / "out"
        self.stage = self.folder / "stage"
        self.out.mkdir(parents=True)
        self.stage.mkdir(mode=0o700)
        self.report = self.folder / "report.json"

    def env(self, flavour, **extra):
        """The job's environment: its stage place, report and results."""
        return dict(
            flavour.env,
            MPISTAGE_STAGE_DIR=str(self.stage),
            MPISTAGE_REPORT=str(self.report),
            MPISTAGE_TEST_OUT=str(self.out),
            **extra,
        )

    def facts(self, result, ranks):
        """Every rank's facts; the job must have succeeded and all written."""
        assert result.returncode == 0, repr(result)
        found = sorted(p.name for p in self.out.glob("*.json"))
        assert found == sorted(f"{r}.json" for r in range(ranks)), repr(result)
        return [json.loads((self.out / f"{r}.json").read_text()) for r in range(ranks)]

    def read_report(self):
        """The job's JSON report, or ``None``."""
        return json.loads(self.report.read_text()) if self.report.exists() else None


def launch(flavour, job, ranks, command, **extra):
    """Run LAUNCHER COMMAND in the job's environment; return (facts, report)."""
    env = job.env(flavour, **extra)
    argv = [*flavour.launcher(ranks), *command]
    result = run(argv, env=env, cwd=job.folder, timeout=TIMEOUT)
    return job.facts(result, ranks), job.read_report()


def node_of(rank, ranks):
    """The emulated node of *rank*: contiguous blocks of ranks."""
    return rank * NODES // ranks


def on_node(path, root, node):
    """Whether *path* lies below *root*, in a place named for *node*."""
    parts = Path(path).relative_to(root).parts if below(path, root) else ()
    return any(p == f"n{node}" or p.endswith(f".n{node}") for p in parts)


def below(path, root):
    return str(path).startswith(str(root).rstrip("/") + "/")


def check(ranks, facts, stack, copies=None, held=1.5):
    """What a user notices: every rank ran, on its node's copy, in little memory.

    *copies* is the folder below which each node's copy lies; ``None`` for a
    plain run, whose files are the originals in *stack*. No rank's peak RSS
    exceeds *held* times the stack, plus what a rank holds anyway.
    """
    assert [f["rank"] for f in facts] == list(range(ranks))
    for f in facts:
        assert f["sum"] == ranks and f["size"] == ranks, f
        assert f["value"] == gpustack.EXPECTED, f
        assert sorted(f["maps"]) == sorted(gpustack.NAMES), f
        for name, path in f["maps"].items():
            if copies is None:
                assert below(path, stack), (f["rank"], name, path)
            else:
                node = node_of(f["rank"], ranks)
                assert on_node(path, copies, node), (f["rank"], name, path)
    limit = held * gpustack.size_of(stack) + RSS_CONSTANT
    for f in facts:
        assert f["peak"] < limit, (f["rank"], f["peak"], limit)


def no_copy_left(job):
    """Each node's copy is removed once the job has ended."""
    assert list(job.stage.glob("mpistage-*/job-*")) == [], list(job.stage.rglob("*"))


@pytest.mark.parametrize("ranks", RANK_COUNTS)
def test_plain(flavour, stack, ranks):
    job = Job(flavour, f"plain-{ranks}")
    command = [flavour.python, flavour.app]
    facts, _ = launch(flavour, job, ranks, command, PYTHONPATH=str(stack))
    check(ranks, facts, stack)


def bundle(flavour, stack, name, make):
    """The flavour's bundle *name*, made once by ``make(path, env)``."""
    if name not in flavour.bundles:
        path = flavour.base / f"{name}.mpistage"
        env = dict(flavour.env, PYTHONPATH=str(stack))
        make(path, env)
        flavour.bundles[name] = path
    return flavour.bundles[name]


def runner(flavour, job, ranks, stack, options):
    """``LAUNCHER python -m mpistage OPTIONS app.py`` with the stack on the path."""
    command = [flavour.python, "-m", "mpistage", *options, flavour.app]
    return launch(flavour, job, ranks, command, PYTHONPATH=str(stack))


@pytest.mark.parametrize("ranks", RANK_COUNTS)
def test_bundle_packed_by_name(flavour, stack, ranks):
    """``pack fakegpu``: the libraries of its sibling distributions come too."""

    def make(path, env):
        flavour.tool(["pack", "-q", "-o", path, "fakegpu"], env)

    path = bundle(flavour, stack, "packed", make)
    job = Job(flavour, f"bundle-{ranks}")
    facts, report = runner(flavour, job, ranks, stack, ["--bundle", path])
    check(ranks, facts, stack, job.stage, held=BUNDLE_HELD)
    assert report["bundle_bytes"] > gpustack.size_of(stack), report
    no_copy_left(job)


@pytest.mark.parametrize("ranks", RANK_COUNTS)
def test_live_without_a_bundle(flavour, stack, ranks):
    job = Job(flavour, f"live-{ranks}")
    facts, report = runner(flavour, job, ranks, stack, [])
    check(ranks, facts, stack, job.stage, held=BUNDLE_HELD)
    assert report["live"]["mode"] == "live", report
    assert report["live"]["read_bytes"] > gpustack.size_of(stack) * 0.9, report
    no_copy_left(job)


@pytest.mark.parametrize("ranks", HEAVY_RANK_COUNTS)
def test_auto_twice(flavour, stack, ranks):
    cache = flavour.base / f"auto-cache-{ranks}"
    options = ["--auto", "--cache-dir", cache]
    job = Job(flavour, f"auto-first-{ranks}")
    facts, report = runner(flavour, job, ranks, stack, options)
    check(ranks, facts, stack, job.stage)
    assert report["auto"].startswith("recorded"), report
    job = Job(flavour, f"auto-second-{ranks}")
    facts, report = runner(flavour, job, ranks, stack, options)
    check(ranks, facts, stack, job.stage, held=BUNDLE_HELD)
    assert report["auto"] == "replayed", report
    assert report["bundle_bytes"] > gpustack.size_of(stack), report
    no_copy_left(job)


@pytest.mark.parametrize("ranks", RANK_COUNTS)
def test_record_then_replay(flavour, stack, ranks):
    def make(path, env):
        out = flavour.base / "record-out"
        out.mkdir(exist_ok=True)
        env = dict(env, MPISTAGE_TEST_OUT=str(out))
        command = ["record", "-o", path, "--", flavour.python, flavour.app]
        flavour.tool(command, env)

    path = bundle(flavour, stack, "recorded", make)
    job = Job(flavour, f"record-{ranks}")
    facts, report = runner(flavour, job, ranks, stack, ["--bundle", path])
    check(ranks, facts, stack, job.stage, held=BUNDLE_HELD)
    assert report["bundle_bytes"] > gpustack.size_of(stack), report
    no_copy_left(job)


# -- a whole environment -------------------------------------------------------


def stack_venv(flavour, stack):
    """A venv of the base interpreter with the flavour's mpi4py and the stack."""
    from envtools import Venv, base_interpreter, build_venv

    prefix = flavour.base / "venv"
    shutil.rmtree(prefix, ignore_errors=True)  # a failed try's
    if flavour.mpi == "mpich":
        venv = build_venv(prefix)
    else:
        made = run([base_interpreter(), "-m", "venv", "--without-pip", prefix])
        assert made.returncode == 0, made
        venv = Venv(prefix, base_interpreter())
        theirs = next(flavour.bin.parent.glob("lib/python*/site-packages"))
        for entry in [theirs / "mpi4py", *theirs.glob("mpi4py-*.dist-info")]:
            shutil.copytree(entry, venv.site / entry.name, symlinks=True)
    gpustack.link_tree(stack, venv.site)
    return venv


def env_bundle(flavour, stack):
    """``pack --env`` of the stack's venv, made once per flavour."""

    def make(path, env):
        venv = stack_venv(flavour, stack)
        env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        # The tool of this venv: pack --env needs pyelftools, which a
        # source-built venv (mpistage installed --no-deps) lacks.
        args = ["pack", "--env", venv.prefix, "-q", "-o", path]
        result = mpistage(args, env, timeout=TIMEOUT)
        assert result.returncode == 0, repr(result)
        flavour.venv = venv

    path = bundle(flavour, stack, "env", make)
    return path, flavour.venv


@pytest.mark.parametrize("ranks", HEAVY_RANK_COUNTS)
def test_env_with_mpistage_run(flavour, stack, ranks):
    path, venv = env_bundle(flavour, stack)
    job = Job(flavour, f"run-env-{ranks}")
    to = job.folder / "run" / "n{node}"
    launcher = flavour.launcher(ranks)
    if flavour.mpi == "openmpi":  # mpistage run reads Open MPI's mpirun
        launcher = ["mpirun", *launcher[1:]]
    # The python of the environment where mpistage is installed, as users
    # write it: mpistage run starts the stage step with it, and the ranks
    # with the staged interpreter.
    command = [*launcher, flavour.python, flavour.app]
    args = ["run", "--env", path, "--to", to, "--", *command]
    env = job.env(flavour)
    result = mpistage(args, env, timeout=TIMEOUT)
    facts = job.facts(result, ranks)
    check(ranks, facts, venv.site, job.folder / "run")
    assert not (job.folder / "run").exists()  # cleaned on every node


@pytest.mark.parametrize("ranks", HEAVY_RANK_COUNTS)
def test_env_with_mpistage_env(flavour, stack, ranks):
    path, venv = env_bundle(flavour, stack)
    job = Job(flavour, f"mpistage-env-{ranks}")
    command = [MPISTAGE_ENV, path, "--", "python", flavour.app]
    facts, _ = launch(flavour, job, ranks, command)
    check(ranks, facts, venv.site, job.stage)


# -- a distributed program without MPI ----------------------------------------

JAX_DISTS = ("jax", "jaxlib", "ml_dtypes", "opt_einsum")

# jax's own coordinator and gloo, on CPU: the launcher only starts processes
# and names each one's rank; nothing loads MPI.
JAX_APP = """\
import json, os, sys
import jax
rank = int(os.environ["PMI_RANK"])
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=os.environ["COORDINATOR"],
                           num_processes=2, process_id=rank,
                           initialization_timeout=120)
import jax.numpy as jnp
from jax.experimental import multihost_utils
gathered = multihost_utils.process_allgather(jnp.array([rank + 1]))
with open("/proc/self/maps") as f:
    mpi = sorted({line.split()[-1] for line in f if "libmpi" in line})
facts = {"rank": rank, "index": jax.process_index(), "count": jax.process_count(),
         "gathered": [int(x) for x in gathered.ravel()], "jax": jax.__file__,
         "executable": sys.executable, "mpi4py": "mpi4py" in sys.modules,
         "libmpi": mpi}
jax.distributed.shutdown()
with open(os.path.join(os.environ["MPISTAGE_TEST_OUT"], f"{rank}.json"), "w") as f:
    json.dump(facts, f)
"""


def dist_entries(names):
    """The site-packages entries of the distributions *names* (no requirements)."""
    from importlib import metadata

    entries = set()
    for name in names:
        files = metadata.distribution(name).files or []
        entries |= {f.parts[0] for f in files if f.parts[0] != ".."}
    return sorted(entries - {"__pycache__"})


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def jax_bundle(tmp_path_factory):
    """A venv with jax and jaxlib (and numpy, mpi4py), packed once."""
    pytest.importorskip("jax")
    from envtools import build_venv

    base = tmp_path_factory.mktemp("jaxenv")
    venv = build_venv(base / "venv", dist_entries(JAX_DISTS))
    path = base / "jax.mpistage"
    result = mpistage(["pack", "--env", venv.prefix, "-q", "-o", path], clean_environ())
    assert result.returncode == 0, result
    return path


def test_jax_distributed_without_mpi(jax_bundle, tmp_path):
    """``mpiexec -n 2 mpistage-env ENV -- python prog.py``: jax's own coordinator.

    mpiexec only starts the processes; each finds its process id in
    ``PMI_RANK``, runs the staged interpreter of its node, and never maps
    an MPI library.
    """
    if MPIEXEC is None:
        pytest.skip("no mpiexec next to this Python nor on PATH")
    (tmp_path / "prog.py").write_text(JAX_APP)
    place, out = tmp_path / "stage", tmp_path / "out"
    place.mkdir(mode=0o700)
    out.mkdir()
    env = clean_environ()
    env.update(
        MPISTAGE_STAGE_DIR=str(place),
        MPISTAGE_STAGE_FALLBACK="no",
        MPISTAGE_EMULATE_NODES="2",
        MPISTAGE_TEST_OUT=str(out),
        COORDINATOR=f"127.0.0.1:{free_port()}",
        JAX_PLATFORMS="cpu",
    )
    command = [MPIEXEC, "-n", 2, MPISTAGE_ENV, jax_bundle, "--", "python", "prog.py"]
    result = run(command, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, repr(result)
    facts = [json.loads((out / f"{r}.json").read_text()) for r in range(2)]
    for rank, f in enumerate(facts):
        assert (f["index"], f["count"], f["gathered"]) == (rank, 2, [1, 2]), f
        assert not f["mpi4py"] and f["libmpi"] == [], f
        for path in (f["jax"], f["executable"]):
            assert on_node(path, place, rank), (rank, path)
