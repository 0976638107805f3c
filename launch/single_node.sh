#!/usr/bin/env bash
# One machine, NPROC ranks (default 2): torchrun --standalone picks a free port itself.
#
#   bash launch/single_node.sh examples/transformer_lm_distributed.py --steps 200
#   NPROC=4 THREADS=1 bash launch/single_node.sh train.py ...
#   MAX_RESTARTS=3 bash launch/single_node.sh train.py --resume auto ...
#
# THREADS (default 1) is each rank's intra-op thread count on the CPU: ranks
# sharing a machine's cores should not oversubscribe them. MAX_RESTARTS (default 0):
# how many times torchrun restarts every rank after one fails (the script resumes
# from its newest checkpoint by itself).
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: [NPROC=2] [THREADS=1] [MAX_RESTARTS=0] bash $0 SCRIPT [ARGS...]" >&2
    exit 2
fi
export OMP_NUM_THREADS="${THREADS:-1}"
# torch backs its CPU tensors of 2 MiB or more with 2 MiB pages only when asked (the kernel's default
# "madvise" mode): FSDP's gathers and other fresh tensors then take far fewer page faults.
export THP_MEM_ALLOC_ENABLE="${THP_MEM_ALLOC_ENABLE:-1}"
# A restarted attempt (--max-restarts) needs a rendezvous store of its own: torch shares one by
# default, which keeps the failed attempt's keys (pytorch/pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
exec torchrun --standalone --nnodes=1 --nproc-per-node="${NPROC:-2}" --max-restarts="${MAX_RESTARTS:-0}" "$@"
