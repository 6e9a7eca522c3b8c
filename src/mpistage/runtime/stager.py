"""``mpistage stage BUNDLE --to DIR [--print-env]``: see :mod:`mpistage.envstage`."""

import sys as _sys


def parser():
    """Return the argument parser of ``mpistage stage``."""
    import argparse

    p = argparse.ArgumentParser(
        prog="mpistage stage",
        description="Unpack an environment bundle (mpistage pack --env) into "
        "node-local DIR, once per node; run under mpiexec or srun.",
    )
    p.add_argument("bundle", help="the environment bundle")
    p.add_argument(
        "--to",
        required=True,
        metavar="DIR",
        help="node-local directory ({node} becomes the node index)",
    )
    p.add_argument(
        "--print-env",
        action="store_true",
        help="print only the shell lines to use it, for eval",
    )
    return p


def read_env(path):
    """Rank 0: read the bundle and check it is an environment bundle."""
    from mpistage.bundle import manifest_of
    from mpistage.errors import StageError
    from mpistage.read import read_bundle

    buf = read_bundle(path)
    if manifest_of(buf, path).get("kind") != "env":
        raise StageError(
            f"{path!r} is not an environment bundle: make one with "
            "`mpistage pack --env -o env.mpistage`"
        )
    return buf


def stage_all(world, args):
    """Read, broadcast and unpack on every node; return rank 0's outcome."""
    from mpistage.broadcast import broadcast
    from mpistage.collective import attempt
    from mpistage.envstage import node_dir, unpack
    from mpistage.topology import discover

    topo = attempt(world, discover, world)
    buf = attempt(world, lambda: read_env(args.bundle) if world.rank == 0 else None)
    buf = attempt(
        world, lambda: broadcast(topo.leaders, buf) if topo.is_leader else None
    )
    folder = node_dir(args.to, topo.index)
    outcome = attempt(
        world, lambda: unpack(folder, buf, args.bundle) if topo.is_leader else None
    )
    wrote = world.gather(outcome[1] if outcome else None, root=0)
    return folder, (outcome[0] if outcome else None), wrote


def cli(argv):
    """Run ``mpistage stage``; return the exit status."""
    from mpi4py import MPI

    from mpistage.envstage import env_lines
    from mpistage.errors import StageError

    args = parser().parse_args(argv)
    world = MPI.COMM_WORLD
    try:
        folder, manifest, wrote = stage_all(world, args)
    except StageError as exc:
        if world.rank == 0:
            print(f"mpistage: error: {exc}", file=_sys.stderr, flush=True)
        return 1
    if world.rank == 0:
        lines = env_lines(folder, manifest)
        if not args.print_env:
            staged = sum(1 for w in wrote if w is True)
            reused = sum(1 for w in wrote if w is False)
            print(
                f"staged {args.bundle} into {args.to} on {staged + reused} "
                f"node(s) ({reused} already staged); to use it:",
                file=_sys.stderr,
            )
        print("\n".join(lines), flush=True)
    return 0
