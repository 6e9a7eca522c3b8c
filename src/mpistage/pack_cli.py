"""``mpistage pack``: the command line of :func:`mpistage.pack.pack`."""

import argparse as _argparse


def parser():
    """Return the argument parser of ``mpistage pack``."""
    p = _argparse.ArgumentParser(
        prog="mpistage pack",
        description="Bundle importable packages and sys.path directories "
        "into one .mpistage file.",
    )
    p.add_argument("-o", "--output", required=True, help="the bundle to write")
    p.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help="top-level package or module, found as this Python would",
    )
    p.add_argument(
        "--path",
        action="append",
        default=[],
        metavar="DIR",
        help="add the whole directory DIR as a sys.path root",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="leave out members whose path below their root, or a parent "
        "directory's, matches GLOB (e.g. '*/tests')",
    )
    return p


def cli(argv):
    """Run ``mpistage pack`` with *argv*; return the exit status."""
    from mpistage.pack import pack
    from mpistage.summary import render

    args = parser().parse_args(argv)
    manifest = pack(args.output, args.names, args.path, exclude=args.exclude)
    print(f"wrote {args.output}")
    print(render(manifest))
    return 0
