"""`mpistage bench model`: its arithmetic, its tables, its validation, its errors.

Every number below is worked out by hand in the comments, so a change to an
equation shows up as a failing line, not as a silently different table.
"""

import json
import subprocess
import sys

import pytest

from mpistage.bench.model import Inputs, Machine, predict
from mpistage.bench.model.cli import cli_model
from mpistage.bench.model.plot import plot_ranks

# A machine with round numbers: 1,000 ops/s per stream, 4 at once.
HAND = Machine(
    mds_rate=1000,
    mds_concurrency=4,
    ranks_per_node=4,
    fs_bw=1e9,
    client_bw=1e8,
    net_latency=1e-3,
    net_bw=1e8,
    bcast="pipeline",
    chunk=1e7,
    local_bw=1e8,
)
RUNNER = Inputs(
    ops_rank=100, ops_rank0_extra=50, bytes_rank=1e6, bundle_bytes=4e7, run_s=0.5
)


def test_arithmetic_matches_a_hand_computed_case():
    steps = predict(RUNNER, 16, 4, HAND)
    # ops: 50 extra + 4 first ranks × 100 + 12 others × 100 = 1,650 at 4,000/s
    assert steps["metadata"] == pytest.approx(0.4125)
    # 16 × 1 MB at 1 GB/s (beats 1 MB at 0.1 GB/s), then 40 MB at 0.1 GB/s
    assert steps["read"] == pytest.approx(0.016 + 0.4)
    # log2(4) = 2 levels, 4 chunks of 10 MB: (2 + 4 - 1) × (1 ms + 100 ms)
    assert steps["broadcast"] == pytest.approx(0.505)
    assert steps["write"] == pytest.approx(0.4)  # 40 MB at 0.1 GB/s
    assert steps["run"] == pytest.approx(0.5)
    assert steps["total"] == pytest.approx(2.2335)


def test_arithmetic_of_the_variants():
    binomial = Machine(**{**HAND.__dict__, "bcast": "binomial"})
    # 2 levels × (1 ms + 40 MB at 0.1 GB/s)
    assert predict(RUNNER, 16, 4, binomial)["broadcast"] == pytest.approx(0.802)
    cached = Machine(**{**HAND.__dict__, "node_cache": 0.5})
    # 50 + 4 × 100 + 12 × 100 × 0.5 = 1,050 ops at 4,000/s
    assert predict(RUNNER, 16, 4, cached)["metadata"] == pytest.approx(0.2625)
    # One rank alone waits for its own 100 round trips: 0.1 s, not 100 / 4,000
    assert predict(Inputs(ops_rank=100), 1, 1, HAND)["metadata"] == pytest.approx(0.1)
    shared = Machine(**{**HAND.__dict__, "cores": 2})
    steps = predict(RUNNER, 16, 4, shared)
    assert steps["run"] == pytest.approx(0.5 * 16 / 2)
    assert steps["write"] == pytest.approx(0.4 * 4 / 2)
    assert predict(RUNNER, 16, 1, HAND)["broadcast"] == 0


