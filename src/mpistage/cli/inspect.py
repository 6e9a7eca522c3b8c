"""``mpistage inspect``: the command line of :func:`mpistage.inspect`."""


def parser():
    """Return the argument parser of ``mpistage inspect``."""
    from mpistage.cli import argument_parser

    p = argument_parser(
        prog="mpistage inspect", description="Summarize a .mpistage bundle."
    )
    p.add_argument("bundle")
    p.add_argument("--json", action="store_true", help="print the whole manifest")
    return p


def main(argv):
    """Run ``mpistage inspect BUNDLE``; return the exit status."""
    import os

    from mpistage import inspect
    from mpistage.bundle.inspect import printable, render

    args = parser().parse_args(argv)
    manifest = inspect(args.bundle)
    if args.json:
        import json

        print(json.dumps(manifest, indent=1))
    else:
        print(printable(f"bundle: {os.path.abspath(args.bundle)}"))
        print(render(manifest))
    return 0
