"""``mpistage bench model``: predict, validate or compare with published figures.

Flags map onto the model's layers: the machine (one flag per parameter, on
top of a base machine), the inputs (built-in, ``--results``, ``--inputs``,
``--set``), and what to print (the prediction, ``--validate``, ``--seeds``).
"""

import dataclasses as _dataclasses
import sys as _sys

from mpistage import StageError
from mpistage.bench.model.equations import MODES, Machine
from mpistage.bench.model.fit import inputs_from_results
from mpistage.bench.model.inputs import (
    DEFAULT_SOURCE,
    ENVIRONMENTS,
    GPU_RANKS_PER_NODE,
    GPU_SOURCE,
    INPUT_KEYS,
    apply_sets,
    default_inputs,
    load_inputs,
)
from mpistage.bench.model.measured import load_results, simulator
from mpistage.bench.model.plot import plot
from mpistage.bench.model.seeds import seed_table
from mpistage.bench.model.tables import describe, inputs_table, prediction_table
from mpistage.bench.model.validation import validate
from mpistage.bench.units import parse_counts, parse_size, parse_time


def parser():
    """Return the argument parser of ``mpistage bench model``."""
    from mpistage.cli import argument_parser

    p = argument_parser(
        prog="mpistage bench model",
        description="Model start-up time at scale from counts measured at small "
        "scale; check the model against measurements and published figures.",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument("--validate", metavar="RESULTS", help="model vs measured totals")
    what.add_argument("--seeds", action="store_true", help="model vs published figures")
    p.add_argument(
        "--env",
        choices=ENVIRONMENTS,
        default="numpy",
        help="built-in inputs: numpy (200 MB), or gpu (8 GB, torch, 64 ranks/node)",
    )
    p.add_argument("--results", metavar="RESULTS", help="inputs from bench run")
    p.add_argument("--workload", help="workload of the results file")
    p.add_argument("--layout", default="realistic", help="layout of the rows to use")
    p.add_argument("--inputs", metavar="JSON", help='{"mode": {"key": number}}')
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODE.KEY=VALUE",
        help=f"set one input; keys: {', '.join(INPUT_KEYS)}",
    )
    p.add_argument(
        "--ranks", default="1024,16384,131072", help="rank counts (%(default)s)"
    )
    p.add_argument("--modes", default=",".join(MODES), help="(%(default)s)")
    p.add_argument("--plot", metavar="PNG", help="save time against ranks")
    p.add_argument(
        "--weights",
        metavar="SIZE",
        help="also model a checkpoint of SIZE (e.g. 140GB) onto every node",
    )
    p.add_argument(
        "--shards", type=int, default=30, help="the checkpoint's shards (30)"
    )
    machine_flags(p)
    return p


def machine_flags(p):
    """Add one flag per machine parameter; unset flags keep the base machine's."""
    g = p.add_argument_group("machine (defaults: a Lustre-class system, docs/scale.md)")
    flag = g.add_argument
    flag("--mds-rate", type=float, metavar="OPS", help="ops/s one stream gets (2000)")
    flag("--mds-concurrency", type=float, metavar="N", help="ops served at once (20)")
    flag("--node-cache", type=float, metavar="SHARE", help="ops answered on-node (0)")
    flag("--ranks-per-node", type=int, metavar="N", help="(32)")
    flag("--fs-bw", metavar="BW", help="shared FS, all clients together (35GB/s)")
    flag("--client-bw", metavar="BW", help="shared FS, one reader (1GB/s)")
    flag("--net-latency", metavar="TIME", help="interconnect latency (5us)")
    flag("--net-bw", metavar="BW", help="interconnect bandwidth (5GB/s)")
    flag("--bcast", choices=("pipeline", "binomial"), help="(pipeline)")
    flag("--chunk", metavar="SIZE", help="pipelined broadcast chunk (4MiB)")
    flag("--local-bw", metavar="BW", help="node-local checksum and write (1GB/s)")
    flag("--launch-base", metavar="TIME", help="launch and MPI_Init, fixed (3s)")
    flag("--launch-node", metavar="TIME", help="launch, per node (6.44ms)")
    flag("--launch-rank", metavar="TIME", help="launch, per rank (0.672ms)")
    flag("--tree-width", type=int, metavar="W", help="launcher's bcast tree (8)")
    flag("--cores", type=float, metavar="N", help="cores all ranks share (none)")


