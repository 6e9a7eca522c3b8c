"""``mpistage bench generate DIR``: one flag per keyword of :func:`generate`."""

import argparse
import shlex
import sys
import time

from mpistage.bench.generate.spec import NAME, SIZES, GenerateError
from mpistage.bench.generate.tree import generate

_PROG = "mpistage"


class _GenerateParser(argparse.ArgumentParser):
    """An argument parser whose errors become :class:`GenerateError`."""

    def error(self, message):
        raise GenerateError(message)


def _parser():
    parser = _GenerateParser(
        prog="mpistage bench generate",
        description="Generate a Pynamic-like workload into DIR (a sys.path root).",
    )
    parser.add_argument("dest", metavar="DIR")
    add = parser.add_argument
    add("--modules", type=int, metavar="N", help="pure-Python modules")
    add("--packages", type=int, help=f"subpackages (default: {SIZES['packages']})")
    add(
        "--depth",
        type=int,
        help=f"subpackage nesting depth (default: {SIZES['depth']})",
    )
    add("--extensions", type=int, metavar="M", help="C extensions")
    add(
        "--libraries",
        type=int,
        metavar="K",
        help="shared libraries the extensions link against",
    )
    add("--data-files", type=int, metavar="D", help="data files")
    add("--functions", type=int, help="functions per module")
    add("--name", default=NAME, help=f"package name (default: {NAME})")
    add("--cc", default=None, help="C compiler (default: $CC, cc, gcc or clang)")
    add(
        "--no-bytecode",
        dest="bytecode",
        action="store_false",
        help="do not byte-compile the modules",
    )
    add("--force", action="store_true", help="replace an existing workload")
    parser.set_defaults(**SIZES)
    return parser


def _generate_action(args):
    start = time.monotonic()
    root = generate(
        args.dest,
        modules=args.modules,
        packages=args.packages,
        depth=args.depth,
        extensions=args.extensions,
        libraries=args.libraries,
        data_files=args.data_files,
        name=args.name,
        cc=args.cc,
        functions=args.functions,
        bytecode=args.bytecode,
        overwrite=args.force,
    )
    print(
        f"generated {args.name!r} in {str(root)!r}: {args.modules} modules, "
        f"{args.extensions} extensions, {args.libraries} libraries, "
        f"{args.data_files} data files ({time.monotonic() - start:.1f} s)"
    )
    print(
        f"  run: PYTHONPATH={shlex.quote(str(root))} {sys.executable} "
        f"-m {args.name}.driver"
    )
    return 0


def cli_generate(argv):
    """``mpistage bench generate DIR [--modules N] [--extensions M] ...``.

    Returns the exit status; user errors are one line on stderr, status 1.
    """
    try:
        try:
            args = _parser().parse_args(argv)
        except SystemExit as exc:  # --help
            return exc.code if isinstance(exc.code, int) else 0
        return _generate_action(args)
    except GenerateError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 1
