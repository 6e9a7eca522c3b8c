#!/bin/bash
#SBATCH --nodes=64
#SBATCH --ntasks-per-node=128
#SBATCH --time=01:00:00
# Stage the environment once per node, run from node-local storage, clean up.
set -euo pipefail
ENV_BUNDLE=$HOME/envs/app-env.mpistage        # mpistage pack --env -o ... (login node)
STAGE=/dev/shm/$USER-$SLURM_JOB_ID-env

# One task per node: rank 0 reads the bundle, each node's leader unpacks it.
srun --ntasks-per-node=1 mpistage stage "$ENV_BUNDLE" --to "$STAGE"
eval "$(srun --ntasks=1 mpistage stage "$ENV_BUNDLE" --to "$STAGE" --print-env)"

srun "$STAGE/bin/python" app.py --input data.h5

srun --ntasks-per-node=1 "$STAGE/bin/python" -m mpistage clean "$STAGE"
