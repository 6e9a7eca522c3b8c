"""mpi4py built from source against Debian's Open MPI and MPICH: every mode.

The MPICH wheel of ``.venv`` is one build of mpi4py; a user's mpi4py is often
built from source against the system MPI. For each of two such venvs
(scripts/source-venv openmpi|mpich), as a user runs it, with
``<venv>/bin/python -m mpistage`` and with ``<venv>/bin/mpistage``, at 4 ranks
on 2 emulated nodes: live imports, ``--auto`` (the run that records and the
run that replays), a bundle made by ``mpistage record`` and one made by
``mpistage pack --stdlib``, and a collective on rank 0 while the other ranks
import. Each must print what plain ``python`` prints, on every rank, exit 0,
and finish within the timeout (a hang is a failure).

Part of the launcher tier (marker ``launchers``); without the Debian packages
it is skipped, with one line.
"""

import json
from pathlib import Path

import pytest

from launchertools import run, source_missing, source_venv
from stagetools import clean_environ, install_record, job_dirs

# A job ended by MPI_Abort leaves its MPICH segments: reaped after each test.
pytestmark = [pytest.mark.launchers, pytest.mark.usefixtures("reap_mpich_shm")]

if source_missing():  # the whole tier, with one line
    pytest.skip(
        f"source-built MPI tier skipped: {source_missing()}", allow_module_level=True
    )

RANKS, NODES = 4, 2
TIMEOUT = 120  # per launch; the probe hangs without a fix, so keep it bounded

# Each rank's stdout goes to a file of its own: what mpiexec forwards from
# several ranks may interleave. Open MPI names the rank differently.
RANK_STDOUT = (
    'exec "$0" "$@" >"$MPISTAGE_TEST_STDOUT/${PMI_RANK:-$OMPI_COMM_WORLD_RANK}.txt"'
)
LAUNCHERS = {
    "openmpi": ["mpiexec.openmpi", "--oversubscribe", "-n", str(RANKS)],
    "mpich": ["mpiexec.mpich", "-n", str(RANKS)],
}
ENTRIES = ["python -m mpistage", "mpistage"]

APP = """\
import decimal, email.message, json
import importlib.resources as res
import srcpkg, srcpkg.sub
from mpi4py import MPI
world = MPI.COMM_WORLD
msg = email.message.EmailMessage()
msg["Subject"] = "staged"
print(json.dumps({
    "all": world.allreduce(1) == world.size,
    "twice": srcpkg.sub.TWICE,
    "table": res.files("srcpkg").joinpath("data", "table.txt").read_text(),
    "sum": str(decimal.Decimal("1.10") + decimal.Decimal("2.205")),
    "subject": msg["Subject"],
}, sort_keys=True))
"""

# The deadlock: rank 0 is in a collective on a communicator of its
# own while the other ranks import, which rank 0 serves under live imports:
# json, email.message, decimal and the test package, then one module of the
# package a round (without a fix, rank 0 in ``Dup`` did not hang here; in
# ``allreduce`` it did).
ROUNDS = 8
PROBE = f"""\
import importlib
from mpi4py import MPI
world = MPI.COMM_WORLD
sub = MPI.COMM_WORLD.Dup()
rounds = [["json", "email.message", "decimal", "srcpkg.sub"]]
rounds += [[f"srcpkg.m{{i}}"] for i in range({ROUNDS})]
total = 0
for names in rounds:
    if world.rank != 0:
        for name in names:
            importlib.import_module(name)
    total += sub.allreduce(1)
import decimal, email.message, json
import srcpkg.sub
last = importlib.import_module("srcpkg.m{ROUNDS - 1}")
print(json.dumps([total == {ROUNDS + 1} * world.size, srcpkg.sub.TWICE, last.M,
                  str(decimal.Decimal("0.1") * 3), email.message.Message().get("x")]))
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A sys.path root with ``srcpkg`` (a submodule, a data file), the scripts."""
    base = tmp_path_factory.mktemp("source-mpi")
    site = base / "site"
    pkg = site / "srcpkg"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 21\n")
    (pkg / "sub.py").write_text("from srcpkg import VALUE\nTWICE = 2 * VALUE\n")
    (pkg / "data" / "table.txt").write_text("1 2 3\n")
    for i in range(ROUNDS):  # what the probe imports, a module a round
        text = f"import decimal, json\nfrom srcpkg import VALUE\nM = VALUE + {i}\n"
        (pkg / f"m{i}.py").write_text(text)
    install_record(site, "srcpkg", "1.0")
    app = base / "app"
    app.mkdir()
    (app / "app.py").write_text(APP)
    (app / "probe.py").write_text(PROBE)
    return {"site": site, "app": app / "app.py", "probe": app / "probe.py"}


