"""``mpistage clean [DIR] [--dry-run]``: the command line of the clean tool."""


def parser():
    """Return the argument parser of ``mpistage clean``."""
    import argparse

    p = argparse.ArgumentParser(
        prog="mpistage clean",
        description="Remove this user's staging roots of jobs that have ended, "
        "or, given DIR, an environment staged there (run it once per node).",
    )
    p.add_argument("dir", nargs="?", help="a directory `mpistage stage` filled")
    p.add_argument("--dry-run", action="store_true", help="list, do not remove")
    return p


def main(argv):
    """Run ``mpistage clean``; return the exit status."""
    from mpistage.build.clean import clean

    args = parser().parse_args(argv)
    for root in clean(args.dir, dry_run=args.dry_run):
        print(("would remove " if args.dry_run else "removed ") + root)
    return 0