def machine_from_args(args, base):
    """Return *base* with the machine flags the user gave."""
    changes = {}
    for name in ("mds_rate", "mds_concurrency", "node_cache", "ranks_per_node"):
        changes[name] = getattr(args, name)
    changes["cores"] = args.cores
    changes["bcast"] = args.bcast
    changes["tree_width"] = args.tree_width
    for name in ("launch_base", "launch_node", "launch_rank"):
        value = getattr(args, name)
        changes[name] = value and parse_time(value, "--" + name.replace("_", "-"))
    changes["net_latency"] = args.net_latency and parse_time(
        args.net_latency, "--net-latency"
    )
    for name in ("fs_bw", "client_bw", "net_bw", "chunk", "local_bw"):
        value = getattr(args, name)
        changes[name] = value and parse_size(value, "--" + name.replace("_", "-"))
    machine = _dataclasses.replace(
        base, **{k: v for k, v in changes.items() if v is not None}
    )
    check_machine(machine)
    return machine


def check_machine(machine):
    """Refuse parameters the equations cannot use."""
    positive = ("mds_rate", "mds_concurrency", "ranks_per_node", "fs_bw")
    positive += ("client_bw", "net_bw", "chunk", "local_bw", "tree_width")
    for name in positive:
        if not getattr(machine, name) > 0:
            flag = "--" + name.replace("_", "-")
            raise StageError(f"{flag} must be > 0, not {getattr(machine, name)!r}")
    if not 0 <= machine.node_cache < 1:
        raise StageError(f"--node-cache must be in [0, 1), not {machine.node_cache!r}")
    if machine.cores is not None and not machine.cores > 0:
        raise StageError(f"--cores must be > 0, not {machine.cores!r}")


def gather_inputs(args, modes):
    """Return ``(label, {mode: Inputs}, notes)`` from the layered sources.

    Built-in inputs first, then the results file's modes, then the inputs
    file, then ``--set``: each layer changes only what it names.
    """
    label = GPU_SOURCE if args.env == "gpu" else DEFAULT_SOURCE
    inputs, notes = default_inputs(args.env), []
    if args.results:
        workload, found, notes = inputs_from_results(
            args.results, args.workload, args.layout
        )
        inputs.update(found)
        label = f"{workload} from {args.results}"
        missing = [m for m in modes if m not in found]
        notes += [f"{m}: not in the results; built-in inputs" for m in missing]
    if args.inputs:
        load_inputs(args.inputs, inputs)
        label += f", with {args.inputs}"
    apply_sets(args.set, inputs)
    if args.set:
        label += ", with --set " + " ".join(args.set)
    return label, inputs, notes


def pick_modes(text):
    """Return the mode names of ``--modes``."""
    modes = [m for m in text.split(",") if m]
    if not modes:
        raise StageError(f"--modes {text!r} names no mode, e.g. {','.join(MODES)}")
    return modes


def check_modes(modes, inputs):
    """Refuse modes without inputs."""
    unknown = [m for m in modes if m not in inputs]
    if unknown:
        raise StageError(
            f"no inputs for mode {', '.join(map(repr, unknown))}: modes with inputs "
            f"are {', '.join(sorted(inputs))} (add one with --set MODE.KEY=VALUE)"
        )


def run_prediction(args):
    """Print the prediction table (and save the plot); return 0."""
    base = Machine(ranks_per_node=GPU_RANKS_PER_NODE if args.env == "gpu" else 32)
    machine = machine_from_args(args, base)
    ranks = parse_counts(args.ranks, "--ranks")
    modes = pick_modes(args.modes)
    label, inputs, notes = gather_inputs(args, modes)
    check_modes(modes, inputs)
    print(f"inputs: {label}\n{describe(machine)}\n")
    print(prediction_table(inputs, modes, ranks, machine))
    print("\ninputs per mode:\n")
    print(inputs_table(inputs, modes))
    for note in notes:
        print(f"note: {note}")
    if args.weights:
        from mpistage.bench.model.weights import weights_table

        size = parse_size(args.weights, "--weights")
        if not size > 0 or args.shards < 1:
            raise StageError("--weights and --shards must be > 0")
        print()
        print(weights_table(size, args.shards, ranks, machine))
    if args.plot:
        plot(inputs, modes, ranks, machine, args.plot)
        print(f"\nwrote {args.plot}")
    return 0


def run_validation(args):
    """Print the validation report; return 0."""
    meta, rows = load_results(args.validate)
    machine = machine_from_args(args, simulator(meta, args.cores))
    print(validate(args.validate, meta, rows, args.workload, args.layout, machine))
    return 0


def run_seeds(args):
    """Print the seed comparison table; return 0."""
    machine = machine_from_args(args, Machine())
    print(describe(machine, per_node=False) + "\n")
    print(seed_table(machine))
    return 0


def cli_model(argv):
    """Run ``mpistage bench model``; print errors as one line; return the status."""
    args = parser().parse_args(argv)
    try:
        if args.validate:
            return run_validation(args)
        if args.seeds:
            return run_seeds(args)
        return run_prediction(args)
    except StageError as exc:
        print(f"mpistage: error: {exc}", file=_sys.stderr, flush=True)
        return 1
