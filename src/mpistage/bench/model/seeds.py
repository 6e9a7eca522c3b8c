"""The model against published start-up figures: ``mpistage bench model --seeds``.

Each seed is a figure someone measured at scale, with the counts the paper
gives (or that its setup implies). A row either fits one parameter (its
ratio is 1.00 by construction, or says how far the parameter's published
source is from the row) or checks the parameters other rows fitted. The
table says which, and which parameter a fit row sets.
"""

import dataclasses as _dataclasses
import math as _math

from mpistage.bench.model.equations import (
    Inputs,
    Machine,
    launch_seconds,
    metadata_ops,
    nodes_for,
    predict,
)
from mpistage.bench.model.tables import fmt_s
from mpistage.bench.units import MB

# python-mpi-bcast on Edison (Cray XC30, Slurm, Cray MPICH, 24 ranks per node):
# benchmarks/cray-xc30/bench-N.out. The stage step is `srun -N N bcast`, one
# C process per node: rank 0 reads the tarballs, MPI_Bcast to the leaders,
# each writes its .tar.gz ("bcast" timer), untars it ("tar"), chmods. The run
# step is `srun -N N --ntasks-per-node=24 python-mpi -c 'import scipy; from
# mpi4py import MPI'`, Python from /dev/shm. Per node count: stage step real
# s, bcast s, tar s, chmod s, run step real s.
EDISON = {
    1: (11.083, 0.433365, 7.58505, 0.0590911, 8.235),
    1024: (28.967, 1.92552, 8.9971, 0.267918, 26.954),
    4096: (48.583, 2.167, 11.1573, 0.808127, 85.281),
    5310: (87.233, 2.15751, 43.1168, 1.19226, 128.020),
}
EDISON_RPN = 24


def edison_stage_launch(nodes):
    """Return the launch of the stage step: its real time less its timers."""
    real, bcast, tar, chmod, _ = EDISON[nodes]
    return real - bcast - tar - chmod


def edison_launch():
    """Return ``(base, per node, per rank, run_s)`` fitted on Edison's sweep.

    The stage step's launch at 1 and 5,310 nodes (one process per node)
    gives base and per node + per rank; the run step at 1 and 5,310 nodes
    (24 ranks per node) splits them and leaves each rank's local run time.
    """
    one, many = edison_stage_launch(1), edison_stage_launch(5310)
    both = (many - one) / (5310 - 1)  # per node + per rank, one rank per node
    base = one - both
    run_step = EDISON[5310][4] - EDISON[1][4]  # 5,309 nodes, 127,416 ranks more
    rank = (run_step - 5309 * both) / (127416 - 5309)
    node = both - rank
    run_s = EDISON[1][4] - base - node - EDISON_RPN * rank
    return base, node, rank, run_s


def edison_bundle(machine):
    """Return ``(tarball bytes, link bytes/s)`` from the bcast timer.

    At 1 node the timer holds rank 0's read and the leader's write of the
    tarballs: their size at the machine's two bandwidths. At 5,310 nodes it
    adds one MPI_Bcast of one message, which grew by one step per doubling
    of the nodes (0.15 s): a binomial tree, ⌈log2 N⌉ hops of S/β.
    """
    size = EDISON[1][1] / (1 / machine.client_bw + 1 / machine.local_bw)
    hops = _math.ceil(_math.log2(5310))
    per_hop = (EDISON[5310][1] - EDISON[1][1]) / hops - machine.net_latency
    return size, size / per_hop


def blue_waters_cache(machine):
    """Return the node-cache share h at which the Blue Waters plain row fits."""
    seed = next(s for s in SEEDS if s["fits"].startswith("Blue Waters' node"))
    m = seed_machine(seed, machine, fitted=False)
    ranks = seed["ranks"]
    nodes = nodes_for(ranks, m)
    steps = predict(seed["inputs"], ranks, nodes, m)
    left = seed["published"] - (steps["total"] - steps["metadata"])
    ops = seed["inputs"].ops_rank
    others = left * m.mds_rate * m.mds_concurrency - nodes * ops
    return 1 - others / ((ranks - nodes) * ops)


