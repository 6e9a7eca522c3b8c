"""The runner: ``python -m mpistage [options] (app.py | -m mod | -c code) [args]``.

It mirrors ``python -m mpi4py``: ``sys.argv``, ``__main__`` and exit codes
behave as with plain python, and an unhandled exception on any rank aborts
the whole job with ``MPI_Abort`` after its traceback is printed. With a
bundle, the steps run first, each in its own module:
topology → read → broadcast → stage → activate → run → report.
Errors in those steps are agreed by all ranks (:func:`mpistage.errors.agree`):
rank 0 prints one line, partial staging roots are removed, and every rank
exits with status 1.
"""

import os as _os
import sys as _sys
import time as _time

from mpistage.collective import attempt, barrier
from mpistage.errors import StageError

USAGE = """\
usage: python -m mpistage [options] <app.py> [arg] ...
   or: python -m mpistage [options] -m <module> [arg] ...
   or: python -m mpistage [options] -c <code> [arg] ...

options:
  --bundle FILE   stage FILE (.mpistage) node-locally and import from it
                  (default: $MPISTAGE_BUNDLE; without a bundle the target
                  simply runs)
  --auto          learn the bundle on the first run (rank 0 records), replay
                  it on later runs, rebuild it when stale
  --cache-dir DIR where --auto keeps bundles (default: $MPISTAGE_CACHE_DIR,
                  else $XDG_CACHE_HOME/mpistage or ~/.cache/mpistage)
  --validate=MODE staleness check by rank 0 before the broadcast: default
                  (directory mtimes, member sizes and mtimes) or strict
                  (also checksums)
  --trust         skip the staleness check
  --keep          keep the staging roots after the job
  --report        print a summary of the job on rank 0 (stderr)
  --version       print the version and exit
  -h, --help      show this help and exit

environment: MPISTAGE_BUNDLE, MPISTAGE_STAGE_DIR, MPISTAGE_STAGE_FALLBACK,
MPISTAGE_EMULATE_NODES, MPISTAGE_REPORT (write the report as JSON),
MPISTAGE_CACHE_DIR.

tools: mpistage {pack,record,inspect,stage,clean,bench} --help"""


class Options:
    """Runner options, from the command line and the environment."""

    bundle = None
    auto = False
    cache_dir = None
    validate = "default"
    keep = False
    report = False


def usage_error(message):
    """Print *message* and the usage once (first rank), exit 1 on all ranks."""
    if launcher_rank() == 0:
        print(f"mpistage: error: {message}\n{USAGE}", file=_sys.stderr)
    _sys.exit(1)


def launcher_rank():
    """Return this process's rank as the launcher told it, before MPI starts."""
    for name in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        if _os.environ.get(name, "").isdigit():
            return int(_os.environ[name])
    return 0


def parse(argv):
    """Split *argv* into runner :class:`Options` and the target's arguments."""
    options, args = Options(), list(argv)
    while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):
        opt, eq, value = args.pop(0).partition("=")
        if opt in ("-h", "--help"):
            print(USAGE)
            _sys.exit(0)
        elif opt == "--version":
            from mpistage import __version__

            print(f"mpistage {__version__}")
            _sys.exit(0)
        elif opt in ("--bundle", "--cache-dir", "--validate"):
            if not eq:
                value = args.pop(0) if args else ""
            if not value:
                usage_error(f"{opt} needs a value")
            setattr(options, opt[2:].replace("-", "_"), value)
        elif opt in ("--keep", "--report", "--auto") and not eq:
            setattr(options, opt[2:], True)
        elif opt == "--trust" and not eq:
            options.validate = "trust"
        else:
            usage_error(f"unknown option {opt!r}")
    if not args:
        usage_error("no target: give app.py, -m module or -c code")
    if args[0] in ("-m", "-c") and len(args) < 2:
        usage_error(f"{args[0]} needs an argument")
    if options.validate not in ("default", "strict", "trust"):
        usage_error(f"--validate={options.validate!r}: use default or strict")
    if options.auto and options.bundle:
        usage_error("--auto and --bundle exclude each other")
    if not options.auto:
        options.bundle = options.bundle or _os.environ.get("MPISTAGE_BUNDLE") or None
    return options, args


