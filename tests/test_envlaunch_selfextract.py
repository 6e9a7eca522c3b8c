"""A self-extracting environment (``pack --env --self-extracting``) without Slurm.

Under Hydra on two emulated nodes: the file runs as ``FILE -- COMMAND``;
a copy of it in a node-local place (what ``srun --bcast`` or ``mpirun
--preload-files`` leave) goes with the launch's copies, and the file
anywhere else (the user's own, on the shared file system) is never
touched. The Slurm form is in tests/test_envlaunch_launchers.py.
"""

import shutil
import subprocess

import pytest

from stagetools import MPIEXEC, clean_environ, run
from test_envlaunch import APP, environ, results, settled

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reap_mpich_shm")]


@pytest.fixture
def place(tmp_path):
    folder = tmp_path / "shm"
    folder.mkdir(mode=0o700)
    return folder


def launch(command, tmp_path, place):
    app = tmp_path / "app.py"
    app.write_text(APP)
    line = [MPIEXEC, "-n", "4", command, "--", "python", app]
    return run(line, environ(place), cwd=tmp_path, timeout=180)


def test_the_launchers_copy_goes_with_the_launch(run_file, tmp_path, place):
    spread = place / "env.run"
    shutil.copy2(run_file, spread)
    result = launch(spread, tmp_path, place)
    assert result.returncode == 0, result
    copies = {r["exe"].rsplit("/bin/", 1)[0] for r in results(result).values()}
    assert len(copies) == 2 and all(c.startswith(str(place)) for c in copies)
    assert settled(place) == []  # the copies, their claims and the file


def test_the_users_own_file_is_never_removed(run_file, tmp_path, place):
    result = launch(run_file, tmp_path, place)
    assert result.returncode == 0, result
    assert sorted(results(result)) == [0, 1, 2, 3]
    assert settled(place) == []
    assert run_file.is_file()


def test_it_says_how_to_run_it(run_file, tmp_path):
    result = run([run_file, "python"], clean_environ(), timeout=30)
    assert result.returncode == 2 and "-- COMMAND" in result.stderr


def test_a_large_job_reading_a_large_bundle_is_told_the_broadcast_form(tmp_path):
    """On the first node of a Slurm job of 128 nodes, a bundle of 1 GB or more
    read by each node gets one note naming the self-extracting form."""
    from test_envlaunch import SCRIPT

    big = tmp_path / "big.mpistage"
    with open(big, "wb") as f:
        f.truncate((1 << 30) + 4096)  # read as a bundle, then refused
    place = tmp_path / "shm"
    place.mkdir(mode=0o700)
    env = dict(environ(place), SLURM_JOB_ID="9", SLURM_NODEID="0")
    del env["MPISTAGE_EMULATE_NODES"]
    notes = {}
    for nodes in ("127", "128"):
        env["SLURM_JOB_NUM_NODES"] = nodes
        result = run([SCRIPT, big, "--", "true"], env, cwd=tmp_path, timeout=120)
        assert result.returncode == 1, result
        notes[nodes] = [ln for ln in result.stderr.splitlines() if "note:" in ln]
        subprocess.run(["rm", "-rf", *map(str, place.iterdir())], check=True)
    assert notes["127"] == [] and len(notes["128"]) == 1, notes
    assert "--self-extracting" in notes["128"][0] and "srun --bcast" in notes["128"][0]
