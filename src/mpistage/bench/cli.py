"""``mpistage bench``: the simulated shared file system and startup benchmark.

Verbs: ``simfs SRC MOUNTPOINT`` mounts the simulator, ``unmount MOUNTPOINT``
and ``stats MOUNTPOINT`` manage it, ``generate DIR`` writes a Pynamic-like
workload, ``run`` compares start-up modes side by side, ``data`` compares
reads of a shared data file, ``weights`` loads of a checkpoint, ``model``
predicts start-up at scale.
"""

import os
import sys as _sys

# Each verb is the function ``cli_VERB(argv)`` of its module, loaded on use.
VERBS = {
    "simfs": "mpistage.bench.simfs",
    "unmount": "mpistage.bench.simfs",
    "stats": "mpistage.bench.simfs",
    "generate": "mpistage.bench.generate",
    "run": "mpistage.bench.cli",
    "data": "mpistage.bench.data",
    "weights": "mpistage.bench.weights",
    "model": "mpistage.bench.model.cli",
}


HELP = """\
usage: mpistage bench VERB [options]   (mpistage bench VERB --help for each)

verbs:
  run       compare start-up modes side by side on a simulated shared file
            system (what `make demo` runs; docs/bench.md)
  data      compare reads of a shared data file
  weights   compare loads of a sharded safetensors checkpoint
  model     predict start-up at 1k-128k ranks from measured inputs
  generate  write a Pynamic-like workload of generated packages
  simfs     mount the simulated shared file system: simfs SRC MOUNTPOINT
  unmount   unmount it: unmount MOUNTPOINT
  stats     print its operation counts: stats MOUNTPOINT"""


def main(argv):
    """Dispatch ``mpistage bench VERB ...``; return the exit status."""
    import importlib

    if argv[:1] in (["-h"], ["--help"]):
        print(HELP)
        return 0
    if not argv or argv[0] not in VERBS:
        from mpistage.cli import error

        what = f"unknown verb {argv[0]!r}" if argv else "no verb"
        error(f"bench: {what}; verbs: {', '.join(VERBS)}")
        print(HELP, file=_sys.stderr)
        return 2
    verb, rest = argv[0], argv[1:]
    module = importlib.import_module(VERBS[verb])
    exit_on_term()
    return getattr(module, f"cli_{verb}")(rest)


