"""The real-package tier: scipy, pandas, matplotlib, scikit-learn, h5py and jax.

jax is the heavy stack: ``jaxlib``'s 350 MB of extensions and libraries,
compiled with XLA at run time.

Each package runs in every way mpistage offers, at 4 ranks on 2 emulated
nodes, and each rank checks a real result (a linear solve, a groupby, a PNG
from Agg, a fitted model's prediction, an HDF5 file written and read back):

- ``pack`` by name, without and with ``--stdlib``;
- ``record`` of one code path, replayed on another;
- ``--auto`` twice, the second run on a code path the first did not take;
- no bundle at all: live imports fill each node's copy as the ranks import;
- ``mpistage.staged()``, with imports after the block;
- ``pack --env`` and ``mpistage run``.

One program holds every package's two code paths, so each mode is one job
(its result shared by the five tests of that mode) and the bundles are made
once per session. ``pytest -m "not packages"`` leaves the tier out.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from recordtools import record, replay
from stagetools import MPIEXEC, PYTHON, clean_environ, mpirun, mpistage, reap_shm

pytestmark = pytest.mark.packages

RANKS, NODES = 4, 2
TIMEOUT = 300

# Each package: its import name, then two code paths. A path is a function
# body returning something JSON can hold; "more" imports what "base" did not.
PACKAGES = {
    "scipy": (
        "scipy",
        """
import numpy as np, scipy.linalg
a = np.array([[3.0, 1.0], [1.0, 2.0]])
return [round(float(v), 9) for v in scipy.linalg.solve(a, np.array([9.0, 8.0]))]
""",
        """
import statistics  # a standard library module the base path does not use
import numpy as np, scipy.sparse, scipy.sparse.linalg, scipy.optimize
m = scipy.sparse.csr_matrix(np.array([[4.0, 0.0], [0.0, 2.0]]))
x = scipy.sparse.linalg.spsolve(m, np.array([8.0, 2.0]))
root = scipy.optimize.brentq(lambda t: t * t - 2.0, 0.0, 2.0)
return [round(float(v), 9) for v in x] + [round(root, 9), statistics.median([3, 1, 2])]
""",
    ),
    "pandas": (
        "pandas",
        """
import pandas as pd
df = pd.DataFrame({"k": ["a", "b", "a"], "v": [1, 2, 3]})
return {k: int(v) for k, v in df.groupby("k")["v"].sum().items()}
""",
        """
import io, pandas as pd
s = pd.Series(range(48), index=pd.date_range("2024-01-01", periods=48, freq="h"))
csv = pd.read_csv(io.StringIO("a,b\\n1,2\\n3,4\\n"))
return [int(x) for x in s.resample("D").sum()] + [int(csv["b"].sum())]
""",
    ),
    "matplotlib": (
        "matplotlib",
        """
import io, matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.plot([1, 2, 3], [1, 4, 9])
ax.set_title("agg")
buf = io.BytesIO()
fig.savefig(buf, format="png")
return [buf.getvalue()[:4].hex(), len(buf.getvalue()) > 1000]
""",
        """
import io, matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.bar(["x", "y"], [3, 5])
buf = io.BytesIO()
fig.savefig(buf, format="svg")
return ["<svg" in buf.getvalue().decode(), len(buf.getvalue()) > 1000]
""",
    ),
    "sklearn": (
        "sklearn",
        """
import numpy as np
from sklearn.linear_model import LinearRegression
x = np.arange(10.0).reshape(-1, 1)
model = LinearRegression().fit(x, 3 * x.ravel() + 2)
return [round(float(model.coef_[0]), 6), round(float(model.predict([[20.0]])[0]), 6)]
""",
        """
import numpy as np
from sklearn.tree import DecisionTreeClassifier
from sklearn.preprocessing import StandardScaler
x = StandardScaler().fit_transform(np.arange(20.0).reshape(-1, 1))
tree = DecisionTreeClassifier(random_state=0).fit(x, [0] * 10 + [1] * 10)
return [int(v) for v in tree.predict(x[[0, 19]])]
""",
    ),
    "h5py": (
        "h5py",
        """
import os, numpy as np, h5py
path = os.path.join(OUT, f"base-{RANK}.h5")
with h5py.File(path, "w") as f:
    f["x"] = np.arange(10)
