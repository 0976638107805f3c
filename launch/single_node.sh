#!/usr/bin/env bash
# One machine, NPROC ranks (default 2): torchrun --standalone picks a free port itself.
#
#   bash launch/single_node.sh examples/transformer_lm_distributed.py --steps 200
#   NPROC=4 THREADS=1 bash launch/single_node.sh train.py ...
#
# THREADS (default 1) is each rank's intra-op thread count on the CPU: ranks
# sharing a machine's cores should not oversubscribe them.
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: [NPROC=2] [THREADS=1] bash $0 SCRIPT [ARGS...]" >&2
    exit 2
fi
export OMP_NUM_THREADS="${THREADS:-1}"
exec torchrun --standalone --nnodes=1 --nproc-per-node="${NPROC:-2}" "$@"
