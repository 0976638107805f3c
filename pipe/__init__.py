"""pipe: pipeline-parallel training for PyTorch.

``Pipe(model, chunks=8, checkpoint="except_last")`` runs an ``nn.Sequential``
as a GPipe pipeline over devices, with recomputation of activations.
"""
from pipe.checkpoint import is_checkpointing, is_recomputing
from pipe.pipe import Pipe
from pipe import balance, skip  # pipe.balance.balance_by_time, pipe.skip.skippable, as in torchgpipe

__all__ = ["Pipe", "is_checkpointing", "is_recomputing", "balance", "skip"]
__version__ = "0.1.0"
