"""The modes ``mpistage bench run`` compares, behind one small interface.

A mode says how to launch the ranks of one cell (:meth:`Mode.launch`), what
to prepare once, untimed (:meth:`Mode.prepare`), and what to clean after a
cell. The layout (:mod:`mpistage.bench.layout`) says where the interpreter
and the workload are. Add a mode by writing a class and listing it in
:data:`MODES`.

- ``floor``: ``from mpi4py import MPI`` alone: what any MPI program pays;
- ``plain``: the workload imported as usual;
- ``mpistage``, ``mpistage-trust``: the runner (the ``mpistage`` command)
  with a bundle on the shared FS (``pack NAMES --stdlib``), with and
  without the staleness check;
- ``mpistage-m``: the same started as ``python -m mpistage``;
- ``auto``: the runner's ``--auto``, second run (packages layout);
- ``live``: the runner with no bundle: imports served live (rank 0 reads,
  each node keeps a copy);
- ``auto-first``: the first run of ``--auto`` (live, and the bundle saved),
  with an empty cache in every cell;
- ``staged-env``: ``mpistage stage`` of the whole environment (one rank per
  node), then the run from node-local storage; both steps timed and counted;
- ``env-launch``: ``mpistage-env`` in the one launch: per node, one rank
  unpacks the bundle with the node's own Python, the others wait, then
  every rank execs the staged ``python``;
- ``env-launch-sh``: the same, each rank starting the node's ``/bin/sh``
  with the script (``sh VENV/bin/mpistage-env ...``);
- ``local``: everything node-local, the no-cost limit;
- ``plain-env``: a relocated environment run from the shared FS (packages
  layout, for comparison with its ``staged-env``).
"""

import os as _os
import shutil as _shutil
import subprocess as _subprocess
import sys as _sys
import time as _time

LAUNCH_TIMEOUT = 1800  # seconds: a launch that takes longer is stuck
STDERR_TAIL = 4000  # characters of a failed launch's stderr to show


class Mode:
    """A way to start the workload; subclasses override what differs."""

    name = "?"
    summary = ""  # what it is, in a few words: the plot's legend
    layouts = ("realistic", "packages")
    empty = False  # run no workload code: the floor

    def prepare(self, testbed):
        """Do the untimed setup once, before any cell runs."""

    def python(self, testbed):
        """The interpreter every rank starts."""
        return testbed.layout.python

    def runner(self, testbed):
        """Return the arguments between ``python`` and ``-c CODE``."""
        return []

    def command(self, testbed, ranks, code):
        """Return the launch command for *ranks* ranks running *code*."""
        args = [self.python(testbed), *self.runner(testbed), "-c", code]
        return [testbed.mpiexec, "-n", str(ranks), *args]

    def env(self, testbed, nodes):
        """Return the environment of a run."""
        env = clean_environ(testbed.layout.environ())
        env["MPISTAGE_EMULATE_NODES"] = str(nodes)
        env.update(testbed.extra_env)
        return env

    def driver_site(self, testbed):
        """The root the driver puts on ``sys.path`` itself, if any."""
        return testbed.layout.driver_site()

    def launch(self, testbed, ranks, nodes, code):
        """Run one cell; return (start time, shared-FS stats, extra figures)."""
        testbed.fs.reset()
        start = _time.time()
        run(
            self.command(testbed, ranks, code),
            self.env(testbed, nodes),
            self.name,
            ranks,
            cwd=testbed.job_dir,
        )
        extra = {"stage_s": self.stage_seconds(testbed), "ended": _time.time()}
        return start, testbed.fs.stats(), extra

    def stage_seconds(self, testbed):
        """Return the seconds this mode spent staging in the last cell."""
        return 0.0

    def after(self, testbed):
        """Clean up after one cell (untimed)."""