def table_rows(text):
    """Return the cells of the markdown table lines that hold a rank count."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0].replace(",", "").isdigit():
            rows.append(cells)
    return rows


def test_cli_prints_the_table_from_defaults(capsys):
    assert cli_model(["--ranks", "1024,16384,131072"]) == 0
    out = capsys.readouterr().out
    assert "| ranks | nodes | mode | metadata s | read s | broadcast s |" in out
    rows = table_rows(out)
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (ranks, nodes, mode)
        for ranks, nodes in (("1,024", "32"), ("16,384", "512"), ("131,072", "4,096"))
        for mode in ("plain", "mpistage", "mpistage-trust", "staged-env", "env-launch")
    ]
    # plain at 16,384 ranks: 16,384 × 6,073 ops at 40,000 ops/s = 2,487.5 s
    assert rows[5][3] == "2,488"
    # the runner: 508 + 512 first ranks × 1,626 + 15,872 others × 553 ops
    # = 9,610,236 ops at 40,000 ops/s = 240 s
    assert rows[6][2] == "mpistage" and rows[6][3] == "240"
    for i in range(0, 15, 5):
        totals = [float(r[8].replace(",", "")) for r in rows[i : i + 5]]
        assert totals[0] > totals[1] >= totals[2] > totals[3] > totals[4]
    # mpistage-env's targets (issue #28): ≤ 30 s at 16,384 ranks, ≤ 200 s at 131,072
    assert rows[9][2] == "env-launch" and float(rows[9][8]) <= 30
    assert rows[14][2] == "env-launch" and float(rows[14][8]) <= 200


def test_env_launch_reads_the_bundle_once_per_node_without_a_broadcast():
    env = Inputs(ops_rank=10, ops_node=5, bundle_bytes=4e7, bundle_per_node=1)
    steps = predict(env, 16, 4, HAND)
    # 4 nodes × (10 + 5) + 12 others × 10 = 180 ops at 4,000 ops/s
    assert steps["metadata"] == pytest.approx(0.045)
    # 4 nodes × 40 MB at 1 GB/s together = 0.16 s, beaten by one reader's
    # 40 MB at 0.1 GB/s = 0.4 s; nothing is broadcast
    assert steps["read"] == pytest.approx(0.4)
    assert steps["broadcast"] == 0
    assert steps["write"] == pytest.approx(0.4)  # each node writes its copy
    # 64 nodes × 40 MB = 2.56 GB at 1 GB/s: the file system's bandwidth binds
    assert predict(env, 256, 64, HAND)["read"] == pytest.approx(2.56)


def write_results(path, rows, latency="1ms"):
    """Write a results.json shaped like the one `mpistage bench run` writes."""
    full = []
    for row in rows:
        full.append(
            {
                "workload": "numpy",
                "layout": "realistic",
                "repeat": 0,
                "start_s": 0.0,
                "import_s": 0.0,
                "stage_s": 0.0,
                "ops_stage_node": 0,
                "bytes_read": 0,
                "bundle_bytes": 0,
                "ops_rank_max": row["ops_rank_median"],
                **row,
            }
        )
    path.write_text(
        json.dumps({"meta": {"latency": latency, "nodes": 2}, "rows": full})
    )
    return path


def cell(mode, ranks, nodes, total, rank0, median, meta, **more):
    """Return the keys of one row that the tests vary."""
    return dict(
        mode=mode,
        ranks=ranks,
        nodes=nodes,
        total_s=total,
        ops_rank0=rank0,
        ops_rank_median=median,
        meta_ops=meta,
        **more,
    )


RUNNER_1 = dict(stage_s=0.3, bundle_bytes=1e7, bytes_read=1e7)


@pytest.fixture
def results(tmp_path):
    # plain, 1 rank: 1,000 ops at 1 ms = 1.0 s, so run = 1.5 - 1.0 = 0.5 s.
    # mpistage, 1 rank: 1,500 ops (F + the check) = 1.5 s, staging 0.3 s,
    # so run = 2.0 - 1.5 - 0.3 = 0.2 s.
    return write_results(
        tmp_path / "results.json",
        [
            cell("plain", 1, 1, 1.5, 1000, 1000, 1000),
            cell("plain", 8, 2, 12.5, 1000, 1000, 8000),
            cell("mpistage", 1, 1, 2.0, 1500, 1500, 1500, **RUNNER_1),
            cell("mpistage", 8, 2, 10.0, 1500, 1000, 8500, **RUNNER_1),
        ],
    )


def test_cli_prints_the_table_from_a_results_file(results, capsys):
    assert cli_model(["--results", str(results), "--ranks", "1024,16384,131072"]) == 0
    out = capsys.readouterr().out
    assert f"inputs: numpy from {results}" in out
    rows = {(r[0], r[2]): r for r in table_rows(out)}
    assert len(rows) == 15  # 3 rank counts × 5 modes
    # plain at 1,024 ranks: 1,024 × 1,000 ops at 40,000 ops/s = 25.6 s; run 0.5 s
    assert rows[("1,024", "plain")][3] == "25.6"
    assert rows[("1,024", "plain")][7] == "0.50"
    # the runner: 500 extra + 1,024 × 1,000 ops = 25.6 s; 10 MB at 1 GB/s each
    # for rank 0's read and for the leaders' write
    assert rows[("1,024", "mpistage")][3] == "25.6"
    assert rows[("1,024", "mpistage")][6] == "0.010"
    assert "note: staged-env: not in the results; built-in inputs" in out
    assert "note: mpistage:" not in out


def test_a_node_boot_charges_each_node_its_first_rank(tmp_path, capsys):
    # 8 ranks on 2 nodes: the first rank of each node paid 1,600 ops, the
    # others 500; rank 0 (a first rank) 2,000
    boot = dict(RUNNER_1, ops_first=1600)
    results = write_results(
        tmp_path / "results.json",
        [
            cell("mpistage", 1, 1, 2.0, 1500, 1500, 1500, **RUNNER_1),
            cell("mpistage", 8, 2, 10.0, 2000, 500, 5600, **boot),
        ],
    )
    argv = ["--results", str(results), "--ranks", "1024", "--modes", "mpistage"]
    assert cli_model(argv) == 0
    out = capsys.readouterr().out
    # ops/rank 500, rank 0's extra 2,000 - 500, each node's extra 1,600 - 500
    assert "| mpistage | 500 | 1,500 | 1,100 | 0 |" in out
    # 1,500 + 32 nodes × 1,600 + 992 × 500 = 548,700 ops at 40,000/s = 13.7 s
    assert table_rows(out)[0][3] == "13.7"


def test_validation_arithmetic(results, capsys):
    assert cli_model(["--validate", str(results), "--cores", "2"]) == 0
    out = capsys.readouterr().out
    # plain, 8 ranks on 2 cores: 8,000 ops at 1 ms + 0.5 s × 8/2 = 10.0 s
    # against 12.5 s measured: -20 %
    assert "| numpy | plain | 8 | 2 | 12.50 | 10.00 | -20.0 |" in out
    # mpistage: 500 + 8 × 1,000 ops = 8.5 s; broadcast of 10 MB to 2 leaders
    # (1 µs + 10 MB at 5 GB/s = 0.002 s); staging 0.3 s; run 0.2 × 4 = 0.8 s:
    # 9.60 s against 10.0 s, -4.0 %
    assert "| numpy | mpistage | 8 | 2 | 10.00 | 9.60 | -4.0 |" in out
    assert "| numpy | plain | 1 | 1 | 1.50 | 1.50 | +0.0 |" in out
    assert "| numpy | mpistage | 0.20 | 0.30 | 0 |" in out
    # 8,000 ops in 12.5 - 2.0 s of the plain job: 762 ops/s
    assert "the server answered 762 ops/s against the 1,000" in out


def test_seeds_put_the_model_beside_the_published_figures(capsys):
    assert cli_model(["--seeds"]) == 0
    out = capsys.readouterr().out
    # Hopper, 1,024 cores: 1,024 × 5,020 ops at 40,000/s + 1 s run = 130 s
    assert "| Hopper, Warp, 1,024 cores, /home (GPFS via DVS) | plain |" in out
    hopper = next(line for line in out.splitlines() if "1,024 cores" in line)
    assert "| 130 | 400 | 0.32 | 12,883 |" in hopper
    for published in ("438", "76.1", "215", "87.2", "2.16", "4,200", "420"):
        assert f"| {published} |" in out


def test_set_changes_one_input_and_refuses_unknown_keys(capsys):
    assert cli_model(["--ranks", "1024", "--set", "plain.ops_rank=5020"]) == 0
    plain = table_rows(capsys.readouterr().out)[0]
    assert plain[3] == "129"  # 1,024 × 5,020 ops at 40,000 ops/s = 128.5 s
    assert cli_model(["--set", "plain.opps=1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mpistage: error: --set: unknown input 'opps'")


def run_model(*args):
    """Run the command in a fresh interpreter, as a user would."""
    code = (
        "import sys; from mpistage.bench.model.cli import cli_model; "
        "sys.exit(cli_model(sys.argv[1:]))"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "content, expected",
    [
        ("not json {", "is not JSON"),
        ('{"meta": {}, "rows": []}', "has no 'rows' list"),
        ("missing-key", "row 0 has no key 'ops_rank0'"),
        ("bad-number", "row 0 key 'total_s' must be a number >= 0, not 'fast'"),
    ],
)
def test_a_bad_results_file_gives_a_one_line_error(tmp_path, content, expected):
    path = tmp_path / "results.json"
    row = cell("plain", 1, 1, 1.0, 10, 10, 10)
    if content == "missing-key":
        write_results(path, [row])
        data = json.loads(path.read_text())
        del data["rows"][0]["ops_rank0"]
        content = json.dumps(data)
    elif content == "bad-number":
        content = write_results(path, [{**row, "total_s": "fast"}]).read_text()
    path.write_text(content)
    for args in (["--validate", str(path)], ["--results", str(path)]):
        done = run_model(*args)
        assert done.returncode == 1, done.stderr
        assert done.stdout == ""
        lines = done.stderr.splitlines()
        assert len(lines) == 1, done.stderr
        assert lines[0].startswith("mpistage: error: results file ")
        assert expected in lines[0]


def test_plot_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "model.png"
    assert cli_model(["--ranks", "1024,131072", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_ranks([1024, 4096, 3000]) == [1024, 2048, 3000, 4096]
