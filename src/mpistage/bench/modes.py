"""The modes ``mpistage bench run`` compares, behind one small interface.

A mode says how to launch the ranks of one cell (:meth:`Mode.launch`), what
to prepare once, untimed (:meth:`Mode.prepare`), and what to clean after a
cell. The layout (:mod:`mpistage.bench.layout`) says where the interpreter
and the workload are. Add a mode by writing a class and listing it in
:data:`MODES`.

- ``floor``: ``from mpi4py import MPI`` alone: what any MPI program pays;
- ``plain``: the workload imported as usual;
- ``mpistage``, ``mpistage-trust``: the runner with a bundle on the shared FS
  (``pack NAMES --stdlib``), with and without the staleness check;
- ``auto``: the runner's ``--auto``, second run (packages layout);
- ``live``: the runner with no bundle: imports served live (rank 0 reads,
  each node keeps a copy);
- ``auto-first``: the first run of ``--auto`` (live, and the bundle saved),
  with an empty cache in every cell;
- ``staged-env``: ``mpistage stage`` of the whole environment (one rank per
  node), then the run from node-local storage; both steps timed and counted;
- ``local``: everything node-local, the no-cost limit;
- ``plain-env``: a relocated environment run from the shared FS (packages
  layout, for comparison with its ``staged-env``).
"""

import os as _os
import shutil as _shutil
import subprocess as _subprocess
import sys as _sys
import time as _time


class Mode:
    """A way to start the workload; subclasses override what differs."""

    name = "?"
    layouts = ("realistic", "packages")
    empty = False  # run no workload code: the floor

    def prepare(self, bench):
        """Do the untimed setup once, before any cell runs."""

    def python(self, bench):
        """The interpreter every rank starts."""
        return bench.layout.python

    def runner(self, bench):
        """Return the arguments between ``python`` and ``-c CODE``."""
        return []

    def command(self, bench, ranks, code):
        """Return the launch command for *ranks* ranks running *code*."""
        args = [self.python(bench), *self.runner(bench), "-c", code]
        return [bench.mpiexec, "-n", str(ranks), *args]

    def env(self, bench, nodes):
        """Return the environment of a run."""
        env = clean_environ(bench.layout.environ())
        env["MPISTAGE_EMULATE_NODES"] = str(nodes)
        env["MPISTAGE_BENCH_RESULT"] = bench.result_path
        env.update(bench.extra_env)
        return env

    def driver_site(self, bench):
        """The root the driver puts on ``sys.path`` itself, if any."""
        return bench.layout.driver_site()

    def launch(self, bench, ranks, nodes, code):
        """Run one cell; return (start time, shared-FS stats, extra figures)."""
        bench.fs.reset()
        start = _time.time()
        run(self.command(bench, ranks, code), self.env(bench, nodes), self.name, ranks)
        return start, bench.fs.stats(), {"stage_s": self.stage_seconds(bench)}

    def stage_seconds(self, bench):
        """Return the seconds this mode spent staging in the last cell."""
        return 0.0

    def after(self, bench):
        """Clean up after one cell (untimed)."""


def clean_environ(extra):
    """Return this environment without Python or mpistage settings, plus *extra*."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
    env = {k: v for k, v in _os.environ.items() if k not in drop}
    env = {k: v for k, v in env.items() if not k.startswith("MPISTAGE_")}
    env.update(extra)
    return env


def run(command, env, name, ranks):
    """Run one launch; raise with its stderr if it fails."""
    done = _subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=1800
    )
    if done.returncode:
        raise RuntimeError(f"{name} at {ranks} ranks failed:\n{done.stderr[-4000:]}")
    return done


def report_seconds(path):
    """Return the runner's staging seconds from its report, if it wrote one."""
    import json

    if not _os.path.exists(path):
        return 0.0
    with open(path) as f:
        seconds = json.load(f)["seconds"]
    steps = ("read", "validate", "broadcast", "stage", "activate")
    return sum(seconds.get(s, 0.0) for s in steps)


class Floor(Mode):
    """``from mpi4py import MPI`` and nothing else: F."""

    name = "floor"
    empty = True


class Plain(Mode):
    """Everything imported as usual, from the shared file system."""

    name = "plain"


