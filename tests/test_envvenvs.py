"""Venvs as users make them: ``python3 -m venv`` and ``uv venv`` on Debian's Python.

Each venv is made once per session from ``/usr/bin/python3``, the
distribution's Python, whose ``site`` looks in ``dist-packages`` unless it
runs in a venv. pip (from its cache) installs mpi4py, the MPICH wheel, numpy
and this mpistage into it, and ``pack --env`` packs it. Then every
environment mode runs a program under the venv's ``mpiexec``, two ranks on
two emulated nodes: ``mpistage-env``, ``mpistage run --env`` and ``mpistage
stage``. Each rank must import mpi4py and numpy from its node's copy, and
see there the ``sys.prefix``, site directories and ``sysconfig`` paths that
the original venv gives a plain run. Those runs are slow; the writer of
the staged ``pyvenv.cfg`` is also tested alone, with the fields it refuses.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from envtools import under
from mpistage import StageError
from mpistage.runtime.extract import write_venv
from stagetools import clean_environ, mpistage, run

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bin" / "mpistage-env"
SYSTEM_PYTHON = Path("/usr/bin/python3")
KINDS = ("venv", "uv")
JOB_VARIABLES = ("SLURM_JOB_ID", "FLUX_JOB_ID", "PBS_JOBID", "LSB_JOBID")
APP = """\
import json, os, site, sys, sysconfig
import numpy, mpi4py
from mpi4py import MPI
world = MPI.COMM_WORLD
info = {"rank": world.rank, "sum": world.allreduce(1), "mpi4py": mpi4py.__file__,
        "numpy": numpy.__file__, "prefix": sys.prefix, "base_prefix": sys.base_prefix,
        "site": site.getsitepackages(), "scheme": sysconfig.get_default_scheme(),
        "paths": [sysconfig.get_path(k) for k in ("purelib", "platlib", "scripts")]}
os.write(1, ("RESULT " + json.dumps(info) + chr(10)).encode())
"""

_made = {}


class UserVenv:
    """A venv made as a user makes it, packed: its prefix, bundle, plain facts."""

    def __init__(self, prefix, bundle, plain):
        self.prefix, self.bundle, self.plain = prefix, bundle, plain
        self.bin = prefix / "bin"


def find_uv():
    """Return the ``uv`` next to this Python (the test extra), else on PATH."""
    sibling = Path(sys.executable).parent / "uv"
    return str(sibling) if sibling.exists() else shutil.which("uv")


def create_command(kind, prefix):
    """The command a user types to make a venv of *kind* from Debian's Python."""
    if not SYSTEM_PYTHON.exists():
        pytest.skip(f"no {SYSTEM_PYTHON} (Debian's Python) on this machine")
    if kind == "venv":
        return [SYSTEM_PYTHON, "-m", "venv", "--without-pip", prefix]
    uv = find_uv()
    if uv is None:
        pytest.skip("uv is not installed: pip install uv (in the test extra)")
    return [uv, "venv", "--no-cache", "--python", SYSTEM_PYTHON, prefix]


def plain_facts(prefix, tmp):
    """What the venv's python says of itself, run plainly from the venv."""
    app = tmp / "facts.py"
    app.write_text(APP)
    result = run([prefix / "bin" / "python", app], quiet_environ(), timeout=60)
    assert result.returncode == 0, result
    (facts,) = rank_results(result).values()
    assert under(facts["mpi4py"], prefix), facts
    return facts


def make_venv(kind, tmp):
    """Make, fill and pack a venv of *kind* below *tmp* (see the module docstring)."""
    prefix = tmp / "V"
    made = run(create_command(kind, prefix), quiet_environ(), timeout=120)
    assert made.returncode == 0, made
    # pip of this venv installs into the new one: the same wheels, from
    # pip's cache, and a uv venv has no pip of its own.
    install = [sys.executable, "-m", "pip", "--python", prefix / "bin" / "python"]
    install += ["install", "-q", "mpi4py", "mpich", "numpy", ROOT]
    installed = run(install, quiet_environ(), timeout=600)
    assert installed.returncode == 0, installed
    plain = plain_facts(prefix, tmp)
    bundle = tmp / "env.mpistage"
    packed = mpistage(["pack", "--env", prefix, "-o", bundle], quiet_environ())
    assert packed.returncode == 0, packed
    return UserVenv(prefix, bundle, plain)


