"""A mode's inputs: the built-in ones, a JSON file, ``--set MODE.KEY=VALUE``.

The built-in inputs are numpy's, measured in the realistic layout; the
hand-given layers change only what they name (``cli.gather_inputs`` stacks
them, with a results file's inputs between).
"""

import dataclasses as _dataclasses

from mpistage import StageError
from mpistage.bench.model.equations import Inputs
from mpistage.bench.model.measured import read_json

# Measured with `mpistage bench run --ranks 1,8,32 --nodes 4` (docs/benchmarks.md).
F_OPS = 1837  # python -c "from mpi4py import MPI", everything on the simulated FS
F_BYTES = 9.7e6
RUN_S = 0.20  # import numpy, numpy.linalg from node-local storage, one rank
RUNNER_START_OPS = 161  # the runner finding and starting mpistage, beyond F


def runner_inputs(rank0_extra):
    """The runner's inputs: F plus finding mpistage; rank 0 reads and checks."""
    return Inputs(
        ops_rank=F_OPS + RUNNER_START_OPS,
        ops_rank0_extra=rank0_extra,
        bytes_rank=F_BYTES,
        bundle_bytes=117e6,
        run_s=RUN_S,
    )


DEFAULT_INPUTS = {
    "plain": Inputs(ops_rank=6142, bytes_rank=27.8e6, run_s=RUN_S),
    "mpistage": runner_inputs(rank0_extra=334),
    "mpistage-trust": runner_inputs(rank0_extra=213),
    "staged-env": Inputs(
        ops_node=2202, bytes_node=F_BYTES, bundle_bytes=200e6, run_s=RUN_S
    ),
}
DEFAULT_SOURCE = (
    "built-in numpy inputs (realistic layout on the simulated shared FS, "
    "1 rank, caches off; see docs/scale.md)"
)
INPUT_KEYS = tuple(f.name for f in _dataclasses.fields(Inputs))


def default_inputs():
    """Return a fresh copy of the built-in inputs, one per mode."""
    return {m: _dataclasses.replace(i) for m, i in DEFAULT_INPUTS.items()}


def set_input(inputs, mode, key, value, where):
    """Set one input of *mode* in *inputs*, refusing unknown keys and bad values."""
    if key not in INPUT_KEYS:
        raise StageError(
            f"{where}: unknown input {key!r}; inputs are {', '.join(INPUT_KEYS)}"
        )
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = -1.0
    if not number >= 0:
        raise StageError(f"{where}: {mode}.{key} must be a number >= 0, not {value!r}")
    setattr(inputs.setdefault(mode, Inputs()), key, number)


def load_inputs(path, inputs):
    """Apply a JSON file ``{"mode": {"key": number, ...}, ...}`` to *inputs*."""
    data = read_json(path, "inputs")
    if not isinstance(data, dict) or not all(
        isinstance(v, dict) for v in data.values()
    ):
        raise StageError(
            f'inputs file {path!r} must be {{"mode": {{"key": number}}}}, '
            'e.g. {"plain": {"ops_rank": 5020}}'
        )
    for mode, values in data.items():
        for key, value in values.items():
            set_input(inputs, mode, key, value, path)


def apply_sets(sets, inputs):
    """Apply ``MODE.KEY=VALUE`` settings to *inputs*."""
    for item in sets:
        target, eq, value = item.partition("=")
        mode, dot, key = target.rpartition(".")
        if not (eq and dot and mode):
            raise StageError(f"--set {item!r} must look like plain.ops_rank=5020")
        set_input(inputs, mode, key, value, "--set")