# Hopper's /home (GPFS via DVS): seed 002 found Warp 4 × faster at 36K cores
# on Lustre /scratch than the users' /home prediction: a 4 × slower server.
HOME_SLOWDOWN = 4.0
WARP = Inputs(ops_rank=3388 + 1632, run_s=1.0)  # seed 002, per core; t_run a guess


def edison_row(case, role, nodes, kind, fits=""):
    """Return one seed row of python-mpi-bcast's Edison sweep."""
    real, bcast, tar, chmod, run = EDISON[nodes]
    ranks, rpn, steps = nodes, 1, None
    inputs = Inputs()
    if kind == "launch":
        published, steps = edison_stage_launch(nodes), ("launch",)
        source = (
            f"stage step {real:g} s less bcast {bcast:g}, tar {tar:g}, chmod {chmod:g}"
        )
    elif kind == "run":
        ranks, rpn, published = nodes * EDISON_RPN, EDISON_RPN, run
        inputs = Inputs(run_s=-1.0)  # the fitted run time, filled in seed_inputs
        source = "srun python-mpi -c 'import scipy; from mpi4py import MPI', /dev/shm"
    elif kind == "bcast":
        published, steps = bcast, ("read", "broadcast", "write")
        inputs = Inputs(bundle_bytes=-1.0)
        source = "its bcast timer: rank 0's read, MPI_Bcast, each leader's write"
    elif kind == "stage":
        published = real
        inputs = Inputs(bundle_bytes=-1.0, write_s=-1.0)
        source = f"real; tar took {tar:g} s here, {EDISON[1][2]:g} s on 1 node"
    else:  # the whole job: both steps, both launches
        ranks, rpn, published = nodes * EDISON_RPN, EDISON_RPN, real + run
        inputs = Inputs(bundle_bytes=-1.0, write_s=-1.0, run_s=-1.0, stage_launch=1)
        source = f"{real:g} s stage step + {run:g} s run step, each an srun"
    return {
        "case": case,
        "system": "edison",
        "role": role,
        "fits": fits,
        "ranks": ranks,
        "rpn": rpn,
        "mode": "staged-env",
        "inputs": inputs,
        "published": published,
        "steps": steps,
        "source": "python-mpi-bcast bench-" + f"{nodes}.out: " + source,
    }


