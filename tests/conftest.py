"""Fixtures of the mpistage tests; the helpers live in ``stagetools``.

Every test stages below its own ``tmp_path`` with the fallback candidates
(/dev/shm, $TMPDIR, /tmp) disabled, so nothing lands anywhere else. The
commands run as users run them, whatever the caller's shell sets: bytecode
written, output buffered, no path of the caller's (a test that wants one of
these sets it in its own environment).
"""

import os
from pathlib import Path

import pytest

from stagetools import clean_environ, make_site, pack, reap_shm

for _name in (
    "PYTHONDONTWRITEBYTECODE",
    "PYTHONUNBUFFERED",
    "PYTHONPATH",
    "PYTHONSAFEPATH",
):
    os.environ.pop(_name, None)


def pytest_addoption(parser):
    parser.addoption(
        "--extended",
        action="store_true",
        help="also run the extended tier: slower variants of cases the suite "
        "already covers (make test-extended)",
    )


def pytest_collection_modifyitems(config, items):
    """Leave the ``extended`` tier out unless ``--extended`` asks for it."""
    if config.getoption("--extended"):
        return
    left = [item for item in items if "extended" in item.keywords]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if "extended" not in item.keywords]


@pytest.fixture
def stage_dir(tmp_path):
    """This test's only staging candidate."""
    path = tmp_path / "stage"
    path.mkdir()
    return path


@pytest.fixture
def stage_env(tmp_path, stage_dir):
    """An environment that stages below *stage_dir* only, and collects output."""
    out = tmp_path / "out"
    out.mkdir()
    environ = clean_environ()
    environ.update(
        MPISTAGE_STAGE_DIR=str(stage_dir),
        MPISTAGE_STAGE_FALLBACK="no",
        MPISTAGE_TEST_OUT=str(out),
    )
    return environ


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A site dir with tinypkg and othermod, and a bundle of tinypkg only."""
    base = tmp_path_factory.mktemp("tiny")
    site = make_site(base / "site")
    env = clean_environ()
    env["PYTHONPATH"] = str(site)
    path = pack(base / "tiny.mpistage", "tinypkg", env=env)
    return {"site": site, "bundle": path}


@pytest.fixture(scope="session")
def numpy_bundle(tmp_path_factory):
    """A bundle of numpy, built once per session."""
    pytest.importorskip("numpy")
    path = tmp_path_factory.mktemp("numpy") / "numpy.mpistage"
    return pack(path, "numpy")


@pytest.fixture(scope="session")
def env_bundle(tmp_path_factory):
    """The small venv (MPICH wheel, mpi4py, numpy) packed with ``pack --env``, once.

    Modules with an environment of their own define their own ``env_bundle``.
    """
    from envtools import small_venv
    from stagetools import mpistage

    venv = small_venv(tmp_path_factory)
    path = tmp_path_factory.mktemp("small-env") / "env.mpistage"
    result = mpistage(["pack", "--env", venv.prefix, "-o", path], clean_environ())
    assert result.returncode == 0, result
    return path


@pytest.fixture(scope="session")
def run_file(tmp_path_factory):
    """The small venv packed with ``pack --env --self-extracting``, once."""
    from envtools import small_venv
    from stagetools import mpistage

    path = tmp_path_factory.mktemp("selfextract") / "env.run"
    venv = small_venv(tmp_path_factory).prefix
    command = ["pack", "--env", venv, "--self-extracting", "-o", path]
    result = mpistage(command, clean_environ())
    assert result.returncode == 0, result
    return path


@pytest.fixture(scope="session")
def slurm():
    """The environment of launches on the running two-node Slurm test cluster."""
    from launchertools import bring_up

    return bring_up()


@pytest.fixture
def reap_mpich_shm():
    """Remove the MPICH segments that jobs ended by MPI_Abort leave in /dev/shm."""
    before = set(Path("/dev/shm").glob("mpich_shm_*"))
    yield
    reap_shm(before)
