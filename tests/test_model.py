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
from mpistage.bench.model.equations import MODES
from mpistage.bench.model.plot import plot_ranks
from mpistage.bench.model.seeds import (
    SEEDS,
    blue_waters_cache,
    edison_bundle,
    edison_launch,
    seed_ratios,
)

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
    launch_base=1.0,
    launch_node=0.1,
    launch_rank=0.01,
    tree_width=2,
    tree_block=1e7,
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
    # the launcher: 1 s + 4 nodes × 0.1 s + 16 ranks × 0.01 s
    assert steps["launch"] == pytest.approx(1.56)
    assert steps["total"] == pytest.approx(3.7935)


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
        for mode in MODES
    ]
    # plain at 16,384 ranks: 16,384 × 6,073 ops at 40,000 ops/s = 2,487.5 s
    assert rows[6][3] == "2,488"
    # the runner: 508 + 512 first ranks × 1,626 + 15,872 others × 553 ops
    # = 9,610,236 ops at 40,000 ops/s = 240 s
    assert rows[7][2] == "mpistage" and rows[7][3] == "240"
    # the launch at 16,384 ranks on 512 nodes:
    # 2.998 + 512 × 6.441 ms + 16,384 × 0.6717 ms = 2.998 + 3.298 + 11.005 s
    assert rows[6][8] == "17.3"
    for i in range(0, 18, 6):
        totals = [float(r[9].replace(",", "")) for r in rows[i : i + 5]]
        assert totals[0] > totals[1] >= totals[2] > totals[3] > totals[4]
    # mpistage-env's targets (issue #28), launch included: ≤ 30 s at 16,384
    # ranks (8.24 + 17.3 s), ≤ 200 s at 131,072 (63.6 + 117.5 s)
    assert rows[10][2] == "env-launch" and float(rows[10][9]) <= 30
    assert rows[16][2] == "env-launch" and float(rows[16][9].replace(",", "")) <= 200


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
    assert len(rows) == 18  # 3 rank counts × 6 modes
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
    # Hopper, 36K cores: 36,864 × 5,020 ops at 40,000/s = 4,626 s, + 1 s run,
    # + launch 2.998 + 1,536 × 6.441 ms + 36,864 × 0.6717 ms = 37.7 s: 4,665 s
    hopper = next(line for line in out.splitlines() if "36K cores" in line)
    assert "| check | plain |" in hopper
    assert "| 4,665 | 4,200 | 1.11 |" in hopper
    # /home is 4 × slower than /scratch: 1,024 × 5,020 ops at 10,000/s = 514 s,
    # + 1 s run + launch 2.998 + 43 × 6.441 ms + 1,024 × 0.6717 ms = 3.961 s
    home = next(line for line in out.splitlines() if "/home" in line)
    assert "| fit: /home's server" in home and "| 519 | 400 | 1.30 |" in home
    for published in ("438", "76.1", "215", "87.2", "2.16", "4,200", "420", "110"):
        assert f"| {published} |" in out
    assert out.count("(outside 2×)") == 1
    assert "8 fit rows, each setting one parameter; 11 of 12 check rows" in out
    assert "outside 2×: Hopper, Warp, 40K cores, DLcache + FMcache (2.28): " in out


def test_every_seed_row_is_within_two_times_but_the_one_said_to_be_outside():
    outside = {s["case"] for s in SEEDS if "outside" in s}
    assert outside == {"Hopper, Warp, 40K cores, DLcache + FMcache"}
    ratios = seed_ratios()
    assert len(ratios) == len(SEEDS) == 20
    for case, role, ratio in ratios:
        assert role in ("fit", "check")
        if case not in outside:
            assert 0.5 <= ratio <= 2.0, (case, ratio)
    checks = [r for r in ratios if r[1] == "check"]
    assert len(checks) == 12
    # every Edison fit row is met: the fit has as many rows as unknowns
    for case, role, ratio in ratios:
        if role == "fit" and case.startswith("Edison"):
            assert ratio == pytest.approx(1.0, abs=1e-3)  # the defaults round the fit


def test_the_launch_is_fitted_on_edison_by_hand():
    # stage step's launch = real - bcast - tar - chmod:
    # 1 node: 11.083 - 0.433365 - 7.58505 - 0.0590911 = 3.005494
    # 5,310 nodes: 87.233 - 2.15751 - 43.1168 - 1.19226 = 40.76643
    # per node + per rank = (40.76643 - 3.005494) / 5,309 = 7.112627 ms
    # base = 3.005494 - 0.007113 = 2.998381 s
    # run step: 128.020 - 8.235 = 119.785 s for 5,309 nodes and 127,416 ranks:
    # per rank = (119.785 - 5,309 × 7.112627 ms) / 122,107 = 0.6717392 ms
    # per node = 7.112627 - 0.671739 = 6.440888 ms
    # run = 8.235 - 2.998381 - 0.006441 - 24 × 0.000672 = 5.214056 s
    base, node, rank, run_s = edison_launch()
    assert base == pytest.approx(2.998381, abs=1e-6)
    assert node == pytest.approx(6.440888e-3, rel=1e-6)
    assert rank == pytest.approx(6.717392e-4, rel=1e-6)
    assert run_s == pytest.approx(5.214056, abs=1e-6)
    # the default machine carries the fit
    machine = Machine()
    assert machine.launch_base == pytest.approx(base, rel=1e-3)
    assert machine.launch_node == pytest.approx(node, rel=1e-3)
    assert machine.launch_rank == pytest.approx(rank, rel=1e-3)
    # the tarballs: 0.433365 s for a read and a write at 1 GB/s each: 216.7 MB;
    # the broadcast to 5,310 nodes, 13 hops: (2.15751 - 0.433365) / 13 - 5 µs
    # = 0.1326214 s a hop, so 216.68 MB / 0.1326214 s = 1.6338 GB/s
    size, link = edison_bundle(machine)
    assert size == pytest.approx(216.6825e6)
    assert link == pytest.approx(1.63384e9, rel=1e-5)


