"""The runner: ``python -m mpistage [options] (app.py | -m mod | -c code) [args]``.

A thin shell over :class:`~mpistage.runtime.session.Session`. It mirrors
``python -m mpi4py``: ``sys.argv``, ``__main__`` and exit codes behave as with
plain python, and an unhandled exception or a nonzero exit on any rank
prints its traceback and ends the whole job with ``MPI_Abort`` (each node's
watchdog then removes its copy). Errors of the steps are agreed by all ranks: rank 0
prints one ``mpistage: error:`` line and every rank exits with status 1.
"""

import os as _os
import sys as _sys
import time as _time

from mpistage import COMMANDS, StageError, preload, settings
from mpistage.runtime.target import import_runpy, run_command_line
from mpistage.runtime.validate import MODES

USAGE = """\
usage: PROG [options] <app.py> [arg] ...
   or: PROG [options] -m <module> [arg] ...
   or: PROG [options] -c <code> [arg] ...

options:
  --bundle FILE   stage FILE (.mpistage) node-locally and import from it
                  (default: $MPISTAGE_BUNDLE; without a bundle, imports are
                  served live: rank 0 reads, each node keeps a copy)
  --auto          learn the bundle on the first run (every rank records),
                  replay it on later runs, rebuild it when stale
  --cache-dir DIR where --auto keeps bundles (default: $MPISTAGE_CACHE_DIR,
                  else $XDG_CACHE_HOME/mpistage or ~/.cache/mpistage)
  --validate=MODE staleness check by rank 0 before the broadcast: default
                  (distributions, directories, files no distribution owns),
                  files (every file's size and mtime) or strict (checksums)
  --trust         skip the staleness check
  --data DIR      copy the directory DIR (a model checkpoint) once per node
                  before the program runs, read once per job; the program
                  finds the node's copy in $MPISTAGE_DATA_DIR (repeat for
                  several: ':'-separated; default: $MPISTAGE_DATA)
  --keep          keep the node places after the job
  --report        print a summary of the job on rank 0 (stderr)
  --version       print the version and exit
  -h, --help      show this help and exit

environment:
%s

tools: mpistage {%s} --help"""

FORWARD_PAUSE = 0.1  # seconds for the launcher to forward a failing rank's output
VALUED = ("--bundle", "--cache-dir", "--validate", "--data")
SWITCHES = ("--keep", "--report", "--auto")


class Options:
    """Runner options, from the command line and the environment."""

    data = ()
    bundle = None
    auto = False
    cache_dir = None
    validate = "default"
    keep = False
    report = False


def usage():
    """Return the usage, named as the user started the runner."""
    main = _sys.argv[0].endswith("__main__.py")
    text = USAGE % ("\n".join(settings.help_lines()), ",".join(COMMANDS))
    return text.replace("PROG", "python -m mpistage" if main else "mpistage")


def usage_error(message):
    """The runner's usage error (:func:`mpistage.node.launch.usage_error`)."""
    from mpistage.node.launch import usage_error as refuse

    refuse(message, usage())


def parse(argv):
    """Split *argv* into runner :class:`Options` and the target's arguments."""
    options, args = Options(), list(argv)
    while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):
        take_option(options, args)
    if not args:
        usage_error("no target: give app.py, -m module or -c code")
    if args[0] in ("-m", "-c") and len(args) < 2:
        usage_error(f"{args[0]} needs an argument")
    if options.validate not in MODES:
        usage_error(f"--validate={options.validate!r}: use default, files or strict")
    if options.auto and options.bundle:
        usage_error("--auto and --bundle exclude each other")
    if not options.auto:
        options.bundle = options.bundle or settings.get("MPISTAGE_BUNDLE")
    options.data = options.data or settings.get("MPISTAGE_DATA")
    return options, args