class Venv:
    """A source-built venv: its python, how to launch with it, plain output."""

    def __init__(self, mpi, python, work):
        self.mpi, self.python = mpi, Path(python)
        self.bin = self.python.parent
        self.launcher = LAUNCHERS[mpi]
        env = {
            k: v
            for k, v in clean_environ().items()
            if not k.startswith(("OMPI_", "PMI", "PMIX_", "HYDRA_", "SLURM_"))
        }
        self.env = dict(
            env,
            PATH=f"{self.bin}:/usr/local/bin:/usr/bin:/bin",
            VIRTUAL_ENV=str(self.bin.parent),
            PYTHONPATH=str(work["site"]),
            OMPI_ALLOW_RUN_AS_ROOT="1",
            OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        )
        self.expected = {name: self.plain(work[name]) for name in ("app", "probe")}

    def plain(self, script):
        """What ``python SCRIPT`` prints, one process, no mpistage."""
        result = run([self.python, script], env=self.env, timeout=TIMEOUT)
        assert result.returncode == 0 and result.stdout.strip(), repr(result)
        return result.stdout

    def entry(self, entry):
        """The command of *entry*: ``python -m mpistage`` or ``mpistage``."""
        if entry == "mpistage":
            return [self.bin / "mpistage"]
        return [self.python, "-m", "mpistage"]

    def tool(self, args, cwd=None):
        """Run ``mpistage ARGS`` (no mpiexec), asserting success."""
        result = run([self.bin / "mpistage", *args], env=self.env, cwd=cwd)
        assert result.returncode == 0, repr(result)
        return result

    def launch(self, entry, options, script, tmp_path, name="run"):
        """Launch *script* at 4 ranks on 2 emulated nodes; (result, report).

        ``result.stdout`` becomes the list of the ranks' outputs, in rank
        order; the report is ``None`` if the job wrote none.
        """
        report = tmp_path / f"{name}.json"
        report.unlink(missing_ok=True)
        outs = tmp_path / f"{name}.stdout"
        outs.mkdir()
        stage = tmp_path / "stage"
        stage.mkdir(exist_ok=True)
        env = dict(
            self.env,
            MPISTAGE_EMULATE_NODES=str(NODES),
            MPISTAGE_REPORT=str(report),
            MPISTAGE_STAGE_DIR=str(stage),
            MPISTAGE_STAGE_FALLBACK="no",
            MPISTAGE_TEST_STDOUT=str(outs),
        )
        wrap = ["sh", "-c", RANK_STDOUT]
        command = [*self.launcher, *wrap, *self.entry(entry), *options, script]
        result = run(command, env=env, cwd=tmp_path, timeout=TIMEOUT)
        texts = {p.stem: p.read_text() for p in outs.glob("*.txt")}
        result.stdout = [texts.get(str(r)) for r in range(RANKS)]
        facts = json.loads(report.read_text()) if report.exists() else None
        return result, facts

    def check(self, result, facts, script, tmp_path):
        """What a user notices: exit 0, plain python's output on every rank."""
        assert result.returncode == 0, repr(result)  # in full: the ranks' errors
        assert result.stdout == [self.expected[script]] * RANKS, repr(result)
        assert facts is not None, repr(result)
        assert job_dirs(tmp_path / "stage") == [], repr(result)
        return facts


