"""The ``mpistage`` command and ``python -m mpistage``: the boot path.

``mpistage pack|record|inspect|clean|run|bench ...`` are tools (see
:mod:`mpistage.cli`). Anything else is the runner (``mpistage app.py``,
``mpistage -m mod``, ``mpistage -c code``), ``mpistage stage`` is the
stager and ``mpistage data`` stages directories (:mod:`mpistage.data.
command`); they run in every rank of a job, so this file keeps their start-up
to the least: it imports mpi4py with the ``PYTHONPATH`` entries and the
script directory off ``sys.path`` (they are searched for nothing), one rank
per node from the shared file system and the others from its node-local
copy (:mod:`mpistage.node.boot`), gets the runtime package from rank 0
(:func:`mpistage.load_runtime`), restores ``sys.path`` exactly, and hands
over.
"""

import os as _os
import sys as _sys

from mpistage import COMMANDS, TOOLS


def main(argv=None):
    """Dispatch *argv* (default ``sys.argv[1:]``): a tool, the stager or the runner."""
    argv = list(_sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"], ["--version"]):
        from mpistage.runtime.runner import parse

        parse(argv)  # prints and exits, without starting MPI
    if argv and argv[0] in TOOLS:
        from mpistage.cli import main as tool

        _sys.exit(tool(argv))
    if argv and looks_like_command(argv[0]):
        from mpistage.cli import unknown

        _sys.exit(unknown(argv[0]))
    command = argv[0] if argv and argv[0] in ("stage", "data") else None
    world = boot()
    try:
        if command == "stage":
            from mpistage.runtime.stager import main as entry

            status = entry(world, argv[1:])
        elif command == "data":
            from mpistage import preload

            preload(world, "mpistage.data")  # rank 0 reads it, the others do not
            from mpistage.data.command import main as entry

            status = entry(world, argv[1:])
        else:
            from mpistage.runtime.runner import main as entry

            status = entry(world, argv, learn=learned)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        crash(world, exc)
    finally:
        from mpistage.node.boot import leave

        leave()
    _sys.exit(status)


def learned(*args):
    """Save what an ``--auto`` run learned: :func:`mpistage.learn.save`.

    Loaded at the end of the run, read relative to mpistage's directory
    (:func:`mpistage.load_local`), never through the finders now serving.
    """
    from mpistage import load_local

    load_local("mpistage", ("learn",))
    from mpistage.learn import save

    return save(*args)


def tool_path(argv=None):
    """A tool or the stager: take the start directory off ``sys.path``.

    ``python -m`` and the ``mpistage`` command put it first, as the
    runner's program expects. mpistage's own work never imports from it,
    and one that others can write (``/tmp``, a group's project directory)
    would run their modules as this user, in every process that
    ``mpistage run`` starts.
    """
    argv = _sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS and not getattr(_sys.flags, "safe_path", 0):
        del _sys.path[0]


def looks_like_command(word):
    """Whether *word* is a mistyped subcommand rather than a script to run."""
    return (
        word not in ("stage", "data", "-")
        and not word.startswith("-")
        and _os.sep not in word
        and not word.endswith(".py")
        and not _os.path.exists(word)
    )


def boot():
    """Import mpi4py and the runtime without searching ``PYTHONPATH``; return world."""
    from mpistage import NODE, load_local, load_runtime

    saved = _sys.path[:]
    _sys.path[:] = boot_path(saved)
    try:
        load_local("mpistage", ("settings",))
        load_local("mpistage.node", NODE)
        from mpistage.node.boot import import_mpi

        MPI = import_mpi()
        load_runtime(MPI.COMM_WORLD)
    finally:
        _sys.path[:] = saved
    return MPI.COMM_WORLD


def boot_path(path):
    """Return *path* without the script directory and the ``PYTHONPATH`` entries."""
    extra = (
        _os.environ.get("PYTHONPATH", "") if not _sys.flags.ignore_environment else ""
    )
    skip = {_os.path.abspath(p) for p in extra.split(_os.pathsep) if p}
    return [p for p in path[1:] if p and _os.path.abspath(p) not in skip]


def crash(world, exc):
    """An unexpected error outside any agreed step: say so, end the job."""
    from mpistage.runtime.collective import abort, describe

    print(
        f"mpistage: error: on rank {world.rank}: {describe(exc)}",
        file=_sys.stderr,
        flush=True,
    )
    abort(world, 1)


if __name__ == "__main__":
    tool_path()
    main()
