#!/usr/bin/env bash
# Several machines: run this once on every machine, with the same MASTER (host:port of
# the rendezvous, any one of the machines), NNODES and JOB_ID, and NODE_RANK 0..NNODES-1.
#
#   # machine 0                                        # machine 1
#   MASTER=10.0.0.1:29500 NNODES=2 NODE_RANK=0 \       MASTER=10.0.0.1:29500 NNODES=2 NODE_RANK=1 \
#     bash launch/multi_node.sh train.py                 bash launch/multi_node.sh train.py
#
# NPROC ranks per machine (default 1), THREADS intra-op threads per rank (default 1),
# MAX_RESTARTS (default 0) restarts of every rank after one fails.
# The c10d rendezvous needs nothing but the MASTER port open between the machines.
set -euo pipefail
if [ $# -lt 1 ] || [ -z "${MASTER:-}" ] || [ -z "${NNODES:-}" ] || [ -z "${NODE_RANK:-}" ]; then
    echo "usage: MASTER=HOST:PORT NNODES=N NODE_RANK=I [NPROC=1] [THREADS=1] [MAX_RESTARTS=0] [JOB_ID=pipe] bash $0 SCRIPT [ARGS...]" >&2
    exit 2
fi
export OMP_NUM_THREADS="${THREADS:-1}"
# torch backs its CPU tensors of 2 MiB or more with 2 MiB pages only when asked (the kernel's default
# "madvise" mode): FSDP's gathers and other fresh tensors then take far fewer page faults.
export THP_MEM_ALLOC_ENABLE="${THP_MEM_ALLOC_ENABLE:-1}"
# A restarted attempt (--max-restarts) needs a rendezvous store of its own: torch shares one by
# default, which keeps the failed attempt's keys (pytorch/pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
exec torchrun --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="${NPROC:-1}" \
    --max-restarts="${MAX_RESTARTS:-0}" --rdzv-backend=c10d --rdzv-endpoint="$MASTER" --rdzv-id="${JOB_ID:-pipe}" "$@"