def clean_environ(extra):
    """Return this environment without Python or mpistage settings, plus *extra*."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
    env = {k: v for k, v in _os.environ.items() if k not in drop}
    env = {k: v for k, v in env.items() if not k.startswith("MPISTAGE_")}
    env.update(extra)
    return env


def run(command, env, name, ranks, cwd=None):
    """Run one launch (in *cwd*); raise with its stderr if it fails."""
    done = _subprocess.run(
        command,
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )
    if done.returncode:
        tail = done.stderr[-STDERR_TAIL:]
        raise RuntimeError(f"{name} at {ranks} ranks failed:\n{tail}")
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
    summary = "only `from mpi4py import MPI`, what any MPI program pays"
    empty = True


class Plain(Mode):
    """Everything imported as usual, from the shared file system."""

    name = "plain"
    summary = "every rank reads the shared FS"


class RunnerMode(Mode):
    """A run through the ``mpistage`` command, which writes a JSON report."""

    def env(self, testbed, nodes):
        """Also ask the runner for its JSON report."""
        return dict(super().env(testbed, nodes), MPISTAGE_REPORT=testbed.report_path)


class Bundled(RunnerMode):
    """The mpistage runner, with a bundle that lives on the shared FS."""

    name = "mpistage"
    summary = "bundle read once, one copy per node"

    def prepare(self, testbed):
        """Pack the workload (and the stdlib), found through the mount."""
        target = _os.path.join(testbed.source, "bundles", "workload.mpistage")
        self.bundle = testbed.layout.mounted(target)
        if _os.path.exists(target):
            return
        _os.makedirs(_os.path.dirname(target), exist_ok=True)
        stdlib = ["--stdlib"] if testbed.layout.name == "realistic" else []
        args = ["pack", "-o", target, *testbed.workload.packages, *stdlib]
        env = self.env(testbed, 1)
        if testbed.layout.name == "packages" and testbed.layout.via == "site":
            env["PYTHONPATH"] = testbed.shared_site
        run([self.python(testbed), "-m", "mpistage", *args], env, "pack", 1)

    def runner(self, testbed):
        """Run the target through ``mpistage --bundle`` (python runs the command)."""
        return [testbed.layout.command, "--bundle", self.bundle]

    def stage_seconds(self, testbed):
        """The runner's staging seconds, from its report."""
        return report_seconds(testbed.report_path)


class BundledTrust(Bundled):
    """The runner with ``--trust``: no staleness check by rank 0."""

    name = "mpistage-trust"
    summary = "the same, no staleness check"

    def runner(self, testbed):
        """Run the target through ``mpistage --bundle --trust``."""
        return super().runner(testbed) + ["--trust"]


class BundledModule(Bundled):
    """The runner started as ``python -m mpistage``: ``runpy`` imports first."""

    name = "mpistage-m"
    summary = "the same, started as python -m mpistage"
    layouts = ("realistic",)

    def runner(self, testbed):
        """Run the target through ``python -m mpistage --bundle``."""
        return ["-m", "mpistage", "--bundle", self.bundle]


class Auto(Bundled):
    """``--auto``, second run: the cache was filled by an untimed first run."""

    name = "auto"
    summary = "--auto, replaying its learned bundle"
    layouts = ("packages",)

    def prepare(self, testbed):
        """Learn the bundle in one untimed run, then serve it from the shared FS."""
        import glob

        self.cache = _os.path.join(testbed.work, "learn-cache")
        testbed.run_cell(self, 1, 1)
        shared = _os.path.join(testbed.source, "cache")
        _os.makedirs(shared, exist_ok=True)
        for path in glob.glob(_os.path.join(self.cache, "*.mpistage")):
            _shutil.copy2(path, shared)
        self.cache = _os.path.join(testbed.mount, "cache")

    def runner(self, testbed):
        """Run the target through ``mpistage --auto``."""
        return [testbed.layout.command, "--auto", "--cache-dir", self.cache]


class Live(RunnerMode):
    """The runner with no bundle: imports served live."""

    name = "live"
    summary = "no bundle: rank 0 reads, imports served live"

    def runner(self, testbed):
        """Run the target through the ``mpistage`` command, no bundle."""
        return [testbed.layout.command]


class AutoFirst(Live):
    """``--auto`` with an empty cache: live imports, then the bundle is saved."""

    name = "auto-first"
    summary = "--auto's first run: live, and the bundle saved"

    def prepare(self, testbed):
        """A cache directory of its own, emptied after every cell."""
        self.cache = _os.path.join(testbed.work, "auto-first-cache")

    def runner(self, testbed):
        """Run the target through ``mpistage --auto``."""
        return [testbed.layout.command, "--auto", "--cache-dir", self.cache]

    def launch(self, testbed, ranks, nodes, code):
        """Run the cell; report the saved bundle's size and the time saving took.

        ``stage_s`` is the job's end after every rank imported: the reduction
        of what was used and the bundle written (``total_s`` excludes it).
        """
        import json

        start, stats, extra = super().launch(testbed, ranks, nodes, code)
        ended = _time.time()
        with open(testbed.result_path) as f:
            extra["stage_s"] = ended - json.load(f)["t_all"]
        saved = [_os.path.join(self.cache, n) for n in _os.listdir(self.cache)]
        extra["bundle_bytes"] = sum(_os.path.getsize(p) for p in saved)
        return start, stats, extra

    def after(self, testbed):
        """Empty the cache, so that the next cell is a first run again."""
        _shutil.rmtree(self.cache, ignore_errors=True)