def take_option(options, args):
    """Consume the option at the head of *args* into *options*."""
    opt, eq, value = args.pop(0).partition("=")
    if opt in ("-h", "--help"):
        print(usage())
        _sys.exit(0)
    elif opt == "--version":
        from mpistage import __version__

        print(f"mpistage {__version__}")
        _sys.exit(0)
    elif opt in VALUED:
        if not eq:
            value = args.pop(0) if args else ""
        if not value:
            usage_error(f"{opt} needs a value")
        value = [*options.data, value] if opt == "--data" else value  # repeated
        setattr(options, opt[2:].replace("-", "_"), value)
    elif opt in SWITCHES and not eq:
        setattr(options, opt[2:], True)
    elif opt == "--trust" and not eq:
        options.validate = "trust"
    else:
        usage_error(f"unknown option {opt!r}")


class Runner:
    """One run of the runner on one rank: the session, the target, the end.

    The runner drives a :class:`~mpistage.runtime.session.Session` and
    never the other way round: it finds the nodes, chooses the bundle
    (``--bundle``, or the ``--auto`` cache), hands both to the session, runs
    the target, and ends the job (report, learned bundle, the session's
    close), also inside ``MPI_Finalize`` when the program calls it first.
    """

    def __init__(self, world, options, args):
        self.world, self.options, self.args = world, options, list(args)
        self.session = self.recorder = self.auto = self.watch = self.learn = None
        self.data = []
        self.status, self.ended, self.cancel_watch = 0, False, None
        self.seconds, self.live = {}, None

    def start(self):
        """Check the target, find the nodes, stage (or, with ``--auto``, record)."""
        from mpistage.node.cleanup import at_finalize
        from mpistage.node.launch import emulated_nodes
        from mpistage.runtime.collective import attempt
        from mpistage.runtime.topology import discover

        # Every rank reads its own environment: a bad value ends the job here.
        attempt(self.world, settings.check, self.world.size, emulated_nodes)
        attempt(self.world, self.check_target)
        begun = _time.perf_counter()
        topology = attempt(self.world, discover, self.world)
        self.seconds["topology"] = _time.perf_counter() - begun
        self.stage_data()
        bundle = self.auto_bundle() if self.options.auto else self.options.bundle
        self.session = self.new_session(bundle, topology)
        import_runpy(self.args)
        if self.options.auto:
            self.start_auto()
        elif bundle:
            self.session.start()
            self.say_off_path()
        else:
            self.start_live()
        self.cancel_watch = at_finalize(self.end, self.world)
        if self.reporting():
            self.watch = self.new_watch()

    def new_watch(self):
        """Count reads of the originals after activation: bundled or live roots."""
        from mpistage.runtime.report import Watch

        staged, live = self.session.staged, self.live
        if staged is not None:
            roots = [r["path"] for r in staged.manifest["roots"]]
            return Watch(roots, skip=[staged.path])
        if live is not None and live.mode == "live":
            return Watch(live.roots, skip=[live.copy_root])
        return None

    def stage_data(self):
        """``--data``: :func:`mpistage.data.dirs.for_program`, before any import
        is served (:mod:`mpistage.data` is not imported through the finders)."""
        if self.options.data:
            from mpistage.data import dirs

            begun = _time.perf_counter()
            self.data = dirs.for_program(self.world, self.options.data)
            self.seconds["data"] = _time.perf_counter() - begun

    def say_off_path(self):
        """Rank 0: say in one line if none of the bundle's roots is on ``sys.path``.

        A bundle made in another venv stages and then serves nothing; the
        report's misses would blame the bundle's content instead.
        """
        from mpistage.runtime.auto import target_path0
        from mpistage.runtime.roots import in_stdlib

        if self.world.rank != 0 or self.session.staged is None:
            return
        here = {_os.path.abspath(p or ".") for p in _sys.path}
        here.add(target_path0(self.args))
        manifest = self.session.staged.manifest
        held = sorted({m["root"] for m in manifest["members"]})
        roots = [manifest["roots"][i]["path"] for i in held]
        own = [r for r in roots if not in_stdlib(r)]
        if own and not here.intersection(own):
            print(
                f"mpistage: none of the bundle's roots is on this sys.path, so its "
                f"imports are not served (made with another Python or venv?): "
                f"{', '.join(own)}",
                file=_sys.stderr,
                flush=True,
            )

    def new_session(self, bundle, topology):
        """Return the session of *bundle* on the nodes of *topology*."""
        from mpistage.runtime.session import Session

        options = self.options
        return Session(
            self.world, bundle, options.validate, options.keep,
            topology=topology, watch=False,
        )  # fmt: skip

    def reporting(self):
        """Whether a report was asked for (``--report`` or ``MPISTAGE_REPORT``)."""
        return bool(self.options.report or settings.get("MPISTAGE_REPORT"))

    def check_target(self):
        """Rank 0: refuse a missing script or an unwritable report, before anything.

        Both are known before the program runs, so nothing is lost.
        """
        script = self.args[0]
        if self.world.rank != 0:
            return
        if script not in ("-m", "-c", "-") and not _os.path.isfile(script):
            raise StageError(f"can't open file {script!r}: no such file")
        from mpistage.runtime.report import check_writable

        check_writable(settings.get("MPISTAGE_REPORT"))

    def auto_bundle(self):
        """Return the ``--auto`` cache's bundle path for this target (agreed)."""
        from mpistage.runtime import auto
        from mpistage.runtime.broadcast import share
        from mpistage.runtime.collective import attempt

        def on_rank0():
            if self.world.rank != 0:
                return None
            return auto.bundle_path(self.args, self.options.cache_dir)

        return share(self.world, attempt(self.world, on_rank0))

    def start_auto(self):
        """Replay the cached bundle, or record this run when there is none.

        A cached bundle whose bytes turn out corrupt while they are sent
        (its checksums are checked in that pass) is learned again, as one
        whose manifest is.
        """
        from mpistage.runtime import auto
        from mpistage.runtime.broadcast import share
        from mpistage.runtime.collective import attempt
        from mpistage.runtime.read import CORRUPT

        session, rank0 = self.session, self.world.rank == 0
        bundle, verdict = session.timed(  # the report's read step
            "read",
            attempt,
            self.world,
            lambda: (
                auto.read_cached(session.bundle, session.staleness)
                if rank0
                else (None, None)
            ),
        )
        verdict = share(self.world, verdict)
        if not verdict:
            try:
                session.spread(bundle)
            except StageError as exc:
                if CORRUPT not in str(exc):
                    raise
                verdict = share(self.world, attempt(self.world, self.relearn, exc))
        self.auto = verdict or "replayed"
        if verdict:
            self.start_live(sources=True)
            self.recorder = auto.start_recording()

    def relearn(self, why):
        """Rank 0: the cached bundle is corrupt; check it can be learned again."""
        from mpistage.runtime import auto

        return (
            auto.relearn(self.session.bundle, str(why))
            if self.world.rank == 0
            else None
        )

    def start_live(self, sources=False):
        """No bundle: serve imports live (:mod:`~mpistage.runtime.live`), unless off.

        With *sources* (an ``--auto`` learning run), sources travel with their
        bytecode, for the bundle built from node 0's copy at the end.
        """
        if not live_wanted(self.world):
            return
        preload(self.world, "mpistage.node", ("elf",))  # the reader's ELF reader
        preload(self.world, "mpistage.runtime.live")  # read only when used
        from mpistage.runtime.live import LiveSession

        self.live = LiveSession(self.session, self.args, sources)
        self.live.start()

    def run(self):
        """Run the target like ``python -m mpi4py``; end the job if it fails."""
        start = _time.perf_counter()
        try:
            run_command_line(self.args)
        except SystemExit as exc:
            self.status = exit_status(exc)
            if self.status:
                self.abort(exc)
        except BaseException as exc:
            self.abort(exc)
        self.seconds["run"] = _time.perf_counter() - start

    def abort(self, exc):
        """Show what went wrong and end the whole job.

        The copies are not removed here: other ranks of the node may still be
        importing from them. ``MPI_Abort`` ends every rank, and each leader's
        watchdog removes its node's copy when the leader is gone.
        """
        from mpistage.runtime.collective import abort

        forked = self.session.forked
        self.session.leave()
        if isinstance(exc, SystemExit):
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=_sys.stderr)
        else:
            _sys.excepthook(type(exc), exc, exc.__traceback__)
        _sys.stdout.flush()
        _sys.stderr.flush()
        if forked:  # A child of the program failed, not the job: it ends alone.
            _os._exit(exit_status(exc))
        _time.sleep(FORWARD_PAUSE)
        abort(self.world, exit_status(exc))

    def finish(self):
        """End the job (unless it ended inside ``MPI_Finalize``); return the status."""
        self.end()
        return self.status

    def end(self):
        """Save what was learned, report, close the session: once, collectively.

        It runs after the target, or inside ``MPI_Finalize`` if the program
        calls it first; a forked child of the program only lets go locally.
        """
        if self.ended:
            return
        self.ended = True
        if self.session.forked:
            self.session.close()
            return
        self.cancel_watch()
        if self.live is not None:
            self.live.close()  # its relays end first; the report counts them
        self.wrap_up()
        if self.live is not None:
            self.live.release()
        for copy in self.data:
            copy.close()  # collective on each node, as the session's end
        self.session.close()

    def wrap_up(self):
        """Save what was learned (``--auto``), then report, if asked."""
        from mpistage.runtime import report
        from mpistage.runtime.collective import attempt

        if self.recorder is not None and self.learn is not None:
            self.learn(
                self.world, self.recorder, self.session.bundle, self.args, self.live
            )
        if not self.reporting():
            return
        seconds = {**self.session.seconds, **self.seconds}
        facts = report.local_facts(self.session, seconds, self.watch, self.live)
        facts["live"] = self.live.facts() if self.live else None
        ranks = self.world.gather(facts, root=0)

        def on_rank0():
            if self.world.rank == 0:
                summary = report.summarize(self.job_facts(), ranks)
                report.emit(summary, self.options.report)

        attempt(self.world, on_rank0)  # a report rank 0 cannot write fails all

    def job_facts(self):
        """Return the job-wide facts rank 0 knows."""
        session = self.session
        return {
            "nodes": session.topology.count if session.topology else 1,
            "bundle": session.bundle,
            "bundle_bytes": session.staged.nbytes if session.staged else 0,
            "auto": self.auto,
            "live": self.live.mode if self.live else None,
        }


