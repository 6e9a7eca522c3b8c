#!/bin/bash
# MPICH's mpiexec (Hydra) with a host file, one host per line:
#
#   docs/examples/mpiexec.sh hosts 64 app.py ARG ...   # 64 ranks per host
#
# ENV_BUNDLE is made once from the environment VENV (mpistage is installed
# there) with `mpistage pack --env "$VENV" -o "$ENV_BUNDLE"`. The stage step
# runs once on each host of the file (`mpiexec -f hosts -n HOSTS -ppn 1`).
set -euo pipefail
ENV_BUNDLE=${ENV_BUNDLE:-$HOME/envs/app-env.mpistage}
VENV=${VENV:-$HOME/envs/app}
export PATH="$VENV/bin:$PATH"
HOSTS=$1 PPN=$2
shift 2
NODES=$(grep -c "^[^#[:space:]]" "$HOSTS")

mpistage run --env "$ENV_BUNDLE" -- \
  mpiexec -f "$HOSTS" -n $((NODES * PPN)) -ppn "$PPN" python "$@"