with h5py.File(path, "r") as f:
    return int(f["x"][()].sum())
""",
        """
import os, numpy as np, h5py
path = os.path.join(OUT, f"more-{RANK}.h5")
with h5py.File(path, "w") as f:
    group = f.create_group("g")
    group.attrs["who"] = "rank"
    group.create_dataset("y", data=np.arange(100), compression="gzip")
with h5py.File(path, "r") as f:
    return [int(f["g/y"][()].sum()), f["g"].attrs["who"]]
""",
    ),
    "jax": (
        "jax",
        """
import jax, jax.numpy as jnp
return float(jax.jit(lambda x: (x * x).sum())(jnp.arange(4.0)))
""",
        """
import jax, jax.numpy as jnp
grad = jax.grad(lambda x: (x ** 3).sum())
rank = int(jnp.linalg.matrix_rank(jnp.eye(3)))
return [float(v) for v in grad(jnp.arange(3.0))] + [rank]
""",
    ),
}

EXPECTED = {
    "scipy": ([2.0, 3.0], [2.0, 1.0, 1.414213562, 2]),
    "pandas": ({"a": 4, "b": 2}, [276, 852, 6]),
    "matplotlib": (["89504e47", True], [True, True]),
    "sklearn": ([3.0, 62.0], [0, 1]),
    "h5py": (45, [4950, "rank"]),
    "jax": (14.0, [0.0, 3.0, 12.0, 3]),
}

NAMES = sorted(PACKAGES)
# h5py takes 10 to 25 s a case (four times any other): the default suite packs
# it by name and imports it live; its other modes are the extended tier's.
LIGHT = [
    pytest.param(n, marks=pytest.mark.extended) if n == "h5py" else n for n in NAMES
]
PACK_NAMES = [
    "numpy",
    "scipy",
    "pandas",
    "matplotlib",
    "sklearn",
    "h5py",
    "jax",
    "jaxlib",
]
DISTRIBUTIONS = ("numpy", "scipy", "pandas", "matplotlib", "scikit-learn", "h5py")
DISTRIBUTIONS += ("jax",)

HEAD = """\
import json, os, sys, traceback
OUT = os.environ["MPISTAGE_TEST_OUT"]
RANK = int(os.environ.get("PMI_RANK", "0"))
MORE = "more" in sys.argv[1:]
STAGED = "staged" in sys.argv[1:]

def where(name):
    module = sys.modules[name]
    loader = getattr(module, "__loader__", None)
    path = module.__file__
    return loader.staged_path(path) if hasattr(loader, "staged_path") else path

def run(name, top, func):
    try:
        return {"result": func(), "file": where(top)}
    except Exception:
        return {"error": traceback.format_exc()}
"""

STAGED_RUN = """
from mpi4py import MPI
import mpistage
facts, keep = {}, "keep" in sys.argv[1:]
with mpistage.staged(os.environ["PACKAGES_BUNDLE"], MPI.COMM_WORLD, keep=keep) as s:
    for name, (top, base, more) in PATHS.items():
        facts[name] = {"base": run(name, top, base), "copy": s.staged.path}
for name, (top, base, more) in PATHS.items():  # submodules imported after
    facts[name].update(run(name, top, more))
"""

PLAIN_RUN = """
facts = {name: run(name, top, more if MORE else base)
         for name, (top, base, more) in PATHS.items()}
"""

ONLY = """
ONLY = os.environ.get("PACKAGES_ONLY")
PATHS = {k: v for k, v in PATHS.items() if not ONLY or k in ONLY.split(",")}
"""

TAIL = """
with open(os.path.join(OUT, f"{RANK}.json"), "w") as f:
    json.dump(facts, f)