class StagedEnv(Mode):
    """``mpistage stage`` (one rank per node), then the run from node-local copies."""

    name = "staged-env"
    summary = "whole environment staged per node, then run"

    def prepare(self, testbed):
        """Pack the whole environment onto the shared FS (untimed)."""
        from mpistage.bench.envs import env_bundle

        self.bundle = env_bundle(testbed)
        self.local = _os.path.join(testbed.local_dir, self.name)

    def stage_command(self, testbed, nodes):
        """``mpiexec -n NODES python mpistage stage BUNDLE --to LOCAL/n{node}``."""
        to = _os.path.join(self.local, "n{node}")
        args = ["stage", self.bundle, "--to", to, "--print-env"]
        return [testbed.mpiexec, "-n", str(nodes), *self.stager(testbed), *args]

    def stager(self, testbed):
        """What the stage step starts: the shared environment's mpistage command."""
        return [testbed.layout.python, testbed.layout.command]

    def command(self, testbed, ranks, code):
        """Each rank execs its node's staged ``bin/python``."""
        nodes = testbed.nodes
        python = f'"{self.local}/n$((PMI_RANK * {nodes} / PMI_SIZE))/bin/python"'
        shell = f'exec {python} -c "$0"'
        return [testbed.mpiexec, "-n", str(ranks), "sh", "-c", shell, code]

    def env(self, testbed, nodes):
        """The lines ``mpistage stage`` prints; no PYTHONPATH."""
        env = super().env(testbed, nodes)
        env.pop("PYTHONPATH", None)
        env["LD_LIBRARY_PATH"] = _os.path.join(self.local, "n0", "lib")
        return env

    def driver_site(self, testbed):
        """Nothing to add: each node's python has its own site-packages."""
        return None

    def launch(self, testbed, ranks, nodes, code):
        """Stage (counted and timed apart), then run; return both."""
        testbed.nodes = nodes
        testbed.fs.reset()
        start = _time.time()
        run(
            self.stage_command(testbed, nodes), self.env(testbed, nodes), "stage", nodes
        )
        staged = _time.time()
        stage_stats = testbed.fs.stats()
        _, stats, _ = Mode.launch(self, testbed, ranks, nodes, code)
        stats["stage"] = stage_stats
        size = _os.path.getsize(
            _os.path.join(testbed.source, "bundles", "env.mpistage")
        )
        return start, stats, {"stage_s": staged - start, "bundle_bytes": size}

    def after(self, testbed):
        """Remove the node-local copies, so the next cell stages afresh."""
        _shutil.rmtree(self.local, ignore_errors=True)


