"""The modes ``mpistage bench run`` compares, behind one small interface.

A mode says where the workload's sys.path root is and how to launch a rank.
Add a mode by writing a class with ``prepare``, ``command`` and ``env`` and
listing it in :data:`MODES`.
"""

import os as _os
import shutil as _shutil
import subprocess as _subprocess
import sys as _sys


class Mode:
    """A way to start the workload; subclasses override what differs."""

    name = "?"

    def prepare(self, bench):
        """Do the untimed setup once, before any cell runs."""

    def site(self, bench):
        """Return the sys.path root the ranks import the workload from."""
        return bench.shared_site

    def runner(self, bench):
        """Return the arguments between ``python`` and ``-c CODE``."""
        return []

    def command(self, bench, ranks, code):
        """Return the launch command for *ranks* ranks running *code*."""
        return [
            bench.mpiexec,
            "-n",
            str(ranks),
            _sys.executable,
            *self.runner(bench),
            "-c",
            code,
        ]

    def env(self, bench, nodes):
        """Return extra environment variables of a run."""
        return {"MPISTAGE_EMULATE_NODES": str(nodes)}

    def stage_seconds(self, bench):
        """Return the seconds this mode spent staging in the last cell."""
        return report_seconds(bench.report_path)

    def after(self, bench):
        """Clean up after one cell (untimed)."""


def report_seconds(path):
    """Return the runner's staging seconds from its report, if it wrote one."""
    import json

    if not _os.path.exists(path):
        return 0.0
    with open(path) as f:
        seconds = json.load(f)["seconds"]
    steps = ("read", "validate", "broadcast", "stage", "activate")
    return sum(seconds.get(s, 0.0) for s in steps)


class Plain(Mode):
    """Everything on the simulated shared file system."""

    name = "plain"


class Staged(Mode):
    """The mpistage runner, with a bundle that lives on the shared FS."""

    name = "mpistage"

    def prepare(self, bench):
        """Pack the workload, found through the mount, onto the shared FS."""
        target = _os.path.join(bench.source, "bundles", "workload.mpistage")
        _os.makedirs(_os.path.dirname(target), exist_ok=True)
        env = dict(_os.environ, PYTHONPATH=bench.shared_site)
        cmd = [
            _sys.executable,
            "-m",
            "mpistage",
            "pack",
            "-o",
            target,
            *bench.workload.packages,
            *bench.workload.pack_args,
        ]
        _subprocess.run(cmd, env=env, check=True, stdout=_subprocess.DEVNULL)
        self.bundle = _os.path.join(bench.mount, "bundles", "workload.mpistage")

    def runner(self, bench):
        """Run the target through ``python -m mpistage --bundle``."""
        return ["-m", "mpistage", "--bundle", self.bundle]

    def env(self, bench, nodes):
        """Also ask the runner for its JSON report."""
        return dict(super().env(bench, nodes), MPISTAGE_REPORT=bench.report_path)


class StagedTrust(Staged):
    """The runner with ``--trust``: no staleness check by rank 0."""

    name = "mpistage-trust"

    def runner(self, bench):
        """Run the target through ``python -m mpistage --bundle --trust``."""
        return super().runner(bench) + ["--trust"]


class Local(Mode):
    """The workload copied to node-local RAM disk: the no-cost limit."""

    name = "local"

    def prepare(self, bench):
        """Copy the workload's root to node-local storage (untimed)."""
        self.copy = _os.path.join(bench.local_dir, "site")
        _shutil.copytree(bench.source_site, self.copy, symlinks=True)

    def site(self, bench):
        """Import from the node-local copy."""
        return self.copy


class Auto(Staged):
    """``--auto``, second run: the cache was filled by an untimed first run."""

    name = "auto"

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


class PlainEnv(Mode):
    """A whole environment (interpreter, stdlib, mpi4py, numpy) run from the
    shared FS: ``python`` itself starts from the simulated file system."""

    name = "plain-env"

    def prepare(self, bench):
        """Put a relocated copy of a small environment on the shared FS."""
        from mpistage.bench.envs import shared_env

        shared_env(bench)

    def site(self, bench):
        """The environment's own site-packages."""
        from mpistage.bench.envs import site_packages

        return site_packages(_os.path.join(bench.mount, "env"))

    def command(self, bench, ranks, code):
        """Start the shared environment's python."""
        python = _os.path.join(bench.mount, "env", "bin", "python")
        return [bench.mpiexec, "-n", str(ranks), python, "-c", code]

    def env(self, bench, nodes):
        """The lines ``mpistage stage`` prints, for the shared copy."""
        lib = _os.path.join(bench.mount, "env", "lib")
        return dict(
            super().env(bench, nodes), LD_LIBRARY_PATH=lib, PYTHONNOUSERSITE="1"
        )


class StagedEnv(PlainEnv):
    """``mpistage stage`` (one rank per node) then the run, both timed."""

    name = "staged-env"
    SCRIPT = """\
set -e
export CODE="$2"
start=$(date +%s.%N)
"$MPIEXEC" -n "$NODES" "$STAGER" -m mpistage stage "$BUNDLE" --to "$LOCAL/n{node}" \
    --print-env > /dev/null
awk "BEGIN {print $(date +%s.%N) - $start}" > "$STAGE_TIME"
"$MPIEXEC" -n "$1" sh -c \
    'exec "$LOCAL/n$((PMI_RANK * NODES / PMI_SIZE))/bin/python" -c "$CODE"'
"""

    def prepare(self, bench):
        """Share the environment bundle on the shared FS; write the script."""
        super().prepare(bench)
        self.script = _os.path.join(bench.work, "staged-env.sh")
        with open(self.script, "w") as f:
            f.write(self.SCRIPT)
        self.local = _os.path.join(bench.local_dir, "staged-env")
        self.stage_time = _os.path.join(bench.work, "stage-time")

    def site(self, bench):
        """Nothing to add: each node's python has its own site-packages."""
        return None

    def command(self, bench, ranks, code):
        """Run the stage-and-run script."""
        return ["sh", self.script, str(ranks), code]

    def env(self, bench, nodes):
        """Everything the script needs, and the staged lines."""
        lib = _os.path.join(self.local, "n0", "lib")
        return dict(
            Mode.env(self, bench, nodes),
            MPIEXEC=bench.mpiexec,
            NODES=str(nodes),
            STAGER=_sys.executable,
            LOCAL=self.local,
            STAGE_TIME=self.stage_time,
            BUNDLE=_os.path.join(bench.mount, "bundles", "env.mpistage"),
            LD_LIBRARY_PATH=lib,
            PYTHONNOUSERSITE="1",
        )

    def stage_seconds(self, bench):
        """The stage step's wall time, as the script measured it."""
        with open(self.stage_time) as f:
            return float(f.read())

    def after(self, bench):
        """Remove the node-local copies, so the next cell stages afresh."""
        _shutil.rmtree(self.local, ignore_errors=True)


MODES = {
    mode.name: mode
    for mode in (Plain, Staged, StagedTrust, Local, Auto, PlainEnv, StagedEnv)
}
