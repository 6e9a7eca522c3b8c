"""`mpistage bench run` end to end, tiny: files, columns, and what they show."""

import csv
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mpistage.bench import simfs
from mpistage.bench.sweep import COLUMNS
from stagetools import clean_environ, run

FUSE_REASON = simfs.fuse_available()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(FUSE_REASON is not None, reason=str(FUSE_REASON)),
]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "out"
    args = [
        sys.executable,
        "-m",
        "mpistage",
        "bench",
        "run",
        "--workload",
        "generated",
        "--modules",
        "12",
        "--extensions",
        "1",
        "--ranks",
        "1,2",
        "--nodes",
        "2",
        "--latency",
        "0.2ms",
        "--modes",
        "plain,mpistage,local",
        "--layout",
        "packages",
        "-o",
        str(out),
    ]
    result = run(args, env=clean_environ(), timeout=300)
    assert result.returncode == 0, result
    return out, result


@pytest.fixture(scope="module")
def realistic(tmp_path_factory):
    """The realistic layout, tiny: interpreter, stdlib, venv all on simfs."""
    out = tmp_path_factory.mktemp("realistic") / "out"
    args = [
        *("-m", "mpistage", "bench", "run", "--workload", "generated"),
        *("--modules", "12", "--extensions", "1", "--ranks", "1,6", "--nodes", "2"),
        *("--latency", "0"),
        *("--modes", "floor,plain,mpistage,live,staged-env,env-launch"),
        *("-o", str(out)),
    ]
    result = run([sys.executable, *args], env=clean_environ(), timeout=600)
    assert result.returncode == 0, result
    return json.loads((out / "results.json").read_text())["rows"]


def test_writes_csv_json_and_png_with_the_expected_columns(bench):
    out, result = bench
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(COLUMNS)
    cells = {(r["mode"], r["ranks"]) for r in rows}
    assert cells == {(m, n) for m in ("plain", "mpistage", "local") for n in "12"}
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["latency"] == "0.2ms" and len(data["rows"]) == 6
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| workload | layout | ranks | nodes | mode |" in result.stdout
    assert "results.png" in result.stdout


def test_the_figures_show_the_shared_fs_traffic_of_each_mode(bench):
    out, _ = bench
    rows = json.loads((out / "results.json").read_text())["rows"]
    ops = {(r["mode"], r["ranks"]): r["meta_ops"] for r in rows}
    assert ops[("local", 1)] == ops[("local", 2)] == 0
    # plain: every rank walks the shared tree; mpistage: rank 0 alone reads it
    assert ops[("plain", 2)] > 1.8 * ops[("plain", 1)] > 0
    assert ops[("mpistage", 2)] == ops[("mpistage", 1)]
    assert ops[("mpistage", 2)] < ops[("plain", 1)]


def test_realistic_layout_counts_what_every_rank_pays(realistic):
    cell = {(r["mode"], r["ranks"]): r for r in realistic}
    assert all(r["layout"] == "realistic" for r in realistic)
    floor = cell[("floor", 6)]["ops_rank_median"]  # F: python + mpi4py, per rank
    assert floor > 500  # the interpreter itself starts from the shared FS
    plain, staged = cell[("plain", 6)], cell[("mpistage", 6)]
    assert plain["ops_rank_median"] > floor
    # one rank per node imports mpi4py (no more than F + 200: it loads the
    # libraries from the copy it makes); most others pay the interpreter's
    # start and little else
    assert 0 < staged["ops_first"] <= floor + 200
    assert staged["ops_rank_max"] == staged["ops_first"]
    assert staged["ops_rank_median"] < floor / 2
    # nothing prepared (live imports): the same per role, within 50
    live = cell[("live", 6)]
    assert 0 < live["ops_first"] <= staged["ops_first"] + 50
    assert live["ops_rank_median"] <= staged["ops_rank_median"] + 50
    # the staged environment: a stage step per node, then nothing at all
    env = cell[("staged-env", 6)]
    assert env["ops_rank0"] == env["ops_rank_max"] == 0
    assert env["ops_stage_node"] > 0 and env["stage_s"] > 0
    # one launch (mpistage-env): a rank pays the launcher's exec of the script
    # and sh's read of it, a node its one read of the bundle, nothing else
    one = cell[("env-launch", 6)]
    assert one["ops_rank0"] == one["ops_rank_max"] <= 12
    assert 0 < one["ops_stage_node"] <= 20
    assert one["meta_ops"] <= 6 * one["ops_rank_max"] + 2 * one["ops_stage_node"]


