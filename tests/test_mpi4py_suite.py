"""mpi4py's own test suite is the judge: every mode gives plain python's outcomes.

The ``test/`` directory of the installed mpi4py's sdist (fetched once with
pip, kept in ``${MPISTAGE_CI_CACHE:-~/.cache/mpistage-ci}/sdist``) runs as
its users run it, ``mpiexec -n 2 python test/main.py -v``, on 2 emulated
nodes: under plain python, then under the runner with live imports,
``--bundle`` (``pack mpi4py numpy``) and both ``--auto`` runs; and
``mpistage-env`` with the small venv packed whole (``pack --env``), judged
against that venv's own python, plain. Each rank's
report (unittest's verbose lines, on the rank's own stderr file) is parsed
into one outcome per test and subtest; any difference from plain python's
on the same rank fails the test.

Only a subset of mpi4py's test modules runs (:data:`MODULES`), so that five
runs take a few minutes on two cores: those that look at the package as
installed (``test_mpiapi`` reads ``libmpi.pxd`` beside ``MPI.__file__``,
``test_package``, ``test_toplevel``, ``test_mpiabi``, ``test_environ``,
``test_doc``), the ones that pickle, subclass and raise across ranks, the
``mpi4py.util`` modules but ``dtlib`` (30 s alone: it walks every datatype
combination, nothing of mpistage's), and no ``test_spawn`` (15 s; its
children are started by MPI as plain python, out of mpistage's reach).
"""

import os
import re
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import mpi4py
import pytest

from envtools import small_venv
from stagetools import MPIEXEC, PYTHON, clean_environ, pack, run

pytestmark = pytest.mark.slow

MPISTAGE = str(Path(PYTHON).parent / "mpistage")
ENV_SCRIPT = str(Path(__file__).resolve().parent.parent / "bin" / "mpistage-env")
CACHE = Path(
    os.environ.get("MPISTAGE_CI_CACHE", Path.home() / ".cache" / "mpistage-ci")
)
MODULES = (
    "test_mpiapi", "test_package", "test_toplevel", "test_mpiabi",
    "test_environ", "test_doc", "test_ctypes", "test_pickle", "test_objmodel",
    "test_exceptions", "test_errorcode", "test_p2p_obj", "test_cco_obj",
    "test_subclass", "test_dynproc", "test_util_pkl5", "test_util_sync",
    "test_util_pool",
)  # fmt: skip
# One verbose line of unittest: "name (module.Class.name) [(params)] ... outcome".
LINE = re.compile(r"^\s*(\w+ \([\w.]+\)(?: \(.*\))?) \.\.\. (.*)$")
OUTCOMES = ("ok", "FAIL", "ERROR", "skipped", "expected failure", "unexpected success")
# Each rank writes its report to a file of its own; exec keeps the rank the
# launcher's child, as the node boot expects.
PER_RANK = 'exec "$0" "$@" 2>"$MPISTAGE_TEST_OUT/rank-$PMI_RANK.err"'


def sdist():
    """The installed mpi4py's sdist: from the cache, else fetched once by pip."""
    version = mpi4py.__version__
    where = CACHE / "sdist"
    found = where / f"mpi4py-{version}.tar.gz"
    if not found.is_file():
        where.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
        pip += ["--no-binary", ":all:", "-d", str(where), f"mpi4py=={version}"]
        done = subprocess.run(pip, capture_output=True, text=True, timeout=300)
        if done.returncode != 0 or not found.is_file():
            pytest.skip(f"cannot fetch mpi4py {version}'s sdist: {done.stderr[-300:]}")
    return found


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """mpi4py's ``test/`` directory, extracted from its sdist for this session."""
    base = tmp_path_factory.mktemp("mpi4py-suite")
    prefix = f"mpi4py-{mpi4py.__version__}/test/"
    with tarfile.open(sdist()) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(base, members=members, filter="data")
    return base / prefix


