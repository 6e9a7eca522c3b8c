#!/bin/bash
#SBATCH --nodes=64
#SBATCH --ntasks-per-node=128
#SBATCH --time=01:00:00
# Stage the environment once per node, run from node-local storage, clean up.
#
#   sbatch docs/examples/slurm.sh [app.py ARG ...]
#
# ENV_BUNDLE is made once, on a login node, from the environment VENV with
# `mpistage pack --env "$VENV" -o "$ENV_BUNDLE"`. VENV is the shared
# environment (mpistage is installed there): its python runs the stage
# step, once per node; every rank then starts the node's staged copy.
# `mpistage run` takes the nodes from the allocation (SLURM_JOB_NODELIST)
# and keeps srun's options, such as --mpi=pmix.
set -euo pipefail
ENV_BUNDLE=${ENV_BUNDLE:-$HOME/envs/app-env.mpistage}
VENV=${VENV:-$HOME/envs/app}
export PATH="$VENV/bin:$PATH"
[ $# -gt 0 ] || set -- app.py --input data.h5

mpistage run --env "$ENV_BUNDLE" -- srun python "$@"
