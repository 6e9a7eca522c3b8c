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
    # a stage step launched first, one process per node, then the job
    "staged-env": Inputs(
        ops_node=1829,
        bytes_node=F_BYTES,
        bundle_bytes=200e6,
        run_s=RUN_S,
        stage_launch=1.0,
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
    # srun --bcast: the launcher reads the one file (script and bundle) once,
    # its tree carries it to every node, each rank execs the node's copy.
    "env-launch-bcast": Inputs(
        ops_job=ENV_NODE_OPS, bundle_bytes=200e6, bundle_tree=1.0, run_s=RUN_S
    ),
}

# A GPU stack: an 8 GB environment (torch with its CUDA libraries), on nodes
# of 4 GPUs and 64 ranks. The import's counts are documentation, not ours:
# pytorch/pytorch#97106 profiles `import torch` (torch 2.0): 1,287
# io.open_code, 5,408 posix.stat and 164 posix.listdir, 4.3 s in all.
GPU_BUNDLE = 8e9
GPU_RANKS_PER_NODE = 64
TORCH_OPS = 1287 + 5408 + 164
TORCH_RUN_S = 4.3  # that profile's whole import: an upper bound for a local copy


def gpu_inputs():
    """Return the built-in inputs of the GPU environment, one per mode."""
    inputs = {m: _dataclasses.replace(i) for m, i in DEFAULT_INPUTS.items()}
    # plain pays F and torch's lookups; its data reads are not counted
    inputs["plain"] = Inputs(ops_rank=F_OPS + TORCH_OPS, run_s=TORCH_RUN_S)
    for mode in MODES_WITH_BUNDLE:
        inputs[mode].bundle_bytes = GPU_BUNDLE
        inputs[mode].run_s = TORCH_RUN_S
    return inputs


MODES_WITH_BUNDLE = (
    "mpistage",
    "mpistage-trust",
    "staged-env",
    "env-launch",
    "env-launch-bcast",
)
ENVIRONMENTS = ("numpy", "gpu")
DEFAULT_SOURCE = (
    "built-in numpy inputs (realistic layout on the simulated shared FS, "
    "1 rank, caches off; see docs/scale.md)"
)
INPUT_KEYS = tuple(f.name for f in _dataclasses.fields(Inputs))


GPU_SOURCE = (
    "built-in GPU environment: 8 GB bundle, torch's import counts from "
    "pytorch/pytorch#97106 (see docs/scale.md)"
)


def default_inputs(environment="numpy"):
    """Return a fresh copy of the built-in inputs, one per mode."""
    if environment == "gpu":
        return gpu_inputs()
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