def exit_on_term():
    """Let SIGTERM (a time limit, ``timeout``) end the bench as Ctrl-C does.

    The bench then unwinds: the simulated file systems are unmounted and
    the temporary trees removed, instead of mounts left behind.
    """
    import signal

    def leave(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


def run_parser():
    """Return the argument parser of ``mpistage bench run``."""
    from mpistage.cli import argument_parser

    p = argument_parser(
        prog="mpistage bench run",
        description="Compare startup modes side by side on a simulated "
        "shared file system.",
    )
    p.add_argument(
        "--layout",
        choices=("realistic", "packages"),
        default="realistic",
        help="realistic: interpreter, stdlib, venv, mpi4py and mpistage on the "
        "shared FS (default); packages: only the workload there",
    )
    p.add_argument(
        "--via",
        choices=("site", "pythonpath"),
        default="site",
        help="reach the workload through site-packages (default) or PYTHONPATH",
    )
    p.add_argument(
        "--workload",
        action="append",
        default=[],
        help="numpy, scipy, pandas, generated (default: numpy; with --layout "
        "packages, numpy and generated); repeat it for several",
    )
    p.add_argument("--code", help="custom workload: code every rank runs")
    p.add_argument(
        "--packages",
        default="",
        help="with --code: installed packages to put on the shared FS",
    )
    p.add_argument("--ranks", default="1,4,16", help="rank counts (default 1,4,16)")
    p.add_argument(
        "--nodes",
        type=int,
        default=4,
        help="emulated nodes (at most one per rank; default 4)",
    )
    p.add_argument(
        "--modes",
        default=None,
        help="realistic: floor,plain,mpistage,mpistage-trust,live,staged-env,local "
        "(default), env-launch, env-launch-sh, mpistage-m, auto-first; packages: "
        "plain,mpistage,"
        "mpistage-trust,auto,live,auto-first,local,plain-env,staged-env "
        "(default plain,mpistage,local)",
    )
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument(
        "--set-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for every rank of every mode (a site "
        "setting to measure, e.g. UCX_MODULES=^ib)",
    )
    p.add_argument("--latency", default="0.5ms", help="metadata latency")
    p.add_argument("--cache", action="store_true", help="enable kernel caches")
    p.add_argument(
        "--modules",
        type=int,
        default=None,
        help="generated workload: number of Python modules",
    )
    p.add_argument(
        "--extensions",
        type=int,
        default=None,
        help="generated workload: number of C extensions",
    )
    p.add_argument("-o", "--out", default="bench-out", help="output directory")
    return p


def cli_run(argv):
    """Run ``mpistage bench run``; print the table, write the files."""
    from mpistage import StageError
    from mpistage.bench import results
    from mpistage.bench.simfs import fuse_available
    from mpistage.bench.sweep import run_workload
    from mpistage.bench.units import parse_counts, parse_time

    args = run_parser().parse_args(argv)
    reason = fuse_available()
    if reason:
        raise StageError(reason)
    rows = []
    modes = parse_modes(args.modes, args.layout)
    chosen = workloads(args)
    check_workloads(modes, args.layout, chosen)
    for workload in chosen:
        rows += run_workload(
            workload,
            layout=args.layout,
            via=args.via,
            ranks=parse_counts(args.ranks, "--ranks"),
            nodes=args.nodes,
            modes=modes,
            repeat=args.repeat,
            latency=parse_time(args.latency, "--latency"),
            cache=args.cache,
            extra_env=parse_env(args.set_env),
        )
    meta = {
        "latency": args.latency,
        "nodes": args.nodes,
        "layout": args.layout,
        "via": args.via,
        "argv": argv,
        "cache": args.cache,
        "cores": os.cpu_count(),
        "set_env": args.set_env,
    }
    results.write_all(rows, args.out, meta)
    print(results.table(rows))
    print(f"\nwrote {args.out}/results.csv, results.json and results.png")
    return 0


def check_workloads(modes, layout, chosen):
    """Refuse, in one line, a mode that cannot run one of the *chosen* workloads."""
    from mpistage import StageError
    from mpistage.bench.modes import MODES

    for name in modes:
        only = getattr(MODES[layout][name], "workloads", None)
        bad = [w.name for w in chosen if only and w.name not in only]
        if bad:
            raise StageError(
                f"mode {name!r} of the {layout} layout runs the "
                f"{', '.join(only)} workload only (its environment holds no "
                f"other), not {bad[0]!r}"
            )


def workloads(args):
    """Return the workloads *args* ask for."""
    from mpistage.bench.workloads import make

    if args.code:
        return [make("code", args.code, [p for p in args.packages.split(",") if p])]
    sizes = {
        k: getattr(args, k)
        for k in ("modules", "extensions")
        if getattr(args, k) is not None
    }
    default = ["numpy"] if args.layout == "realistic" else ["numpy", "generated"]
    return [make(name, sizes=sizes) for name in args.workload or default]


def parse_env(pairs):
    """Parse ``KEY=VALUE`` pairs into a dict."""
    from mpistage import StageError

    env = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise StageError(f"--set-env {pair!r}: give KEY=VALUE")
        env[key] = value
    return env


DEFAULT_MODES = {
    "realistic": "floor,plain,mpistage,mpistage-trust,live,staged-env,local",
    "packages": "plain,mpistage,local",
}


def parse_modes(text, layout):
    """Parse ``plain,mpistage,local`` and check each mode exists in *layout*."""
    from mpistage import StageError
    from mpistage.bench.modes import MODES

    modes = [m for m in (text or DEFAULT_MODES[layout]).split(",") if m]
    unknown = [m for m in modes if m not in MODES[layout]]
    if unknown or not modes:
        raise StageError(
            f"unknown mode {unknown!r} for the {layout} layout: choose from "
            f"{', '.join(MODES[layout])}"
        )
    return modes
