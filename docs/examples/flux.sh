#!/bin/bash
# flux batch -N 64 -n 8192 docs/examples/flux.sh
# Not run by the test suite (Flux cannot be installed there): the stage and
# clean steps are `flux run -N NODES --tasks-per-node=1`, NODES from -N.
set -euo pipefail
ENV_BUNDLE=${ENV_BUNDLE:-$HOME/envs/app-env.mpistage}
VENV=${VENV:-$HOME/envs/app}
export PATH="$VENV/bin:$PATH"
NODES=$(flux resource list -no {nnodes})

mpistage run --env "$ENV_BUNDLE" -- flux run -N "$NODES" -n 8192 python app.py