@pytest.fixture(scope="session", params=KINDS)
def user_venv(request, tmp_path_factory):
    """A packed venv made by ``python3 -m venv`` or ``uv venv``, once a session."""
    kind = request.param
    if kind not in _made:
        _made[kind] = make_venv(kind, tmp_path_factory.mktemp(f"user-{kind}"))
    return _made[kind]


@pytest.fixture
def place(tmp_path):
    """A private staging place for the test."""
    folder = tmp_path / "shm"
    folder.mkdir(mode=0o700)
    return folder


def quiet_environ():
    """This test's environment, without a venv or a scheduler's job."""
    env = clean_environ()
    for name in ("VIRTUAL_ENV", *JOB_VARIABLES):
        env.pop(name, None)
    return env


def job_environ(place, path):
    """Two emulated nodes, staging in *place*, the search path *path*."""
    env = quiet_environ()
    env.update(MPISTAGE_STAGE_DIR=str(place), MPISTAGE_STAGE_FALLBACK="no")
    env.update(MPISTAGE_EMULATE_NODES="2", PATH=path)
    return env


def rank_results(result):
    found = [
        json.loads(line.partition(" ")[2])
        for line in result.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    return {r["rank"]: r for r in found}


def relative(facts, prefix):
    """The venv's own facts with *prefix* as ``{prefix}``, to compare copies."""
    prefix = str(prefix)

    def rel(path):
        return "{prefix}" + path[len(prefix) :] if under(path, prefix) else path

    found = {k: rel(facts[k]) for k in ("mpi4py", "numpy", "prefix")}
    return {**found, **{k: list(map(rel, facts[k])) for k in ("site", "paths")}}


def check_ranks(result, venv, place):
    """Each rank ran on its node's copy in *place*, as the venv runs plainly."""
    assert result.returncode == 0, result
    ranks = rank_results(result)
    assert sorted(ranks) == [0, 1], result
    copies = {Path(info["prefix"]) for info in ranks.values()}
    assert len(copies) == 2, ranks  # one copy per emulated node
    want = relative(venv.plain, venv.prefix)
    for info in ranks.values():
        copy = Path(info["prefix"])
        assert info["sum"] == 2, info
        assert place in copy.parents, info
        assert under(info["mpi4py"], copy) and under(info["numpy"], copy), info
        assert not under(info["mpi4py"], venv.prefix), info
        assert relative(info, copy) == want, (info, venv.plain)
        assert under(info["base_prefix"], copy) and info["base_prefix"] != str(copy)
        assert info["scheme"] == venv.plain["scheme"], (info, venv.plain)
    return ranks


def write_app(tmp_path):
    app = tmp_path / "app.py"
    app.write_text(APP)
    return app


@pytest.mark.slow
@pytest.mark.usefixtures("reap_mpich_shm")
def test_mpistage_env_runs_with_the_venvs_packages(user_venv, tmp_path, place):
    env = job_environ(place, "/usr/bin:/bin")
    command = [user_venv.bin / "mpiexec", "-n", 2, SCRIPT, user_venv.bundle]
    command += ["--", "python", write_app(tmp_path)]
    result = run(command, env, cwd=tmp_path, timeout=180)
    check_ranks(result, user_venv, place)


@pytest.mark.slow
@pytest.mark.usefixtures("reap_mpich_shm")
def test_mpistage_run_env_runs_with_the_venvs_packages(user_venv, tmp_path, place):
    # As in a job script, the venv activated: its mpistage and mpiexec.
    env = job_environ(place, f"{user_venv.bin}:/usr/bin:/bin")
    folder = place / "run" / "n{node}"
    command = [user_venv.bin / "mpistage", "run", "--env", user_venv.bundle]
    command += ["--to", folder, "--", "mpiexec", "-n", 2, "python"]
    result = run([*command, write_app(tmp_path)], env, cwd=tmp_path, timeout=180)
    check_ranks(result, user_venv, place)
    assert not (place / "run").exists()  # cleaned on every node


@pytest.mark.slow
@pytest.mark.usefixtures("reap_mpich_shm")
def test_mpistage_stage_gives_a_venv_per_node(user_venv, tmp_path, place):
    env = job_environ(place, f"{user_venv.bin}:/usr/bin:/bin")
    template = place / "env-n{node}"
    stage = [user_venv.bin / "mpiexec", "-n", 2, user_venv.bin / "mpistage"]
    stage += ["stage", user_venv.bundle, "--to", template]
    staged = run(stage, env, cwd=tmp_path, timeout=180)
    assert staged.returncode == 0, staged
    for node in (0, 1):
        copy = place / f"env-n{node}"
        cfg = (copy / "pyvenv.cfg").read_text()
        assert f"home = {copy}/base/bin\n" in cfg, cfg
    # Each rank runs its node's copy, as a launch line names it.
    pick = f'exec "{place}/env-n$PMI_RANK/bin/python" "$@"'
    command = [user_venv.bin / "mpiexec", "-n", 2, "sh", "-c", pick, "sh"]
    command += [write_app(tmp_path)]
    result = run(command, env, cwd=tmp_path, timeout=180)
    check_ranks(result, user_venv, place)


# What pack --env says of a uv venv's pyvenv.cfg, and what a place gets.
UV_FIELD = {
    "home": "base/bin",
    "executable": "base/bin/python3.11",
    "cfg": {"implementation": "CPython", "uv": "0.13.9", "version_info": "3.11.2"},
}


def write_cfg(tmp_path, venv, path=None):
    folder = tmp_path / "place"
    folder.mkdir()
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        manifest = {"env": {"venv": venv}}
        write_venv(fd, str(path or folder), manifest, "env.mpistage")
    finally:
        os.close(fd)
    return folder / "pyvenv.cfg"


def test_pyvenv_cfg_names_the_place_and_keeps_the_other_keys(tmp_path):
    cfg = write_cfg(tmp_path, UV_FIELD).read_text()
    place = tmp_path / "place"
    assert cfg.splitlines() == [
        "implementation = CPython",
        "uv = 0.13.9",
        "version_info = 3.11.2",
        f"home = {place}/base/bin",
        f"executable = {place}/base/bin/python3.11",
    ]


def test_a_bundle_without_a_venv_gets_no_pyvenv_cfg(tmp_path):
    assert not write_cfg(tmp_path, None).exists()


BAD_FIELDS = {
    "home leaves the place": {**UV_FIELD, "home": "../elsewhere/bin"},
    "absolute home": {**UV_FIELD, "home": "/usr/bin"},
    "no executable": {"home": "base/bin", "cfg": {}},
    "a key that is home": {**UV_FIELD, "cfg": {"Home": "/usr/bin"}},
    "a line break in a value": {**UV_FIELD, "cfg": {"prompt": "x\nhome = /usr/bin"}},
    "an = in a key": {**UV_FIELD, "cfg": {"a = b": "c"}},
    "not a table": ["home", "base/bin"],
}


@pytest.mark.parametrize("field", BAD_FIELDS.values(), ids=BAD_FIELDS)
def test_a_bad_venv_field_is_refused(tmp_path, field):
    with pytest.raises(StageError, match="bad venv"):
        write_cfg(tmp_path, field)
    assert not (tmp_path / "place" / "pyvenv.cfg").exists()


def test_a_place_with_a_line_break_is_refused(tmp_path):
    with pytest.raises(StageError, match="newline"):
        write_cfg(tmp_path, UV_FIELD, path=tmp_path / "a\nb")