class Staged(Mode):
    """The mpistage runner, with a bundle that lives on the shared FS."""

    name = "mpistage"

    def prepare(self, bench):
        """Pack the workload (and the stdlib), found through the mount."""
        target = _os.path.join(bench.source, "bundles", "workload.mpistage")
        self.bundle = bench.layout.mounted(target)
        if _os.path.exists(target):
            return
        _os.makedirs(_os.path.dirname(target), exist_ok=True)
        stdlib = ["--stdlib"] if bench.layout.name == "realistic" else []
        args = ["pack", "-o", target, *bench.workload.packages, *stdlib]
        env = self.env(bench, 1)
        if bench.layout.name == "packages" and bench.layout.via == "site":
            env["PYTHONPATH"] = bench.shared_site
        run([self.python(bench), "-m", "mpistage", *args], env, "pack", 1)

    def runner(self, bench):
        """Run the target through ``python -m mpistage --bundle``."""
        return ["-m", "mpistage", "--bundle", self.bundle]

    def env(self, bench, nodes):
        """Also ask the runner for its JSON report."""
        return dict(super().env(bench, nodes), MPISTAGE_REPORT=bench.report_path)

    def stage_seconds(self, bench):
        """The runner's staging seconds, from its report."""
        return report_seconds(bench.report_path)


class StagedTrust(Staged):
    """The runner with ``--trust``: no staleness check by rank 0."""

    name = "mpistage-trust"

    def runner(self, bench):
        """Run the target through ``python -m mpistage --bundle --trust``."""
        return super().runner(bench) + ["--trust"]


class Auto(Staged):
    """``--auto``, second run: the cache was filled by an untimed first run."""

    name = "auto"
    layouts = ("packages",)

    def prepare(self, bench):
        """Learn the bundle in one untimed run, then serve it from the shared FS."""
        import glob

        self.cache = _os.path.join(bench.work, "learn-cache")
        bench.run_cell(self, 1, 1)
        shared = _os.path.join(bench.source, "cache")
        _os.makedirs(shared, exist_ok=True)
        for path in glob.glob(_os.path.join(self.cache, "*.mpistage")):
            _shutil.copy2(path, shared)
        self.cache = _os.path.join(bench.mount, "cache")

    def runner(self, bench):
        """Run the target through ``python -m mpistage --auto``."""
        return ["-m", "mpistage", "--auto", "--cache-dir", self.cache]


class Live(Mode):
    """The runner with no bundle: imports served live."""

    name = "live"

    def runner(self, bench):
        """Run the target through ``python -m mpistage``, no bundle."""
        return ["-m", "mpistage"]

    def env(self, bench, nodes):
        """Also ask the runner for its JSON report."""
        return dict(super().env(bench, nodes), MPISTAGE_REPORT=bench.report_path)


class AutoFirst(Live):
    """``--auto`` with an empty cache: live imports, then the bundle is saved."""

    name = "auto-first"

    def prepare(self, bench):
        """A cache directory of its own, emptied after every cell."""
        self.cache = _os.path.join(bench.work, "auto-first-cache")

    def runner(self, bench):
        """Run the target through ``python -m mpistage --auto``."""
        return ["-m", "mpistage", "--auto", "--cache-dir", self.cache]

    def launch(self, bench, ranks, nodes, code):
        """Run the cell; report the saved bundle's size."""
        start, stats, extra = super().launch(bench, ranks, nodes, code)
        saved = [_os.path.join(self.cache, n) for n in _os.listdir(self.cache)]
        extra["bundle_bytes"] = sum(_os.path.getsize(p) for p in saved)
        return start, stats, extra

    def after(self, bench):
        """Empty the cache, so that the next cell is a first run again."""
        _shutil.rmtree(self.cache, ignore_errors=True)