def outcomes(text):
    """Map each test (and subtest) of one rank's report to its outcome(s)."""
    found = Counter()
    for line in text.splitlines():
        match = LINE.match(line)
        if match:
            word = next((o for o in OUTCOMES if match[2].startswith(o)), match[2])
            found[(match[1], word)] += 1
    return found


def run_suite(suite, out, options, entry=None):
    """Run the suite under *options* (``None``: plain python); outcomes per rank.

    *entry*, when given, is the command that starts each rank's Python.
    """
    out.mkdir()
    env = dict(clean_environ(), MPISTAGE_TEST_OUT=str(out))
    env.update(MPISTAGE_EMULATE_NODES="2", MPISTAGE_STAGE_DIR=str(out))
    env["MPISTAGE_STAGE_FALLBACK"] = "no"
    if entry is None:
        entry = [PYTHON] if options is None else [PYTHON, MPISTAGE, *options]
    args = [x for m in MODULES for x in ("-i", m)]
    cmd = [MPIEXEC, "-n", "2", "sh", "-c", PER_RANK, *entry, "main.py", "-v", *args]
    result = run(cmd, env=env, cwd=suite, timeout=300)
    reports = [(out / f"rank-{r}.err").read_text() for r in range(2)]
    assert all("\nRan " in text for text in reports), (result, reports)
    return result.returncode, [outcomes(text) for text in reports]


@pytest.fixture(scope="module")
def plain(suite, tmp_path_factory):
    """Plain python's outcomes, the reference."""
    if MPIEXEC is None:
        pytest.skip("no mpiexec next to this Python nor on PATH")
    return run_suite(suite, tmp_path_factory.mktemp("plain") / "out", None)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """``pack mpi4py numpy``, once."""
    pytest.importorskip("numpy")
    path = tmp_path_factory.mktemp("suite-bundle") / "b.mpistage"
    return pack(path, "mpi4py", "numpy")


def differences(plain, got):
    """Per rank, the outcomes one run has and the other has not."""
    return [
        (sorted((want - have).items()), sorted((have - want).items()))
        for want, have in zip(plain, got, strict=True)
        if want != have
    ]


def test_plain_runs_the_subset(plain):
    code, ranks = plain
    print(f"plain: exit {code}, outcomes per rank {[sum(f.values()) for f in ranks]}")
    for found in ranks:  # every module of the subset ran, test_mpiapi's two too
        names = {name for name, _outcome in found}
        assert sum(found.values()) > 500, len(found)
        for module in MODULES:
            assert any(f"({module}." in name for name in names), module
        for test in ("testLargeCountSymbols", "testSymbolCoverage"):
            assert any(name.startswith(test + " (test_mpiapi.") for name in names)


@pytest.mark.parametrize("mode", ["live", "bundle", "auto"])
def test_every_mode_gives_plain_pythons_outcomes(suite, plain, bundle, tmp_path, mode):
    if mode == "auto":
        cache = str(tmp_path / "cache")
        runs = [["--auto", "--cache-dir", cache]] * 2  # learning, then replay
    else:
        runs = [["--bundle", str(bundle)] if mode == "bundle" else []]
    for i, options in enumerate(runs):
        code, ranks = run_suite(suite, tmp_path / f"out{i}", options)
        differ = differences(plain[1], ranks)
        counts = [sum(found.values()) for found in ranks]
        print(f"{mode} run {i + 1}: outcomes per rank {counts}, differing {differ}")
        assert differ == [], (mode, i)
        assert code == plain[0], (mode, i)


def test_mpistage_env_gives_the_venvs_own_outcomes(
    suite, tmp_path, tmp_path_factory, env_bundle
):
    python = str(small_venv(tmp_path_factory).python)
    plain = run_suite(suite, tmp_path / "plain", None, [python])
    staged = [ENV_SCRIPT, str(env_bundle), "--", "python"]
    code, ranks = run_suite(suite, tmp_path / "env", None, staged)
    differ = differences(plain[1], ranks)
    counts = [sum(found.values()) for found in ranks]
    print(f"mpistage-env: outcomes per rank {counts}, differing {differ}")
    assert differ == [] and code == plain[0]
