"""The model against published start-up figures: ``mpistage bench model --seeds``.

Each seed is a figure someone measured at scale, with the counts the paper
gives (or that its setup implies); the table puts the model beside it and
says which metadata rate would have matched it.
"""

import dataclasses as _dataclasses

from mpistage.bench.model.equations import Inputs, metadata_ops, nodes_for, predict
from mpistage.bench.model.tables import fmt_s
from mpistage.bench.units import MB

# python-mpi-bcast's stager is a C program; the bundle size is a guess.
PMB_INPUTS = Inputs(ops_node=50, bundle_bytes=300e6, run_s=1.0)

SEEDS = (
    {
        "case": "Hopper, Warp, 1,024 cores, /home (GPFS via DVS)",
        "ranks": 1024,
        "rpn": 24,
        "mode": "plain",
        "inputs": Inputs(ops_rank=3388 + 1632, run_s=1.0),
        "published": 400.0,
        "source": "seed 002: close to 400 s; 3,388 opens + 1,632 stats per core",
    },
    {
        "case": "Hopper, Warp, 36K cores, Lustre /scratch",
        "ranks": 36864,
        "rpn": 24,
        "mode": "plain",
        "inputs": Inputs(ops_rank=3388 + 1632, run_s=1.0),
        "published": 4200.0,
        "source": "seed 002: about 10 × DLFM's 7 min (≈70 min, approximate)",
    },
    {
        "case": "Hopper, Warp, 40K cores, DLcache + FMcache",
        "ranks": 40000,
        "rpn": 24,
        "mode": "mpistage-trust",
        "inputs": Inputs(ops_rank=917, bundle_bytes=200e6, run_s=1.0),
        "published": 420.0,
        "source": "seed 002: around 7 min; F = 917 (python -c '', Python 2.7)",
    },
    {
        "case": "Blue Waters, 16,384 ranks, numpy + mpi4py",
        "ranks": 16384,
        "rpn": 32,
        "mode": "plain",
        "inputs": Inputs(ops_rank=4557, bytes_rank=9.7e6, run_s=0.5),
        "published": 437.6,
        "source": "seed 000: 7m17.6s; 4,557 ops from import numpy.fft, Python 2.7",
    },
    {
        "case": "Blue Waters, 16,384 ranks, mpiimport, outside its imports",
        "ranks": 16384,
        "rpn": 32,
        "mode": "mpistage-trust",
        "inputs": Inputs(ops_rank=917, bytes_rank=0.37e6, bundle_bytes=20e6, run_s=0.5),
        "published": 76.1,
        "source": "seed 000: 3m18.9s less 122.8 s in mpiimport's own import phase",
    },
    {
        "case": "python-mpi-bcast, Edison, 127,440 ranks, scipy",
        "ranks": 127440,
        "rpn": 24,
        "mode": "staged-env",
        "inputs": PMB_INPUTS,
        "published": 215.2,
        "launch_bound": True,
        "source": "87.2 s stage step + 128.0 s run step, each with its srun launch",
    },
    {
        "case": "python-mpi-bcast, its stage step",
        "ranks": 127440,
        "rpn": 24,
        "mode": "staged-env",
        "inputs": PMB_INPUTS,
        "published": 87.2,
        "steps": ("metadata", "read", "broadcast", "write"),
        "source": "srun of 5,310 processes; 2.16 s bcast, 43.1 s tar, 1.2 s chmod",
    },
    {
        "case": "python-mpi-bcast, rank 0's read and the broadcast",
        "ranks": 127440,
        "rpn": 24,
        "mode": "staged-env",
        "inputs": PMB_INPUTS,
        "published": 2.16,
        "steps": ("read", "broadcast"),
        "source": "its bcast timer (also each leader's write of the .tar.gz)",
    },
)


def seed_table(machine):
    """Return the markdown table of the model beside the published figures."""
    lines = [
        "| case | mode modelled | inputs | model s | published s | model / published "
        "| MDS ops/s that would match | published figure |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    return "\n".join(lines + [seed_row(seed, machine) for seed in SEEDS])


def seed_row(seed, machine):
    """Return the table line of one seed case."""
    machine = _dataclasses.replace(machine, ranks_per_node=seed["rpn"])
    nodes = nodes_for(seed["ranks"], machine)
    steps = predict(seed["inputs"], seed["ranks"], nodes, machine)
    model = sum(steps[s] for s in seed.get("steps", ("total",)))
    mode = seed["mode"]
    if "steps" in seed:
        mode += f" ({' + '.join(seed['steps'])})"
    cols = (
        seed["case"],
        mode,
        seed_inputs(seed, nodes),
        fmt_s(model),
        fmt_s(seed["published"]),
        f"{model / seed['published']:.2f}",
        matching_rate(seed, steps, nodes, machine),
        seed["source"],
    )
    return "| " + " | ".join(cols) + " |"


def seed_inputs(seed, nodes):
    """Return a short text of a seed case's inputs."""
    i = seed["inputs"]
    parts = [f"{seed['ranks']:,} ranks on {nodes:,} nodes"]
    for value, label in (
        (i.ops_rank, "ops/rank"),
        (i.ops_node, "ops/node"),
        (i.bytes_rank / MB, "MB/rank"),
        (i.bundle_bytes / MB, "MB bundle"),
        (i.run_s, "s run"),
    ):
        if value:
            parts.append(f"{value:,.4g} {label}")
    return ", ".join(parts)


def matching_rate(seed, steps, nodes, machine):
    """Return the aggregate metadata rate at which the model meets the figure."""
    if "steps" in seed or seed.get("launch_bound"):
        return "-"
    left = seed["published"] - (steps["total"] - steps["metadata"])
    ops = metadata_ops(seed["inputs"], seed["ranks"], nodes, machine)
    return f"{ops / left:,.0f}" if left > 0 and ops else "-"
