"""numpy's and pandas' own test suites are the judges too, as their users run them.

Both ship their tests in their wheels, and their users run them with
``pytest --pyargs``. A subset of each (:data:`SUITES`), in one pytest
session, runs on 2 ranks and 2 emulated nodes under plain python, then
under the runner with live imports, ``--bundle`` with ``pack``'s defaults
(``pack numpy pandas tzdata``: test directories left out, so pytest finds
them where plain python does) and both ``--auto`` runs; and in a venv of
numpy, pandas, pytest and hypothesis packed whole (``pack --env``) under
``mpistage-env`` and ``mpistage run --env``, judged against that venv's
own python, plain. Each rank writes its own JUnit report; every test's
outcome on every rank must be plain python's, and so must the exit status.
The bundle and the venv are made once for the module, and the venv keeps
only the test directories the subsets use, so that it packs small.

The subsets are small, so that all of it takes about two minutes on two
busy cores (CONTRIBUTING.md), and chosen for what looks beside a module:
``numpy.fft`` is collected as a package directory (the copy's lacks
``tests/``), ``test_public_api`` walks numpy with ``pkgutil``,
``test_ctypeslib`` loads an extension by its ``__file__``,
``random/tests/test_direct`` reads data beside its test file,
``test_reloading`` pickles and reloads numpy in a child process;
``pandas.tests.tslibs.test_timezones`` reads time zones through
``importlib.resources`` (tzdata, in the bundle). ``MPISTAGE_SUITES=larger``
adds more of each project (:data:`LARGER`). Each subset passes under plain
python: a rank whose program exits nonzero ends an mpistage job, as with
``python -m mpi4py``.
"""

import json
import os
import shutil
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

from envtools import build_venv, site_entries
from stagetools import MPIEXEC, PYTHON, clean_environ, mpistage, pack, run

pytestmark = pytest.mark.slow

MPISTAGE = str(Path(PYTHON).parent / "mpistage")
ENV_SCRIPT = str(Path(__file__).resolve().parent.parent / "bin" / "mpistage-env")
SUITES = {
    "numpy": (
        "numpy.fft", "numpy.tests.test_public_api", "numpy.tests.test_ctypeslib",
        "numpy.random.tests.test_direct", "numpy.tests.test_reloading",
    ),
    "pandas": (
        "pandas.tests.api", "pandas.tests.test_common",
        "pandas.tests.tslibs.test_timezones",
    ),
}  # fmt: skip
LARGER = {
    "numpy": (
        "numpy.lib", "numpy.linalg", "numpy.polynomial", "numpy.matrixlib",
        "numpy.ma", "numpy.random", "numpy.tests.test_lazyloading",
        "numpy.tests.test_numpy_config", "numpy._core.tests.test_umath_accuracy",
    ),
    "pandas": (
        "pandas.tests.frame.test_api", "pandas.tests.config",
        "pandas.tests.io.formats.test_css", "pandas.tests.tslibs",
        "pandas.tests.test_register_accessor",
    ),
}  # fmt: skip
DISTRIBUTIONS = ("numpy", "pandas", "pytest", "hypothesis", "setuptools")
# Each rank writes its own JUnit report and output; exec keeps the rank the
# launcher's child, as the node boot expects.
PER_RANK = (
    'PYTEST_ADDOPTS="--junitxml=$MPISTAGE_TEST_OUT/rank-$PMI_RANK.xml" '
    'exec "$0" "$@" >"$MPISTAGE_TEST_OUT/rank-$PMI_RANK.out" 2>&1'
)
# The same configuration everywhere: no ini file found above site-packages
# (this repository's pyproject.toml would be, for its own venv), no cache;
# tests named by their whole path (see dotted_name).
PYTEST = ["-m", "pytest", "-c", "{ini}", "--rootdir", "/", "-p", "no:cacheprovider"]
PYTEST += ["-q", "--pyargs"]
TIMEOUT = 300