def exit_status(exc):
    """Return the exit status a ``SystemExit`` or other exception stands for."""
    if isinstance(exc, SystemExit):
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return 1


def main(world, argv, learn=None):
    """Run the target of *argv* with staging on every rank of *world*.

    *learn* saves what an ``--auto`` run learned (:func:`mpistage.learn.save`,
    from a layer above this one); without it, ``--auto`` runs plainly.
    """
    options, args = parse(argv)
    runner = Runner(world, options, args)
    runner.learn = learn
    try:
        runner.start()
    except StageError as exc:
        fail(runner, exc)
    runner.run()
    try:
        status = runner.finish()
    except StageError as exc:
        fail(runner, exc)
    if runner.session.forked:
        leave_child(status)
    return status


def leave_child(status):
    """End a child the program forked: its exit handlers, but no MPI_Finalize.

    The child shares the parent's MPI state; finalizing it there would
    break the parent's job (``multiprocessing`` ends its children the same way).
    """
    import atexit

    run = getattr(atexit, "_run_exitfuncs", None)
    if run is not None:
        run()
    _sys.stdout.flush()
    _sys.stderr.flush()
    _os._exit(status)


def live_wanted(world):
    """Whether to serve imports live: ``MPISTAGE_LIVE`` on rank 0 (agreed)."""
    from mpistage.runtime.broadcast import share
    from mpistage.runtime.collective import attempt

    value = attempt(
        world, lambda: settings.get("MPISTAGE_LIVE") if world.rank == 0 else None
    )
    return share(world, value)


def fail(runner, error):
    """End every rank after an agreed error: one line, cleanup, exit 1."""
    if runner.session is not None:
        runner.session.abandon()
    if runner.live is not None:
        runner.live.abandon()
    if runner.world.rank == 0:
        print(f"mpistage: error: {error}", file=_sys.stderr, flush=True)
    _sys.exit(1)
