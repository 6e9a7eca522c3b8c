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

        from mpistage.bench.run import run_cell

        self.cache = _os.path.join(bench.work, "learn-cache")
        run_cell(bench, self, 1, 1)
        shared = _os.path.join(bench.source, "cache")
        _os.makedirs(shared, exist_ok=True)
        for path in glob.glob(_os.path.join(self.cache, "*.mpistage")):
            _shutil.copy2(path, shared)
        self.cache = _os.path.join(bench.mount, "cache")

    def runner(self, bench):
        """Run the target through ``python -m mpistage --auto``."""
        return ["-m", "mpistage", "--auto", "--cache-dir", self.cache]


MODES = {mode.name: mode for mode in (Plain, Staged, Local, Auto)}
