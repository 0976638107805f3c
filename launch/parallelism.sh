#!/usr/bin/env bash
# Four ranks on one machine for the mesh example (pipeline x FSDP2 shards, replicas or tensor parallel):
#
#   bash launch/parallelism.sh                       # examples/parallelism.py --layout shard
#   bash launch/parallelism.sh --layout tp-sp --steps 5
#   SCRIPT=train.py bash launch/parallelism.sh ...   # another script, the same 4 ranks
#
# torchrun --standalone picks a free port; THREADS (default 1) is each rank's
# intra-op thread count (4 ranks on a small machine should not oversubscribe it).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
export OMP_NUM_THREADS="${THREADS:-1}"
# torch backs its CPU tensors of 2 MiB or more with 2 MiB pages only when asked (the kernel's default
# "madvise" mode): FSDP's gathers and other fresh tensors then take far fewer page faults.
export THP_MEM_ALLOC_ENABLE="${THP_MEM_ALLOC_ENABLE:-1}"
exec torchrun --standalone --nnodes=1 --nproc-per-node="${NPROC:-4}" "${SCRIPT:-$here/examples/parallelism.py}" "$@"
