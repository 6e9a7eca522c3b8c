"""A mode's inputs: the built-in ones, a JSON file, ``--set MODE.KEY=VALUE``.

The built-in inputs are numpy's, measured in the realistic layout; the
hand-given layers change only what they name (``cli.gather_inputs`` stacks
them, with a results file's inputs between).
"""

import dataclasses as _dataclasses

from mpistage import StageError
from mpistage.bench.model.equations import Inputs
from mpistage.bench.model.measured import read_json

# Measured with `mpistage bench run --ranks 1,4,16 --nodes 4` (docs/benchmarks.md).
F_OPS = 1933  # python -c "from mpi4py import MPI", everything on the simulated FS
F_BYTES = 9.2e6
RUN_S = 0.14  # import numpy, numpy.linalg from node-local storage, one rank
COPY_OPS = 553  # a runner rank that imports mpi4py from its node's copy
FIRST_OPS = 1626  # the node's first rank, which imports it for the node
COPY_BYTES = 1e6  # what such a rank reads: the interpreter's start, mpistage's
FIRST_BYTES = 35e6  # F's bytes and the libraries it copies for its node
ENV_RANK_OPS = 12  # mpistage-env: the launcher's exec of the script, sh's read
ENV_NODE_OPS = 5  # mpistage-env: the node's one open of the bundle


def runner_inputs(rank0_extra):
    """The runner's inputs: the node boot's two costs; rank 0 reads and checks."""
    return Inputs(
        ops_rank=COPY_OPS,
        ops_node=FIRST_OPS - COPY_OPS,
        ops_rank0_extra=rank0_extra,
        bytes_rank=COPY_BYTES,
        bytes_node=FIRST_BYTES,
        bundle_bytes=117e6,
        run_s=RUN_S,
    )


DEFAULT_INPUTS = {
    "plain": Inputs(ops_rank=6073, bytes_rank=14.9e6, run_s=RUN_S),
    "mpistage": runner_inputs(rank0_extra=508),
    "mpistage-trust": runner_inputs(rank0_extra=212),
    "staged-env": Inputs(
        ops_node=1829, bytes_node=F_BYTES, bundle_bytes=200e6, run_s=RUN_S
    ),
    # mpistage-env: a rank execs the script and sh reads it; one process per
    # node opens the bundle and reads it whole (docs/benchmarks.md, 4b).
    "env-launch": Inputs(
        ops_rank=ENV_RANK_OPS,
        ops_node=ENV_NODE_OPS,
        bundle_bytes=200e6,
        bundle_per_node=1.0,
        run_s=RUN_S,
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
