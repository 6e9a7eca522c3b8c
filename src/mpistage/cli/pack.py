"""``mpistage pack``: the command line of :func:`mpistage.pack.pack`."""

import argparse as _argparse
import sys


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
        "--env",
        nargs="?",
        const=sys.prefix,
        metavar="PREFIX",
        help="bundle a whole environment (a venv with its base interpreter, a "
        "conda env, or a prefix; default: this Python's) for `mpistage stage`",
    )
    p.add_argument(
        "--exclude-lib",
        action="append",
        default=[],
        metavar="GLOB",
        help="with --env: also leave out shared libraries matching GLOB "
        "(glibc and the loader are always left out)",
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
    if args.env:
        return cli_env(args)
    manifest = pack(args.output, args.names, args.path, exclude=args.exclude)
    print(f"wrote {args.output}")
    print(render(manifest))
    return 0


def cli_env(args):
    """Run ``mpistage pack --env``; warn about libraries that were not found."""
    from mpistage.envpack import pack_env
    from mpistage.errors import StageError
    from mpistage.summary import render

    if args.names or args.path:
        raise StageError("--env packs a whole environment: give no names or --path")
    manifest, missing = pack_env(args.output, args.env, args.exclude, args.exclude_lib)
    print(f"wrote {args.output}")
    print(render(manifest))
    if missing:
        print(f"note: not found, so not bundled: {', '.join(missing)}", file=sys.stderr)
    return 0