class StagedEnv(Mode):
    """``mpistage stage`` (one rank per node), then the run from node-local copies."""

    name = "staged-env"

    def prepare(self, bench):
        """Pack the whole environment onto the shared FS (untimed)."""
        from mpistage.bench.envs import env_bundle

        self.bundle = env_bundle(bench)
        self.local = _os.path.join(bench.local_dir, self.name)

    def stage_command(self, bench, nodes):
        """``mpiexec -n NODES python -m mpistage stage BUNDLE --to LOCAL/n{node}``."""
        python = self.stager(bench)
        to = _os.path.join(self.local, "n{node}")
        args = [
            python,
            "-m",
            "mpistage",
            "stage",
            self.bundle,
            "--to",
            to,
            "--print-env",
        ]
        return [bench.mpiexec, "-n", str(nodes), *args]

    def stager(self, bench):
        """The interpreter the stage step starts: the shared environment's."""
        return bench.layout.python

    def command(self, bench, ranks, code):
        """Each rank execs its node's staged ``bin/python``."""
        nodes = bench.nodes
        python = f'"{self.local}/n$((PMI_RANK * {nodes} / PMI_SIZE))/bin/python"'
        shell = f'exec {python} -c "$0"'
        return [bench.mpiexec, "-n", str(ranks), "sh", "-c", shell, code]

    def env(self, bench, nodes):
        """The lines ``mpistage stage`` prints; no PYTHONPATH."""
        env = super().env(bench, nodes)
        env.pop("PYTHONPATH", None)
        env["LD_LIBRARY_PATH"] = _os.path.join(self.local, "n0", "lib")
        return env

    def driver_site(self, bench):
        """Nothing to add: each node's python has its own site-packages."""
        return None

    def launch(self, bench, ranks, nodes, code):
        """Stage (counted and timed apart), then run; return both."""
        bench.nodes = nodes
        bench.fs.reset()
        start = _time.time()
        run(self.stage_command(bench, nodes), self.env(bench, nodes), "stage", nodes)
        staged = _time.time()
        stage_stats = bench.fs.stats()
        _, stats, _ = Mode.launch(self, bench, ranks, nodes, code)
        stats["stage"] = stage_stats
        size = _os.path.getsize(_os.path.join(bench.source, "bundles", "env.mpistage"))
        return start, stats, {"stage_s": staged - start, "bundle_bytes": size}

    def after(self, bench):
        """Remove the node-local copies, so the next cell stages afresh."""
        _shutil.rmtree(self.local, ignore_errors=True)


class Local(StagedEnv):
    """Everything node-local (the environment staged untimed): the no-cost limit."""

    name = "local"

    def launch(self, bench, ranks, nodes, code):
        """Stage untimed, then run and measure the run alone."""
        bench.nodes = nodes
        run(self.stage_command(bench, nodes), self.env(bench, nodes), "stage", nodes)
        return Mode.launch(self, bench, ranks, nodes, code)

    def after(self, bench):
        """Keep nothing between cells."""
        _shutil.rmtree(self.local, ignore_errors=True)


class LocalPackages(Mode):
    """The workload copied to node-local RAM disk (packages layout)."""

    name = "local"
    layouts = ("packages",)

    def prepare(self, bench):
        """Copy the workload's root to node-local storage (untimed)."""
        self.copy = _os.path.join(bench.local_dir, "site")
        if not _os.path.exists(self.copy):
            _shutil.copytree(bench.layout.workload_dir(), self.copy, symlinks=True)

    def driver_site(self, bench):
        """Import from the node-local copy."""
        return self.copy

    def env(self, bench, nodes):
        """No shared PYTHONPATH."""
        env = super().env(bench, nodes)
        env.pop("PYTHONPATH", None)
        return env


class PlainEnv(Mode):
    """A relocated environment run from the shared FS (packages layout)."""

    name = "plain-env"
    layouts = ("packages",)

    def prepare(self, bench):
        """Put a relocated copy of a small environment on the shared FS."""
        from mpistage.bench.envs import shared_env

        self.prefix = shared_env(bench)

    def python(self, bench):
        """The shared environment's python."""
        return _os.path.join(self.prefix, "bin", "python")

    def driver_site(self, bench):
        """The environment's own site-packages."""
        from mpistage.bench.envs import site_packages

        return site_packages(self.prefix)

    def env(self, bench, nodes):
        """The lines ``mpistage stage`` prints, for the shared copy."""
        env = super().env(bench, nodes)
        env.pop("PYTHONPATH", None)
        env["LD_LIBRARY_PATH"] = _os.path.join(self.prefix, "lib")
        return env


class StagedSmallEnv(StagedEnv):
    """``staged-env`` of the small environment (packages layout)."""

    layouts = ("packages",)

    def stager(self, bench):
        """The packages layout stages with the local interpreter."""
        return _sys.executable


MODES = {
    "realistic": {
        m.name: m
        for m in (Floor, Plain, Staged, StagedTrust, Live, AutoFirst, StagedEnv, Local)
    },
    "packages": {
        m.name: m
        for m in (
            Plain,
            Staged,
            StagedTrust,
            Auto,
            Live,
            AutoFirst,
            LocalPackages,
            PlainEnv,
            StagedSmallEnv,
        )
    },
}
