#!/bin/bash
# Plain mpiexec (MPICH hydra) with a host file of NODES hosts.
set -euo pipefail
ENV_BUNDLE=$HOME/envs/app-env.mpistage
STAGE=/dev/shm/$USER-env
NODES=$(wc -l < hosts)

mpiexec -f hosts -n "$NODES" -ppn 1 mpistage stage "$ENV_BUNDLE" --to "$STAGE"
eval "$(mpiexec -n 1 mpistage stage "$ENV_BUNDLE" --to "$STAGE" --print-env)"

mpiexec -f hosts -n $((NODES * 64)) -ppn 64 "$STAGE/bin/python" app.py

mpiexec -f hosts -n "$NODES" -ppn 1 "$STAGE/bin/python" -m mpistage clean "$STAGE"