class Job:
    """One run of the runner on one rank: the steps and what they produced."""

    def __init__(self, world, options, args):
        self.world, self.options, self.args = world, options, list(args)
        self.seconds, self.root, self.activation = {}, None, None
        self.topology, self.bytes = None, 0
        self.recorder, self.auto, self.validation = None, None, None

    def timed(self, step, func, *args):
        """Run *func* collectively as *step*, recording this rank's seconds."""
        start = _time.perf_counter()
        try:
            return attempt(self.world, func, *args)
        finally:
            self.seconds[step] = _time.perf_counter() - start

    def start(self):
        """Run topology → read → broadcast → stage → activate."""
        from mpistage.topology import discover

        self.topology = self.timed("topology", discover, self.world)
        if self.options.auto and self.world.rank == 0:
            from mpistage.cache import bundle_path

            self.options.bundle = bundle_path(self.args, self.options.cache_dir)
        if not (self.options.bundle or self.options.auto):
            return
        buf = self.timed("read", self.read)
        if not self.world.bcast(buf is not None if self.world.rank == 0 else None):
            return self.start_recording()
        buf = self.timed("broadcast", self.broadcast, buf)
        tag = self.world.bcast(job_tag() if self.world.rank == 0 else None, 0)
        plan = self.timed("stage", self.stage, buf, tag)
        del buf
        stale = self.timed("validate", self.verdict)
        if self.world.bcast(stale if self.world.rank == 0 else None):
            self.discard()
            return self.start_recording()
        self.timed("activate", self.activate, plan)

    def read(self):
        """Rank 0 reads and checks the bundle; the others wait.

        Returns the bundle bytes on rank 0, or ``None`` when ``--auto`` has
        no usable cached bundle and must record one.
        """
        if self.world.rank != 0:
            return None
        if not self.options.auto:
            return self.checked_bundle()
        if not _os.path.exists(self.options.bundle):
            self.auto = "recorded (no cached bundle)"
            return None
        try:
            buf = self.checked_bundle()
        except StageError as exc:
            self.auto = f"recorded ({exc})"
            return None
        self.auto = "replayed"
        return buf

    def checked_bundle(self):
        """Read the bundle, refuse another Python's, start the staleness check."""
        from mpistage.bundle import manifest_of, python_mismatch
        from mpistage.read import read_bundle
        from mpistage.validate import Background

        path = self.options.bundle
        buf = read_bundle(path)
        manifest = manifest_of(buf, path)
        if manifest.get("kind") == "env":
            raise StageError(
                f"{path!r} is an environment bundle: stage it with "
                "`mpistage stage` and run DIR/bin/python"
            )
        mismatch = python_mismatch(manifest)
        if mismatch:
            raise StageError(f"bundle {path!r} is {mismatch}")
        if self.options.validate != "trust":
            self.validation = Background(manifest, self.options.validate)
        return buf

    def verdict(self):
        """Rank 0 waits for the staleness check (it ran during the broadcast).

        A stale bundle is an error with ``--bundle``; with ``--auto`` the
        reason is returned and the job records a new one instead.
        """
        if self.world.rank != 0 or self.validation is None:
            return None
        stale = self.validation.result()
        if not stale:
            return None
        message = (
            f"bundle {self.options.bundle!r} is stale: "
            f"{', '.join(map(repr, stale))} changed since it was made; "
            "rebuild it, or run with --trust to use it anyway"
        )
        if not self.options.auto:
            raise StageError(message)
        self.auto = f"recorded ({message})"
        return message

    def discard(self):
        """Leaders remove a staged copy that will not be used."""
        if self.topology.is_leader and self.root:
            from mpistage.stage import remove_root

            remove_root(self.root)
        self.root, self.bytes = None, 0

    def start_recording(self):
        """``--auto`` without a usable bundle: rank 0 records this run."""
        if self.world.rank == 0:
            from mpistage.record import Recorder

            self.recorder = Recorder()

    def broadcast(self, buf):
        """Leaders receive the bundle bytes from rank 0."""
        from mpistage.broadcast import broadcast

        if not self.topology.is_leader:
            return None
        return broadcast(self.topology.leaders, buf)

    def stage(self, buf, tag):
        """Leaders write their node's copy; every rank learns where it is."""
        from mpistage import stage
        from mpistage.activate import partial_dirs
        from mpistage.bundle import manifest_of

        plan = None
        if self.topology.is_leader:
            self.bytes = len(buf)
            manifest = manifest_of(buf, self.options.bundle)
            self.root = stage.make_root(tag, self.topology.index, len(buf))
            stage.write_tree(self.root, buf, manifest, self.options.bundle)
            roots = [
                (r["path"], r["listing"], partial_dirs(manifest, i))
                for i, r in enumerate(manifest["roots"])
            ]
            plan = (self.root, roots)
        return plan

    def activate(self, plan):
        """Every rank maps the bundled roots to its node's staged copy."""
        from mpistage.activate import activate

        root, roots = self.topology.node.bcast(plan, root=0)
        self.root = root
        self.activation = activate(root, roots)

    def fail(self, error):
        """End the job after an agreed error: one line, cleanup, exit 1."""
        if self.topology is not None:
            self.discard()
        if self.world.rank == 0:
            print(f"mpistage: error: {error}", file=_sys.stderr, flush=True)
        _sys.exit(1)

    def finish(self):
        """Report on rank 0, then each leader removes its staging root."""
        from mpistage import report

        local = self.local_report()
        barrier(self.world)
        ranks = self.world.gather(local, root=0)
        if self.world.rank == 0:
            self.save_recording()
            summary = report.summarize(self.job_facts(), ranks)
            report.emit(summary, self.options.report)
        barrier(self.topology.node)
        if self.topology.is_leader and self.root and not self.options.keep:
            from mpistage.stage import remove_root

            remove_root(self.root)

    def save_recording(self):
        """Rank 0 of an ``--auto`` run that recorded writes the bundle."""
        if self.recorder is not None:
            from mpistage.cache import save

            save(self.recorder, self.options.bundle, self.args)

    def local_report(self):
        """Return this rank's timings and import counts."""
        from mpistage.activate import classify

        empty = {"served": [], "missed": [], "stdlib": []}
        modules = classify(self.activation) if self.activation else empty
        return {"seconds": self.seconds, "modules": modules, "stage_root": self.root}

    def job_facts(self):
        """Return the job-wide facts rank 0 knows."""
        return {
            "nodes": self.topology.count,
            "bundle": self.options.bundle,
            "bundle_bytes": self.bytes,
            "auto": self.auto,
        }