def modules():
    """The test modules and packages this run takes, of both projects."""
    larger = os.environ.get("MPISTAGE_SUITES", "") == "larger"
    return [m for p in SUITES for m in SUITES[p] + (LARGER[p] if larger else ())]


class Judge:
    """What the runs of this module share: where they go, the reference runs."""

    def __init__(self, base):
        self.base, self.runs, self.plain = base, 0, {}
        self.ini = base / "pytest.ini"
        self.ini.write_text("[pytest]\n")

    def environ(self, out):
        """The environment of one run: emulated nodes, its own output and copies."""
        env = dict(clean_environ(), MPISTAGE_TEST_OUT=str(out))
        env.update(MPISTAGE_EMULATE_NODES="2", MPISTAGE_STAGE_DIR=str(out))
        env.update(MPISTAGE_STAGE_FALLBACK="no")
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        return env

    def run(self, entry, launch=None, env=None):
        """Run the subsets with *entry* starting each rank's Python.

        *launch*, when given, is the words before ``mpiexec`` (``mpistage
        run --env ...``). Returns (exit status, outcomes per rank).
        """
        self.runs += 1
        out = self.base / f"run{self.runs}"
        out.mkdir()
        environ = dict(self.environ(out), **(env or {}))
        pytest_args = [a.format(ini=self.ini) for a in PYTEST]
        ranks = [MPIEXEC, "-n", "2", "sh", "-c", PER_RANK, *entry, *pytest_args]
        command = [*(launch or []), *ranks, *modules()]
        result = run(command, env=environ, cwd=out, timeout=TIMEOUT)
        reports = [out / f"rank-{r}.xml" for r in range(2)]
        assert all(p.is_file() for p in reports), (result, output(out))
        return result.returncode, [outcomes(p) for p in reports]

    def reference(self, python=PYTHON):
        """Plain python's outcomes (with *python*), run once."""
        if python not in self.plain:
            self.plain[python] = self.run([str(python)])
        return self.plain[python]


def output(out):
    """The ranks' own output, for a failure's message."""
    return "\n".join(p.read_text()[-3000:] for p in sorted(out.glob("rank-*.out")))


def outcomes(report):
    """Map each test of one rank's JUnit *report* to its outcome (counted)."""
    found = Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = [c for c in case if c.tag in ("failure", "error", "skipped")]
        outcome = kinds[0].tag if kinds else "passed"
        if outcome == "skipped" and kinds[0].get("type") == "pytest.xfail":
            outcome = "xfailed"
        found[(dotted_name(case.get("classname")), case.get("name"), outcome)] += 1
    return found


def dotted_name(classname):
    """The test's dotted name from its project on: the same wherever it lies.

    The tests are named by their path from ``/``, which for a staged
    environment is another one.
    """
    parts = (classname or "").split(".")
    tops = [i for i, part in enumerate(parts) if part in SUITES]
    return ".".join(parts[tops[0] :] if tops else parts)


def differences(plain, got):
    """Per rank, (some of) the outcomes one run has and the other has not."""
    return [
        (sorted((want - have).items())[:10], sorted((have - want).items())[:10])
        for want, have in zip(plain, got, strict=True)
        if want != have
    ]


def assert_as_plain(plain, got, what):
    """Every rank's outcomes and the exit status are plain python's."""
    code, ranks = got
    differ = differences(plain[1], ranks)
    counts = [sum(found.values()) for found in ranks]
    print(f"{what}: exit {code}, outcomes per rank {counts}, differing {differ}")
    assert differ == [], what
    assert code == plain[0], (what, code, plain[0])


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    """This module's setting, after checking what the runs need."""
    for name in ("numpy", "pandas", "hypothesis", "tzdata"):
        pytest.importorskip(name)
    if MPIEXEC is None:
        pytest.skip("no mpiexec next to this Python nor on PATH")
    return Judge(tmp_path_factory.mktemp("suites"))