SEEDS = (
    {
        "case": "Hopper, Warp, 36K cores, Lustre /scratch",
        "system": "hopper",
        "role": "check",
        "fits": "",
        "ranks": 36864,
        "rpn": 24,
        "mode": "plain",
        "inputs": WARP,
        "published": 4200.0,
        "source": "seed 002: about 10 × DLFM's 7 min (≈70 min, approximate)",
    },
    {
        "case": "Hopper, Warp, 40K cores, DLcache + FMcache",
        "system": "hopper",
        "role": "check",
        "fits": "",
        "ranks": 40000,
        "rpn": 24,
        "mode": "mpistage-trust",
        "inputs": Inputs(ops_rank=917, bundle_bytes=200e6, run_s=1.0),
        "published": 420.0,
        "outside": "917 ops/rank is Python 2.7's whole start (python-mpi-bcast's "
        "strace); DLFM's own per-rank count, and its FMcache broadcast per "
        "import, are not published",
        "source": "seed 002: around 7 min; F = 917 (python -c '', Python 2.7)",
    },
    {
        "case": "Hopper, Warp, 1,024 cores, /home (GPFS via DVS)",
        "system": "hopper-home",
        "role": "fit",
        "fits": "/home's server: 1/4 of /scratch's rate (seed 002: 4 × faster "
        "on /scratch than the /home prediction at 36K)",
        "ranks": 1024,
        "rpn": 24,
        "mode": "plain",
        "inputs": WARP,
        "published": 400.0,
        "source": "seed 002: close to 400 s; 3,388 opens + 1,632 stats per core",
    },
    {
        "case": "Blue Waters, 16,384 ranks, numpy + mpi4py",
        "system": "blue-waters",
        "role": "fit",
        "fits": "Blue Waters' node cache h",
        "ranks": 16384,
        "rpn": 32,
        "mode": "plain",
        "inputs": Inputs(ops_rank=4557, bytes_rank=9.7e6, run_s=0.5),
        "published": 437.6,
        "source": "seed 000: 7m17.6s; 4,557 ops from import numpy.fft, Python 2.7",
    },
    {
        "case": "Blue Waters, 16,384 ranks, mpiimport, outside its imports",
        "system": "blue-waters",
        "role": "check",
        "fits": "",
        "ranks": 16384,
        "rpn": 32,
        "mode": "mpistage-trust",
        "inputs": Inputs(ops_rank=917, bytes_rank=0.37e6, bundle_bytes=20e6, run_s=0.5),
        "published": 76.1,
        "source": "seed 000: 3m18.9s less 122.8 s in mpiimport's own import phase",
    },
    edison_row("Edison, launch of 1 process", "fit", 1, "launch", "launch: fixed part"),
    edison_row(
        "Edison, launch of 5,310 processes on 5,310 nodes",
        "fit",
        5310,
        "launch",
        "launch: per node + per rank",
    ),
    edison_row(
        "Edison, run step, 24 ranks on 1 node", "fit", 1, "run", "t_run (scipy)"
    ),
    edison_row(
        "Edison, run step, 127,440 ranks",
        "fit",
        5310,
        "run",
        "launch: per rank (the rest per node)",
    ),
    edison_row(
        "Edison, read + write of the tarballs, 1 node",
        "fit",
        1,
        "bcast",
        "tarball size",
    ),
    edison_row(
        "Edison, read + MPI_Bcast + write, 5,310 nodes",
        "fit",
        5310,
        "bcast",
        "Edison's link bandwidth",
    ),
    edison_row("Edison, launch of 1,024 processes", "check", 1024, "launch"),
    edison_row("Edison, launch of 4,096 processes", "check", 4096, "launch"),
    edison_row("Edison, run step, 24,576 ranks", "check", 1024, "run"),
    edison_row("Edison, run step, 98,304 ranks", "check", 4096, "run"),
    edison_row("Edison, read + MPI_Bcast + write, 1,024 nodes", "check", 1024, "bcast"),
    edison_row("Edison, read + MPI_Bcast + write, 4,096 nodes", "check", 4096, "bcast"),
    edison_row("python-mpi-bcast, its stage step, 5,310 nodes", "check", 5310, "stage"),
    edison_row("python-mpi-bcast, the job, 127,440 ranks", "check", 5310, "job"),
    {
        "case": "srun of 73,728 ranks on 2,048 nodes, MVAPICH2 2.2, Omni-Path",
        "system": "seed-003",
        "role": "check",
        "fits": "",
        "ranks": 73728,
        "rpn": 36,
        "mode": "launch",
        "inputs": Inputs(),
        "published": 110.0,
        "source": "seed 003: osu_initbarfin, MPI_Init 96.4 s of 110 s "
        "(Open MPI 2.0: 200 s, Intel MPI 5.1: 362 s)",
    },
)


def seed_machine(seed, machine, fitted=True):
    """Return the machine of a seed's system: *machine* with what the seeds fit."""
    changes = {"ranks_per_node": seed["rpn"]}
    system = seed["system"]
    if system == "hopper-home":
        changes["mds_concurrency"] = machine.mds_concurrency / HOME_SLOWDOWN
    elif system == "blue-waters" and fitted:
        changes["node_cache"] = blue_waters_cache(machine)
    elif system == "edison":
        changes["bcast"] = "binomial"  # one MPI_Bcast of one message
        changes["net_bw"] = edison_bundle(machine)[1]
    return _dataclasses.replace(machine, **changes)


def seed_inputs(seed, machine):
    """Return a seed's inputs with what the Edison fits supply (marked -1)."""
    i = seed["inputs"]
    if seed["system"] != "edison":
        return i
    size = edison_bundle(machine)[0]
    changes = {}
    if i.run_s < 0:
        changes["run_s"] = edison_launch()[3]
    if i.bundle_bytes < 0:
        changes["bundle_bytes"] = size
    if i.write_s is not None and i.write_s < 0:
        # the tarball's write, then its unpacking as measured on 1 node
        changes["write_s"] = size / machine.local_bw + EDISON[1][2] + EDISON[1][3]
    return _dataclasses.replace(i, **changes)


