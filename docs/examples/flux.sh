#!/bin/bash
# flux batch -N 64 -n 8192 docs/examples/flux.sh
set -euo pipefail
ENV_BUNDLE=$HOME/envs/app-env.mpistage
STAGE=/dev/shm/$USER-${FLUX_JOB_ID}-env
NODES=$(flux resource list -no {nnodes})

flux run -N "$NODES" --tasks-per-node=1 mpistage stage "$ENV_BUNDLE" --to "$STAGE"
eval "$(flux run -n 1 mpistage stage "$ENV_BUNDLE" --to "$STAGE" --print-env)"

flux run -n 8192 "$STAGE/bin/python" app.py

flux run -N "$NODES" --tasks-per-node=1 "$STAGE/bin/python" -m mpistage clean "$STAGE"
