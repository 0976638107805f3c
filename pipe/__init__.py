"""pipe: pipeline-parallel training for PyTorch.

``Pipe(model, chunks=8, checkpoint="except_last")`` runs an ``nn.Sequential``
as a GPipe pipeline over devices, with recomputation of activations.
"""
from pipe.checkpoint import is_checkpointing, is_recomputing
from pipe.pipe import Pipe

__all__ = ["Pipe", "is_checkpointing", "is_recomputing"]
__version__ = "0.1.0"