def seed_model(seed, machine):
    """Return ``(model seconds, steps, nodes, machine, inputs)`` of one seed."""
    m = seed_machine(seed, machine)
    nodes = nodes_for(seed["ranks"], m)
    inputs = seed_inputs(seed, machine)
    steps = predict(inputs, seed["ranks"], nodes, m)
    if seed["mode"] == "launch":
        return launch_seconds(seed["ranks"], nodes, m), steps, nodes, m, inputs
    model = sum(steps[s] for s in seed.get("steps") or ("total",))
    return model, steps, nodes, m, inputs


def seed_ratios(machine=None):
    """Return ``[(case, role, model / published), ...]`` for every seed."""
    machine = machine or Machine()
    return [
        (s["case"], s["role"], seed_model(s, machine)[0] / s["published"])
        for s in SEEDS
    ]


def seed_table(machine):
    """Return the markdown table of the model beside the published figures."""
    lines = [
        "| case | role | mode modelled | inputs | model s | published s "
        "| model / published | MDS ops/s that would match | published figure |",
        "|---|---|---|---|---:|---:|---:|---:|---|",
    ]
    lines += [seed_row(seed, machine) for seed in SEEDS]
    return "\n".join(lines + [""] + seed_summary(machine))


def seed_summary(machine):
    """Return the lines that count the fit and check rows and name the outliers."""
    ratios = seed_ratios(machine)
    checks = [r for r in ratios if r[1] == "check"]
    inside = [r for r in checks if 0.5 <= r[2] <= 2.0]
    lines = [
        f"{len(ratios) - len(checks)} fit rows, each setting one parameter; "
        f"{len(inside)} of {len(checks)} check rows within 0.5-2.0."
    ]
    for seed, (case, _, ratio) in zip(SEEDS, ratios, strict=True):
        if not 0.5 <= ratio <= 2.0:
            why = seed.get("outside", "no reason recorded")
            lines.append(f"outside 2×: {case} ({ratio:.2f}): {why}.")
    return lines


def seed_row(seed, machine):
    """Return the table line of one seed case."""
    model, steps, nodes, m, inputs = seed_model(seed, machine)
    mode = seed["mode"]
    if seed.get("steps"):
        mode += f" ({' + '.join(seed['steps'])})"
    role = f"fit: {seed['fits']}" if seed["role"] == "fit" else "check"
    ratio = model / seed["published"]
    cols = (
        seed["case"],
        role,
        mode,
        describe_inputs(seed, inputs, nodes),
        fmt_s(model),
        fmt_s(seed["published"]),
        f"{ratio:.2f}" + (" (outside 2×)" if not 0.5 <= ratio <= 2.0 else ""),
        matching_rate(seed, steps, nodes, m, inputs),
        seed["source"],
    )
    return "| " + " | ".join(cols) + " |"


def describe_inputs(seed, i, nodes):
    """Return a short text of a seed case's inputs."""
    parts = [f"{seed['ranks']:,} ranks on {nodes:,} nodes"]
    for value, label in (
        (i.ops_rank, "ops/rank"),
        (i.ops_node, "ops/node"),
        (i.bytes_rank / MB, "MB/rank"),
        (i.bundle_bytes / MB, "MB bundle"),
        (i.write_s or 0, "s unpack"),
        (i.run_s, "s run"),
    ):
        if value:
            parts.append(f"{value:,.4g} {label}")
    return ", ".join(parts)


def matching_rate(seed, steps, nodes, machine, inputs):
    """Return the aggregate metadata rate at which the model meets the figure."""
    ops = metadata_ops(inputs, seed["ranks"], nodes, machine)
    if seed.get("steps") or seed["mode"] == "launch" or not ops:
        return "-"
    left = seed["published"] - (steps["total"] - steps["metadata"])
    return f"{ops / left:,.0f}" if left > 0 else "-"
