"""A mode's local costs, fitted from its measured 1-rank cell.

The op counts and bytes are read straight from the cells; what the counts
cannot say (the run time of a rank, a node's staging time, the launcher's
ops) is what the 1-rank cell's total leaves once the model has charged the
rest on the machine the benchmark simulated.
"""

import dataclasses as _dataclasses

from mpistage.bench.model.equations import Inputs, predict
from mpistage.bench.model.inputs import DEFAULT_INPUTS
from mpistage.bench.model.measured import cells, load_results, pick_rows, simulator


def cell_inputs(cell, fitted):
    """Return the inputs of one measured cell: its own op counts, fitted costs.

    A node's extra ops are its stage step's, or (the runner's node boot)
    what its first rank paid beyond the others.
    """
    ops_rank = cell["ops_rank_median"]
    first = max(cell["ops_first"] - ops_rank, 0.0) if cell["ops_first"] else 0.0
    return _dataclasses.replace(
        fitted,
        ops_rank=ops_rank,
        ops_rank0_extra=max(cell["ops_rank0"] - ops_rank, 0.0),
        ops_node=cell["ops_stage_node"] + first,
    )


def fit(cell, machine, mode=None):
    """Fit a mode's local costs from its 1-rank cell on *machine*.

    The launcher's ops are what the cell's processes did beyond rank 0 and
    the stage step; the per-node staging time is ``stage_s`` less the stage
    step's metadata; the per-rank run time is what the total leaves. How
    *mode* reads its bundle (once, or per node) is the built-in one's.
    """
    bundle = cell["bundle_bytes"]
    node_ops = cell["ops_stage_node"]
    rest = max(cell["bytes_read"] - bundle, 0.0)
    inputs = Inputs(
        ops_rank=cell["ops_rank0"],
        ops_node=node_ops,
        ops_job=max(cell["meta_ops"] - cell["ops_rank0"] - node_ops, 0.0),
        bytes_rank=0.0 if node_ops else rest,
        bytes_node=rest if node_ops else 0.0,
        bundle_bytes=bundle,
        write_s=staging_seconds(cell, machine),
        bundle_per_node=DEFAULT_INPUTS.get(mode, Inputs()).bundle_per_node,
    )
    spent = predict(inputs, 1, 1, machine)["total"]
    inputs.run_s = max(cell["total_s"] - spent, 0.0)
    return inputs


def staging_seconds(cell, machine):
    """Return a node's staging time at one node: ``stage_s`` less what the
    model counts elsewhere (the stage step's metadata, the bundle's read)."""
    if not cell["bundle_bytes"]:
        return 0.0
    meta = cell["ops_stage_node"] / machine.mds_rate
    read = cell["bundle_bytes"] / machine.client_bw
    return max(cell["stage_s"] - meta - read, 0.0)


def fits(table, machine):
    """Return ``{mode: fitted inputs}`` for every mode with a 1-rank cell."""
    return {
        mode: fit(cell, machine, mode)
        for (mode, ranks, _), cell in sorted(table.items())
        if ranks == 1
    }


def inputs_from_results(path, workload, layout):
    """Return ``(workload, {mode: Inputs}, notes)`` for a cluster prediction.

    Op counts come from each mode's widest cell (the median rank other than
    0); bytes, the launcher's ops and the run time from its 1-rank cell, fitted
    on the simulator the file describes. The staging time is left to the
    machine's node-local bandwidth.
    """
    meta, rows = load_results(path)
    workload, rows = pick_rows(rows, workload, layout)
    table = cells(rows)
    fitted = fits(table, simulator(meta, None))
    found, notes = {}, []
    for mode in sorted({m for m, _, _ in table}):
        widest = max((k for k in table if k[0] == mode), key=lambda k: k[1])
        base = fitted.get(mode) or missing_fit(mode, notes)
        inputs = cell_inputs(table[widest], _dataclasses.replace(base, write_s=None))
        if widest[1] == 1:
            inputs.ops_rank = one_rank_ops(mode, table, inputs, notes)
            inputs.ops_rank0_extra = max(
                table[widest]["ops_rank0"] - inputs.ops_rank, 0
            )
        found[mode] = inputs
    return workload, found, notes


def missing_fit(mode, notes):
    """Return built-in local costs for a mode without a 1-rank cell, noted."""
    notes.append(f"{mode}: no 1-rank row; run time and bytes are the built-in ones")
    return _dataclasses.replace(DEFAULT_INPUTS.get(mode, DEFAULT_INPUTS["plain"]))


def one_rank_ops(mode, table, inputs, notes):
    """Return the ops of a rank other than 0 when only 1-rank cells exist.

    Rank 0 of the runner also checks the bundle, so its count overstates the
    others'; ``floor`` (the interpreter and mpi4py alone) is closer.
    """
    runner = inputs.bundle_bytes and not (inputs.ops_node or inputs.bundle_per_node)
    if runner and ("floor", 1, 1) in table:
        notes.append(f"{mode}: ops of ranks other than 0 taken from floor at 1 rank")
        return table[("floor", 1, 1)]["ops_rank0"]
    return table[next(k for k in table if k[0] == mode and k[1] == 1)]["ops_rank0"]
