"""``mpistage record``: a trial run that writes the bundle it needed.

``mpistage record -o app.mpistage [--granularity package|file] -- CMD...``
runs CMD (``python app.py``, or ``mpiexec -n 4 python app.py`` at small
width) with a recorder in every Python process it starts, then builds one
bundle from the union of what they used.
"""


def parser():
    """Return the argument parser of ``mpistage record``."""
    from mpistage.cli import argument_parser

    p = argument_parser(
        prog="mpistage record",
        description="Run a command once and bundle what its Python processes used.",
        usage="mpistage record -o OUT.mpistage [--granularity package|file] "
        "[--no-stdlib] [-q] -- CMD [ARG ...]",
    )
    p.add_argument("-o", "--output", required=True, help="the bundle to write")
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress while writing (shown only on a terminal anyway)",
    )
    p.add_argument(
        "--granularity",
        choices=("package", "file"),
        default="package",
        help="whole top-level packages (default) or only used files",
    )
    p.add_argument(
        "--no-stdlib",
        dest="stdlib",
        action="store_false",
        help="leave out the standard library modules the program used",
    )
    p.add_argument(
        "--usage",
        action="append",
        default=[],
        metavar="FILE",
        help="build from usage a run saved (--auto learning runs do) instead "
        "of running a command",
    )
    p.add_argument("command", nargs="*", help="the command, after --")
    return p


def main(argv):
    """Run ``mpistage record``; return the exit status."""
    from mpistage.bundle.inspect import render
    from mpistage.bundle.record import record
    from mpistage.cli.progress import shown

    args = parser().parse_args(argv)
    with shown("record", quiet=args.quiet):
        manifest = record(
            args.output,
            args.command,
            granularity=args.granularity,
            stdlib=args.stdlib,
            usage=args.usage,
        )
    print(f"wrote {args.output}")
    print(render(manifest))
    return 0