@pytest.fixture(scope="module", params=sorted(LAUNCHERS))
def venv(request, work):
    """Each source-built venv in turn (built once, the wheel cached)."""
    return Venv(request.param, source_venv(request.param), work)


@pytest.fixture(scope="module")
def recorded(venv, work, tmp_path_factory):
    """A bundle made by ``mpistage record -o X -- python app.py``."""
    path = tmp_path_factory.mktemp(f"record-{venv.mpi}") / "app.mpistage"
    venv.tool(["record", "-o", path, "--", venv.python, work["app"]])
    return path


@pytest.fixture(scope="module")
def stdlib_bundle(venv, tmp_path_factory):
    """A bundle made by ``mpistage pack --stdlib`` of the test package."""
    path = tmp_path_factory.mktemp(f"stdlib-{venv.mpi}") / "srcpkg.mpistage"
    venv.tool(["pack", "-o", path, "srcpkg", "--stdlib"])
    return path


def served_all(facts):
    """The job imported from its staged copy and missed nothing."""
    mods = facts["modules"]
    assert mods["served"] > 0 and mods["missed"] == 0, facts


@pytest.mark.parametrize("entry", ENTRIES)
def test_live_imports(venv, work, entry, tmp_path):
    result, facts = venv.launch(entry, [], work["app"], tmp_path)
    facts = venv.check(result, facts, "app", tmp_path)
    assert facts["live"]["mode"] == "live", facts
    assert facts["live"]["read_files"] > 0, facts


@pytest.mark.parametrize("entry", ENTRIES)
def test_auto_records_then_replays(venv, work, entry, tmp_path):
    options = ["--auto", "--cache-dir", tmp_path / "cache"]
    result, facts = venv.launch(entry, options, work["app"], tmp_path, "first")
    facts = venv.check(result, facts, "app", tmp_path)
    assert facts["auto"].startswith("recorded"), facts
    assert len(list((tmp_path / "cache").glob("*.mpistage"))) == 1
    result, facts = venv.launch(entry, options, work["app"], tmp_path, "second")
    facts = venv.check(result, facts, "app", tmp_path)
    assert facts["auto"] == "replayed", facts
    served_all(facts)


@pytest.mark.parametrize("entry", ENTRIES)
def test_recorded_bundle(venv, work, recorded, entry, tmp_path):
    options = ["--bundle", recorded]
    result, facts = venv.launch(entry, options, work["app"], tmp_path)
    facts = venv.check(result, facts, "app", tmp_path)
    assert facts["bundle"] == str(recorded), facts
    served_all(facts)


@pytest.mark.parametrize("entry", ENTRIES)
def test_stdlib_bundle(venv, work, stdlib_bundle, entry, tmp_path):
    options = ["--bundle", stdlib_bundle]
    result, facts = venv.launch(entry, options, work["app"], tmp_path)
    facts = venv.check(result, facts, "app", tmp_path)
    assert facts["bundle"] == str(stdlib_bundle), facts
    served_all(facts)


@pytest.mark.parametrize("entry", ENTRIES)
def test_collective_on_rank_0_while_others_import(venv, work, entry, tmp_path):
    """Rank 0 in ``Dup`` and ``allreduce`` while the others import: no hang.

    (The app of the other tests meets it too, when rank 0 reaches its
    ``allreduce`` while the others still import what ``EmailMessage()``
    imports lazily.)
    """
    result, facts = venv.launch(entry, [], work["probe"], tmp_path)
    facts = venv.check(result, facts, "probe", tmp_path)
    assert facts["live"]["mode"] == "live", facts