"""


def indent(block):
    """Return *block* indented one level, as the body of an ``if``."""
    return "\n" + "".join(f"    {line}\n" for line in block.strip().splitlines())


def program():
    """The tier's program: every package's two paths, run on every rank."""
    parts = [HEAD]
    for name, (_top, base, more) in PACKAGES.items():
        for kind, body in (("base", base), ("more", more)):
            parts.append(f"\ndef {name}_{kind}():{indent(body)}")
    paths = ", ".join(
        f"{name!r}: ({top!r}, {name}_base, {name}_more)"
        for name, (top, _b, _m) in PACKAGES.items()
    )
    parts.append(f"\nPATHS = {{{paths}}}\n")
    parts.append(ONLY)
    parts.append("if STAGED:" + indent(STAGED_RUN) + "else:" + indent(PLAIN_RUN))
    parts.append(TAIL)
    return "".join(parts)


class Tier:
    """The session's setting: a program, an environment, where results go."""

    def __init__(self, base):
        self.base = base
        self.app = base / "app"
        self.app.mkdir()
        self.script = self.app / "packages_app.py"
        self.script.write_text(program())
        self.env = clean_environ()
        self.env.update(
            MPLCONFIGDIR=str(base / "mpl"),
            MPISTAGE_STAGE_DIR=str(base / "stage"),
            MPISTAGE_STAGE_FALLBACK="no",
            MPISTAGE_EMULATE_NODES=str(NODES),
            OMP_NUM_THREADS="1",
            OPENBLAS_NUM_THREADS="1",
        )
        (base / "stage").mkdir()
        self.jobs = {}

    def out(self, name):
        """A fresh directory for one job's results."""
        folder = self.base / "out" / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        return folder

    def results(self, folder):
        """Return each rank's facts, checking that every rank wrote them."""
        found = sorted(p.name for p in folder.glob("[0-9]*.json"))
        assert found == [f"{r}.json" for r in range(RANKS)], found
        return [json.loads((folder / f"{r}.json").read_text()) for r in range(RANKS)]

    def pack(self, name, *args):
        """Pack the six names (and *args*) once per session."""
        path = self.base / f"{name}.mpistage"
        if not path.exists():
            result = mpistage(
                ["pack", "-o", path, *PACK_NAMES, *args],
                self.env,
                cwd=self.app,
                timeout=TIMEOUT,
            )
            assert result.returncode == 0, result
        return path


@pytest.fixture(scope="session")
def tier(tmp_path_factory):
    for name in ("scipy", "pandas", "matplotlib", "sklearn", "h5py"):
        pytest.importorskip(name)
    if MPIEXEC is None:
        pytest.skip("no mpiexec next to this Python nor on PATH")
    before = set(Path("/dev/shm").glob("mpich_shm_*"))
    tier = Tier(tmp_path_factory.mktemp("packages"))
    yield tier
    reap_shm(before)


def job(tier, mode, make):
    """Run the job of *mode* once (``make(out)`` returns its result)."""
    if mode not in tier.jobs:
        out = tier.out(mode)
        result, report = make(out)
        tier.jobs[mode] = (result, report, out)
    result, report, out = tier.jobs[mode]
    assert result.returncode == 0, result
    return tier.results(out), report


def runner(tier, out, options, *args):
    """``mpiexec -n 4 python -m mpistage OPTIONS app.py ARGS``, with a JSON report."""
    env = dict(tier.env, MPISTAGE_TEST_OUT=str(out))
    result, report = replay(
        RANKS,
        options,
        tier.script,
        env,
        out / "report.json",
        nodes=NODES,
        cwd=tier.app,
        args=args,
    )
    return result, report


def check(ranks, name, path, root):
    """Every rank got the expected result from the package's copy below *root*."""
    expected = EXPECTED[name][path == "more"]
    for rank, facts in enumerate(ranks):
        got = facts[name]
        assert "error" not in got, f"rank {rank}:\n{got.get('error')}"
        assert got["result"] == expected, (rank, got)
        assert got["file"].startswith(str(root) + "/"), (rank, got["file"])


