"""``mpistage record``: a trial run that writes the bundle it needed.

``mpistage record -o app.mpistage [--granularity package|file] -- CMD...``
runs CMD (``python app.py``, or ``mpiexec -n 4 python app.py`` at small
width) with a recorder in every Python process it starts, then builds one
bundle from the union of what they used.
"""


def parser():
    """Return the argument parser of ``mpistage record``."""
    import argparse

    p = argparse.ArgumentParser(
        prog="mpistage record",
        description="Run a command once and bundle what its Python processes used.",
        usage="mpistage record -o OUT.mpistage [--granularity package|file] "
        "-- CMD [ARG ...]",
    )
    p.add_argument("-o", "--output", required=True, help="the bundle to write")
    p.add_argument(
        "--granularity",
        choices=("package", "file"),
        default="package",
        help="whole top-level packages (default) or only used files",
    )
    p.add_argument("command", nargs="*", help="the command, after --")
    return p


def record_command(command):
    """Run *command* with recorders; return (exit status, usages)."""
    import glob
    import json
    import os
    import subprocess
    import tempfile

    hook = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_hook")
    with tempfile.TemporaryDirectory(prefix="mpistage-record-") as folder:
        env = dict(os.environ, MPISTAGE_RECORD_DIR=folder)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (hook, os.environ.get("PYTHONPATH")) if p
        )
        try:
            status = subprocess.call(command, env=env)
        except OSError as exc:
            from mpistage.errors import StageError

            raise StageError(f"cannot run {command[0]!r}: {exc.strerror}") from None
        usages = []
        for path in sorted(glob.glob(os.path.join(folder, "usage.*.json"))):
            with open(path) as f:
                usages.append(json.load(f))
    return status, usages


def cli(argv):
    """Run ``mpistage record``; return the exit status."""
    from mpistage.errors import StageError
    from mpistage.record import build
    from mpistage.summary import render

    args = parser().parse_args(argv)
    if not args.command:
        raise StageError("no command to record: mpistage record -o X -- python app.py")
    status, usages = record_command(args.command)
    if status != 0:
        raise StageError(
            f"the recorded command exited with status {status}; no bundle written"
        )
    if not usages:
        raise StageError(
            "no Python process was recorded: run a Python program "
            "of this environment (python app.py)"
        )
    extra = {"command": args.command, "processes": len(usages)}
    manifest = build(args.output, usages, args.granularity, "record", extra)
    print(f"wrote {args.output}")
    print(render(manifest))
    return 0
