"""Multi-process pipelines under torchrun: one or more stages per rank, point-to-point transport.

Usage (``torchrun --nproc-per-node=2 train.py``)::

    import pipe.distributed as pd
    env = pd.init_from_env()
    model = pd.DistributedPipe(nn.Sequential(...), chunks=8, schedule="1f1b")
    loss = model.step(inputs, target, loss_fn)

On a ``DeviceMesh`` (pipeline x FSDP2 shards, replicas, tensor parallel)::

    model = pd.DistributedPipe(nn.Sequential(...), chunks=8, mesh=pd.make_mesh(pp=2, dp_shard=2),
                               shard=pd.Shard(reshard_after_forward=False))

See docs/distributed.md and docs/distributed_training.md.
"""
from pipe.distributed.env import DistributedEnv, init_from_env
from pipe.distributed.failure import PipelineFailure
from pipe.distributed.watchdog import STALLED_EXIT
from pipe.distributed.fsdp import Shard
from pipe.distributed.mesh import MESH_DIMS, make_mesh
from pipe.distributed.distributed_pipe import DistributedPipe
from pipe.core.schedule_table import TableSchedule, torch_order

__all__ = ["DistributedPipe", "DistributedEnv", "MESH_DIMS", "PipelineFailure", "STALLED_EXIT", "Shard",
           "TableSchedule", "init_from_env", "make_mesh", "torch_order"]