def test_blue_waters_node_cache_is_fitted_by_hand():
    # 16,384 ranks on 512 nodes: launch 2.998 + 3.298 + 11.005 = 17.301 s;
    # read 16,384 × 9.7 MB at 35 GB/s = 4.541 s; run 0.5 s; the metadata has
    # 437.6 - 22.342 = 415.258 s: 16,610,320 ops at 40,000/s. The 512 first
    # ranks make 512 × 4,557 = 2,333,184; the 15,872 others 14,277,136 of
    # their 72,328,704: h = 1 - 0.197393 = 0.8026
    assert blue_waters_cache(Machine()) == pytest.approx(0.8026, abs=1e-4)


def test_launch_of_a_stage_step_and_the_launchers_tree():
    staged = Inputs(stage_launch=1)
    # the job's launch 1.56 s, and the stage step's, 4 processes on 4 nodes:
    # 1 + 4 × 0.1 + 4 × 0.01 = 1.44 s
    assert predict(staged, 16, 4, HAND)["launch"] == pytest.approx(3.0)
    tree = Inputs(ops_job=5, bundle_bytes=4e7, bundle_tree=1)
    steps = predict(tree, 16, 4, HAND)
    # a tree of 2 reaches 4 nodes in 2 levels; each level sends the whole file
    # twice over one link: 2 × 40 MB at 0.1 GB/s = 0.8 s, and 4 blocks of
    # 10 MB, each 1 ms: 2 × (0.8 + 0.004) = 1.608 s
    assert steps["broadcast"] == pytest.approx(1.608)
    assert steps["read"] == pytest.approx(0.4)  # read once, 40 MB at 0.1 GB/s
    assert steps["write"] == pytest.approx(0.4)
    assert steps["metadata"] == pytest.approx(5 / 4000)  # the launcher's open
    # 5 nodes need a third level
    assert predict(tree, 20, 5, HAND)["broadcast"] == pytest.approx(2.412)
    assert predict(tree, 4, 1, HAND)["broadcast"] == 0


def test_gpu_environment_at_131072_ranks(capsys):
    assert cli_model(["--env", "gpu", "--ranks", "131072"]) == 0
    out = capsys.readouterr().out
    rows = {r[2]: r for r in table_rows(out)}
    assert set(rows) == set(MODES)
    assert all(r[1] == "2,048" for r in rows.values())  # 64 ranks per node
    bcast = rows["env-launch-bcast"]
    # read once: 8 GB at 1 GB/s; the tree of 8 needs 4 levels for 2,048 nodes,
    # each 8 × 8 GB at 5 GB/s = 12.8 s, and 954 blocks × 5 µs: 51.22 s;
    # write 8 s; run 4.3 s; launch 2.998 + 2,048 × 6.441 ms + 131,072 ×
    # 0.6717 ms = 104.2 s: 175.7 s, above the 60 s asked for
    assert bcast[4:10] == ["8.00", "51.2", "8.00", "4.30", "104", "176"]
    # every node reads 8 GB itself: 2,048 × 8 GB at 35 GB/s = 468 s
    assert rows["env-launch"][4] == "468"
    # plain: 131,072 × (1,933 + 6,859) ops at 40,000/s = 28,810 s
    assert rows["plain"][3] == "28,810"


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


def test_the_weights_term_by_hand(capsys):
    """140 GB in 30 shards at 512 nodes of 4 ranks, on the default machine."""
    from mpistage.bench.model.weights import weights_seconds

    machine, size, ops = Machine(ranks_per_node=4), 140e9, 4 * 31
    plain = weights_seconds("plain", size, 30, 2048, 512, machine)
    # every node fetches W: 512 * 140 GB / 35 GB/s; 2048 ranks * 124 ops / 40,000/s
    assert plain["read"] == pytest.approx(2048.0)
    assert plain["metadata"] == pytest.approx(2048 * ops / 40_000)
    assert plain["total"] == pytest.approx(2048.0 + 6.3488)
    staged = weights_seconds("mpistage", size, 30, 2048, 512, machine)
    # one reader at 1 GB/s is the slowest of read (140 s), the pipelined
    # broadcast ((9 + 33,379 - 1) pieces of 4 MiB: 28.2 s) and the write
    # (140 s); one 64 MiB piece through the reader and the writer fills it
    piece = 64 * 2**20
    assert staged["stream"] == pytest.approx(140 + 2 * piece / 1e9)
    assert staged["total"] == pytest.approx(ops / 2000 + 140 + 2 * piece / 1e9)
    assert cli_model(["--weights", "140GB", "--ranks-per-node", "4",
                      "--ranks", "2048,16384", "--modes", "plain"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "| 16,384 | 4,096 | plain | 50.8 | 16,384 | - | 16,435 |" in out
    assert "| 16,384 | 4,096 | mpistage | 0.062 | 140 | 140 | 140 | 140 GB |" in out