@pytest.fixture(scope="module")
def bundle(judge):
    """``pack numpy pandas tzdata`` with pack's defaults: no test directories."""
    return pack(judge.base / "b.mpistage", "numpy", "pandas", "tzdata")


@pytest.fixture(scope="module")
def suites_env(judge):
    """A venv of numpy, pandas, pytest and hypothesis, and its ``pack --env``."""
    venv = build_venv(judge.base / "venv", site_entries(DISTRIBUTIONS))
    prune_tests(venv.site, modules())
    path = judge.base / "env.mpistage"
    command = ["pack", "--env", venv.prefix, "-o", path]
    done = mpistage(command, clean_environ(), timeout=TIMEOUT)
    assert done.returncode == 0, done
    yield venv, path
    shutil.rmtree(venv.prefix, ignore_errors=True)
    path.unlink(missing_ok=True)


def prune_tests(site, wanted):
    """Remove the test directories below *site* that no module of *wanted* needs.

    A directory without test modules (a test module's ``data/``) stays.
    """
    for project in SUITES:
        for folder, dirs, _files in os.walk(site / project):
            dotted = ".".join(Path(folder).relative_to(site).parts)
            for name in list(dirs):
                below, path = f"{dotted}.{name}", Path(folder, name)
                if "tests" not in below.split(".") or needed(below, wanted):
                    continue
                if any(path.rglob("test_*.py")):
                    shutil.rmtree(path)
                    dirs.remove(name)


def needed(dotted, wanted):
    """Whether the package *dotted* is one of *wanted*, in one, or leads to one."""
    return any(
        w == dotted or w.startswith(dotted + ".") or dotted.startswith(w + ".")
        for w in wanted
    )


def test_plain_runs_the_subsets(judge):
    code, ranks = judge.reference()
    assert code == 0
    for found in ranks:  # every module of the subsets ran on every rank
        names = {f"{name}." for name, _test, _outcome in found}
        assert sum(found.values()) > 400, found
        for module in modules():
            assert any(name.startswith(module + ".") for name in names), module


@pytest.mark.parametrize("mode", ["live", "bundle", "auto"])
def test_the_runner_gives_plain_pythons_outcomes(judge, bundle, mode):
    plain = judge.reference()
    if mode == "auto":
        cache = str(judge.base / "cache")
        runs = [["--auto", "--cache-dir", cache]] * 2  # learning, then replay
    else:
        runs = [["--bundle", str(bundle)] if mode == "bundle" else []]
    for i, options in enumerate(runs):
        report = judge.base / f"report-{mode}-{i}.json"
        env = {"MPISTAGE_REPORT": str(report)}
        got = judge.run([PYTHON, MPISTAGE, *options], env=env)
        assert_as_plain(plain, got, f"{mode} run {i + 1}")
    if mode == "bundle":
        assert_report_names_the_tests(report)


def assert_report_names_the_tests(report):
    """The report says that the ranks listed test directories the copy lacks."""
    import numpy

    facts = json.loads(report.read_text())
    listed = dict(facts["original_accesses"]["beside"]["listings"])
    tests = os.path.join(os.path.dirname(numpy.__file__), "fft", "tests")
    assert listed.get(tests, 0) >= 2, listed  # by pytest, on each rank


def test_the_environment_gives_the_venvs_own_outcomes(judge, suites_env):
    venv, path = suites_env
    plain = judge.reference(venv.python)
    assert plain[0] == 0
    got = judge.run([ENV_SCRIPT, str(path), "--", "python"])
    assert_as_plain(plain, got, "mpistage-env")
    folder = str(judge.base / "run-env" / "n{node}")
    launch = [PYTHON, MPISTAGE, "run", "--env", str(path), "--to", folder, "--"]
    got = judge.run([PYTHON], launch=launch)  # python: replaced by the staged one
    assert_as_plain(plain, got, "mpistage run --env")
    assert not Path(folder).parent.exists()  # cleaned on every node