class EnvLaunch(StagedEnv):
    """``mpiexec -n R mpistage-env BUNDLE -- python -c CODE``: one launch."""

    name = "env-launch"
    summary = "mpistage-env: one process per node unpacks, in the launch"

    def prepare(self, testbed):
        """Pack the environment; put ``mpistage-env`` beside ``mpistage`` (untimed)."""
        super().prepare(testbed)
        layout = testbed.layout
        source = _os.path.join(_os.path.dirname(installed_script()), "mpistage-env")
        target = _os.path.join(layout.venv, "bin", "mpistage-env")
        if not _os.path.exists(target):
            _shutil.copy(source, target)
        self.script = layout.mounted(target)

    def command(self, testbed, ranks, code):
        """Every rank starts the shared ``mpistage-env``, a ``sh`` script."""
        script = [self.script, self.bundle, "--", "python", "-c", code]
        return [testbed.mpiexec, "-n", str(ranks), *script]

    def env(self, testbed, nodes):
        """The node places go to node-local storage; no ``PYTHONPATH``."""
        env = Mode.env(self, testbed, nodes)
        env.pop("PYTHONPATH", None)
        env["MPISTAGE_STAGE_DIR"] = self.local
        _os.makedirs(self.local, mode=0o700, exist_ok=True)
        return env

    def launch(self, testbed, ranks, nodes, code):
        """One launch, counted and timed whole; a node's share of the rest."""
        start, stats, extra = Mode.launch(self, testbed, ranks, nodes, code)
        size = _os.path.getsize(
            _os.path.join(testbed.source, "bundles", "env.mpistage")
        )
        node = -(-outside_ranks(testbed, stats) // nodes)
        return (
            start,
            stats,
            {**extra, "stage_s": 0.0, "bundle_bytes": size, "ops_node": node},
        )

    def after(self, testbed):
        """Wait for the watchdogs, then remove what is left (nothing, normally)."""
        for _ in range(50):
            if not _os.path.isdir(self.local) or not _os.listdir(self.local):
                break
            _time.sleep(0.1)
        _shutil.rmtree(self.local, ignore_errors=True)


class EnvLaunchSh(EnvLaunch):
    """``mpiexec -n R /bin/sh MOUNT/.../mpistage-env ...``: the node's ``sh``
    reads the script, and nothing execs it from the shared FS."""

    name = "env-launch-sh"

    def command(self, testbed, ranks, code):
        """Every rank starts the node's ``/bin/sh`` with the shared script."""
        launch = super().command(testbed, ranks, code)
        return [*launch[:3], "/bin/sh", *launch[3:]]


def outside_ranks(testbed, stats):
    """Return the metadata ops of the processes that are no rank (``mpistage-env``'s
    extraction on each node: its claim and its read of the bundle)."""
    import json

    from mpistage.bench.simfs import meta_ops

    with open(testbed.result_path) as f:
        ranks = {str(pid) for _, pid, _, _ in json.load(f)["ranks"]}
    per_pid = stats.get("per_pid", {})
    return sum(meta_ops(v) for pid, v in per_pid.items() if pid not in ranks)


def installed_script():
    """The ``mpistage`` command of this environment (``mpistage-env`` is beside it)."""
    from mpistage.bench.layout import installed_command

    return installed_command()


class Local(StagedEnv):
    """Everything node-local (the environment staged untimed): the no-cost limit."""

    name = "local"
    summary = "everything node-local (the limit)"

    def launch(self, testbed, ranks, nodes, code):
        """Stage untimed, then run and measure the run alone."""
        testbed.nodes = nodes
        run(
            self.stage_command(testbed, nodes), self.env(testbed, nodes), "stage", nodes
        )
        return Mode.launch(self, testbed, ranks, nodes, code)

    def after(self, testbed):
        """Keep nothing between cells."""
        _shutil.rmtree(self.local, ignore_errors=True)


class LocalPackages(Mode):
    """The workload copied to node-local RAM disk (packages layout)."""

    name = "local"
    summary = "everything node-local (the limit)"
    layouts = ("packages",)

    def prepare(self, testbed):
        """Copy the workload's root to node-local storage (untimed)."""
        from mpistage.bench.layout import copy

        self.copy = _os.path.join(testbed.local_dir, "site")
        if not _os.path.exists(self.copy):
            copy(testbed.layout.workload_dir(), self.copy)

    def driver_site(self, testbed):
        """Import from the node-local copy."""
        return self.copy

    def env(self, testbed, nodes):
        """No shared PYTHONPATH."""
        env = super().env(testbed, nodes)
        env.pop("PYTHONPATH", None)
        return env


class PlainEnv(Mode):
    """A relocated environment run from the shared FS (packages layout)."""

    name = "plain-env"
    summary = "a relocated environment on the shared FS"
    layouts = ("packages",)
    workloads = ("numpy",)  # what the small environment holds

    def prepare(self, testbed):
        """Put a relocated copy of a small environment on the shared FS."""
        from mpistage.bench.envs import shared_env

        self.prefix = shared_env(testbed)

    def python(self, testbed):
        """The shared environment's python."""
        return _os.path.join(self.prefix, "bin", "python")

    def driver_site(self, testbed):
        """The environment's own site-packages."""
        from mpistage.bench.layout import site_packages

        return site_packages(self.prefix)

    def env(self, testbed, nodes):
        """The lines ``mpistage stage`` prints, for the shared copy."""
        env = super().env(testbed, nodes)
        env.pop("PYTHONPATH", None)
        env["LD_LIBRARY_PATH"] = _os.path.join(self.prefix, "lib")
        return env


class StagedSmallEnv(StagedEnv):
    """``staged-env`` of the small environment (packages layout)."""

    layouts = ("packages",)
    workloads = ("numpy",)  # what the small environment holds

    def stager(self, testbed):
        """The packages layout stages with the local interpreter."""
        return [_sys.executable, testbed.layout.command]


MODES = {
    "realistic": {
        m.name: m
        for m in (
            Floor,
            Plain,
            Bundled,
            BundledTrust,
            BundledModule,
            Live,
            AutoFirst,
            StagedEnv,
            EnvLaunch,
            EnvLaunchSh,
            Local,
        )
    },
    "packages": {
        m.name: m
        for m in (
            Plain,
            Bundled,
            BundledTrust,
            Auto,
            Live,
            AutoFirst,
            LocalPackages,
            PlainEnv,
            StagedSmallEnv,
        )
    },
}