def job_tag():
    """Return a name for this job, unique on the node: scheduler id and pid."""
    import socket

    for name in ("SLURM_JOB_ID", "FLUX_JOB_ID", "PBS_JOBID", "LSB_JOBID"):
        if _os.environ.get(name):
            prefix = _os.environ[name].split(".")[0]
            break
    else:
        prefix = socket.gethostname().split(".")[0]
    return f"{prefix}-{_os.getpid()}-{_time.time_ns() % 10**9:09d}"


def run_target(job, args):
    """Run the target like ``python -m mpi4py``, aborting on any failure."""
    from mpi4py.run import run_command_line, set_abort_status

    start = _time.perf_counter()
    try:
        run_command_line(args)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            set_abort_status(exc)
            raise
    except BaseException as exc:
        set_abort_status(exc if isinstance(exc, KeyboardInterrupt) else 1)
        raise
    job.seconds["run"] = _time.perf_counter() - start


def main(argv=None):
    """Run the target of *argv* (default ``sys.argv[1:]``) with staging."""
    options, args = parse(_sys.argv[1:] if argv is None else argv)
    import mpi4py.run  # noqa: F401  (loaded before activation: not a miss)
    from mpi4py import MPI

    job = Job(MPI.COMM_WORLD, options, args)
    try:
        job.start()
    except StageError as exc:
        job.fail(exc)
    run_target(job, args)
    job.finish()
