"""Multi-process pipelines under torchrun: one or more stages per rank, point-to-point transport.

Usage (``torchrun --nproc-per-node=2 train.py``)::

    import pipe.distributed as pd
    env = pd.init_from_env()
    model = pd.DistributedPipe(nn.Sequential(...), chunks=8, schedule="1f1b")
    loss = model.step(inputs, target, loss_fn)

See docs/distributed.md.
"""
from pipe.distributed.env import DistributedEnv, init_from_env
from pipe.distributed.failure import PipelineFailure
from pipe.distributed.distributed_pipe import DistributedPipe

__all__ = ["DistributedPipe", "DistributedEnv", "PipelineFailure", "init_from_env"]