def test_bench_data_on_two_nodes(tmp_path):
    out = tmp_path / "out"
    args = [*("-m", "mpistage", "bench", "data", "--size", "1MiB", "--ranks", "2")]
    args += [*("--nodes", "2", "--readers", "1,2", "--latency", "0", "-o", str(out))]
    result = run([sys.executable, *args], env=clean_environ(), timeout=300)
    assert result.returncode == 0, result
    found = json.loads((out / "data.json").read_text())
    rows = [r for table in ("compare", "readers") for r in found[table]]
    shared = [r for r in rows if r["mode"] == "mpistage" and r["io"] == "posix"]
    # Only the readers touch the shared FS, each through its own node's mount.
    assert {r["readers"]: r["fs_processes"] for r in shared} == {1: 1, 2: 2}, rows


def test_bench_weights_on_two_nodes(tmp_path):
    """A sharded checkpoint: every node fetches it when every rank maps it;
    one rank reads it once for the whole job with mpistage."""
    out = tmp_path / "out"
    args = ["-m", "mpistage", "bench", "weights", "--size", "3MB", "--shards", "3"]
    args += ["--ranks", "4", "--nodes", "2", "--latency", "0", "-o", str(out)]
    result = run([sys.executable, *args], env=clean_environ(), timeout=300)
    assert result.returncode == 0, result
    rows = {
        r["mode"]: r for r in json.loads((out / "weights.json").read_text())["rows"]
    }
    size = rows["mpistage"]["size"]
    assert rows["mpistage"]["fs_processes"] == 1
    assert size <= rows["mpistage"]["fs_bytes"] < size + 64 * 1024
    assert rows["plain-map"]["fs_processes"] == 4
    assert rows["plain-map"]["fs_bytes"] >= 2 * size


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--modes", "plain,nosuch"], "unknown mode ['nosuch']"),
        (
            [
                "--layout",
                "packages",
                "--workload",
                "generated",
                "--modes",
                "staged-env",
            ],
            "runs the numpy workload only",
        ),
    ],
)
def test_a_mode_that_cannot_run_is_one_line_before_anything_runs(tmp_path, args, words):
    command = [sys.executable, "-m", "mpistage", "bench", "run", *args]
    result = run([*command, "-o", str(tmp_path / "out")], env=clean_environ())
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpistage: error:"), result
    assert words in lines[0], result
    assert not (tmp_path / "out").exists()


def test_sigterm_leaves_no_mount_and_no_tree(tmp_path):
    # A time limit (SIGTERM) ends the bench as Ctrl-C does: it unmounts its
    # simulated shared file system and removes its temporary trees.
    args = ["--workload", "generated", "--modules", "12", "--extensions", "1"]
    args += ["--ranks", "1,6", "--nodes", "2", "--repeat", "20", "--latency", "0"]
    command = [sys.executable, "-m", "mpistage", "bench", "run", *args]
    env = dict(clean_environ(), TMPDIR=str(tmp_path))
    out = tmp_path / "out"
    local = set(glob.glob("/dev/shm/mpistage-bench-local-*"))  # node-local trees
    proc = subprocess.Popen([*command, "-o", str(out)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not any(os.path.ismount(p) for p in tmp_path.glob("*/mnt")):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(3)  # into the cells
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert not any(os.path.ismount(p) for p in tmp_path.glob("*/mnt"))
    assert not list(tmp_path.glob("mpistage-bench-*")), list(tmp_path.iterdir())
    assert set(glob.glob("/dev/shm/mpistage-bench-local-*")) <= local
