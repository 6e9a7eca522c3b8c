"""``mpistage pack``: the command line of :func:`mpistage.pack`."""

import sys as _sys

from mpistage.cli import argument_parser


def parser():
    """Return the argument parser of ``mpistage pack``."""
    p = argument_parser(
        prog="mpistage pack",
        description="Bundle importable packages, sys.path directories or a "
        "whole environment into one .mpistage file.",
    )
    p.add_argument("-o", "--output", required=True, help="the bundle to write")
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress while writing (shown only on a terminal anyway)",
    )
    p.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help="top-level package or module, found as this Python would",
    )
    p.add_argument(
        "--path",
        dest="paths",
        action="append",
        default=[],
        metavar="DIR",
        help="add the whole directory DIR as a sys.path root",
    )
    p.add_argument(
        "--stdlib",
        action="store_true",
        help="also bundle the standard library (served node-locally after activation)",
    )
    p.add_argument(
        "--tests",
        action="store_true",
        help="keep packages' test directories (left out by default)",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="leave out members whose path below their root, or a parent "
        "directory's, matches GLOB (e.g. '*/docs')",
    )
    p.add_argument(
        "--env",
        nargs="?",
        const=_sys.prefix,
        metavar="PREFIX",
        help="bundle a whole environment (a venv with its base interpreter, a "
        "conda env, or a prefix; default: this Python's) for `mpistage stage`",
    )
    p.add_argument(
        "--self-extracting",
        action="store_true",
        help="with --env: write an executable that a launcher can broadcast "
        "to every node (srun --bcast=/dev/shm/env.run env.run -- python app.py)",
    )
    p.add_argument(
        "--exclude-lib",
        action="append",
        default=[],
        metavar="GLOB",
        help="with --env: also leave out shared libraries matching GLOB "
        "(glibc and the loader are always left out)",
    )
    return p


def main(argv):
    """Run ``mpistage pack``; return the exit status."""
    from mpistage import pack
    from mpistage.bundle.inspect import render
    from mpistage.cli.progress import shown

    args = parser().parse_args(argv)
    with shown("pack", quiet=args.quiet):
        manifest = pack(
            args.output,
            args.names,
            paths=args.paths,
            exclude=args.exclude,
            stdlib=args.stdlib,
            tests=args.tests,
            env=args.env,
            exclude_lib=args.exclude_lib,
            self_extracting=args.self_extracting,
        )
    print(f"wrote {args.output}")
    print(render(manifest))
    missing = manifest.get("env", {}).get("missing")
    if missing:
        print(
            f"note: not found, so not bundled: {', '.join(missing)}", file=_sys.stderr
        )
    return 0