def served(report):
    """The report says the bundle served the modules and nothing was missed."""
    assert report is not None
    assert report["modules"]["served"] > 100, report["modules"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("stdlib", [False, True], ids=["pack", "pack-stdlib"])
def test_pack_by_name(tier, name, stdlib):
    mode = "pack-stdlib" if stdlib else "pack"
    bundle = tier.pack(mode, *(["--stdlib"] if stdlib else []))
    ranks, report = job(
        tier, mode, lambda out: runner(tier, out, ["--bundle", bundle], "more")
    )
    check(ranks, name, "more", tier.base / "stage")
    served(report)


@pytest.mark.parametrize("name", LIGHT)
def test_record_then_another_path(tier, name):
    def make(out):
        bundle = tier.base / "recorded.mpistage"
        env = dict(tier.env, MPISTAGE_TEST_OUT=str(tier.out("record-learn")))
        done = record(bundle, [PYTHON, tier.script], env, cwd=tier.app, timeout=TIMEOUT)
        assert done.returncode == 0, done
        return runner(tier, out, ["--bundle", bundle], "more")

    ranks, report = job(tier, "record", make)
    check(ranks, name, "more", tier.base / "stage")
    served(report)


@pytest.mark.parametrize("name", LIGHT)
def test_auto_twice_on_two_paths(tier, name):
    options = ["--auto", "--cache-dir", tier.base / "cache"]

    def make(out):
        first, report = runner(tier, tier.out("auto-learn"), options)
        assert first.returncode == 0, first
        assert report["auto"].startswith("recorded"), report
        return runner(tier, out, options, "more")

    ranks, report = job(tier, "auto", make)
    assert report["auto"] == "replayed", report
    check(ranks, name, "more", tier.base / "stage")
    served(report)


@pytest.mark.parametrize("name", NAMES)
def test_live_without_a_bundle(tier, name):
    """No bundle: each node's copy is filled as the ranks import (live imports)."""
    ranks, report = job(tier, "live", lambda out: runner(tier, out, [], "more"))
    assert report["live"]["mode"] == "live", report["live"]
    assert report["live"]["read_files"] > 100, report["live"]
    check(ranks, name, "more", tier.base / "stage")


# matplotlib keeps its data path, found inside the block, for good (its
# fonts, its styles): it needs the copy kept (docs/api.md).
KEEP = ("matplotlib",)


@pytest.mark.parametrize("name", LIGHT)
def test_staged_then_imports_after_the_block(tier, name):
    bundle = tier.pack("pack")
    keep = name in KEEP
    only = KEEP if keep else [n for n in NAMES if n not in KEEP]

    def make(out):
        env = dict(tier.env, MPISTAGE_TEST_OUT=str(out), PACKAGES_BUNDLE=str(bundle))
        env["PACKAGES_ONLY"] = ",".join(only)
        args = [tier.script, "staged", *(["keep"] if keep else [])]
        result = mpirun(RANKS, args, env, cwd=tier.app, timeout=TIMEOUT)
        return result, None

    ranks, _ = job(tier, "staged-keep" if keep else "staged", make)
    site = Path(sys.modules["numpy"].__file__).parents[1]
    for rank, facts in enumerate(ranks):
        got = facts[name]
        inside = got["base"]
        assert "error" not in inside, f"rank {rank}:\n{inside.get('error')}"
        assert inside["result"] == EXPECTED[name][0], (rank, inside)
        assert inside["file"].startswith(got["copy"] + "/"), (rank, inside)
        assert os.path.exists(got["copy"]) == keep, got  # removed at the end
    check(ranks, name, "more", site)  # after the block: from the originals
    if keep:
        for facts in ranks:
            shutil.rmtree(facts[name]["copy"], ignore_errors=True)


@pytest.fixture(scope="session")
def env_bundle(tier, tmp_path_factory):
    """A venv with the five packages and what they need, packed once."""
    from envtools import package_venv

    venv = package_venv(tmp_path_factory, DISTRIBUTIONS)
    path = tier.base / "env.mpistage"
    result = mpistage(
        ["pack", "--env", venv.prefix, "-o", path], clean_environ(), timeout=TIMEOUT
    )
    assert result.returncode == 0, result
    yield path
    path.unlink(missing_ok=True)


@pytest.mark.parametrize("name", LIGHT)
def test_env_bundle_with_mpistage_run(tier, env_bundle, name):
    folder = tier.base / "run" / "n{node}"

    def make(out):
        env = dict(tier.env, MPISTAGE_TEST_OUT=str(out))
        command = [MPIEXEC, "-n", RANKS, PYTHON, tier.script]
        args = ["run", "--env", env_bundle, "--to", folder, "--", *command]
        return mpistage(args, env, cwd=tier.app, timeout=TIMEOUT), None

    ranks, _ = job(tier, "env", make)
    for rank in range(RANKS):
        node = tier.base / "run" / f"n{rank * NODES // RANKS}"
        got = ranks[rank][name]
        assert "error" not in got, got.get("error")
        assert got["result"] == EXPECTED[name][0], (rank, got)
        assert got["file"].startswith(str(node) + "/"), (rank, got["file"])
    assert not (tier.base / "run").exists()  # cleaned on every node
