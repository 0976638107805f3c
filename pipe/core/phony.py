"""Phony tensors: size-0 tensors that carry an autograd edge and no data.

Fork/join and the Recompute trigger need edges in the autograd graph that move
no memory. One phony per (device, requires_grad) is cached and reused: they
are never written to, so sharing them is safe.
"""
from __future__ import annotations

import threading

import torch

from pipe.core.stream import default_stream, use_stream

__all__: list[str] = []

_phonies: dict[tuple[torch.device, bool], torch.Tensor] = {}
_lock = threading.Lock()


def get_phony(device: torch.device, *, requires_grad: bool) -> torch.Tensor:
    """Returns the cached size-0 tensor for ``device``.

    Args:
        device: where the phony lives.
        requires_grad: whether it starts an autograd edge.

    Returns:
        A tensor of shape ``(0,)``; callers ``detach()`` it before returning it
        from an autograd function.
    """
    key = (device, requires_grad)
    with _lock:
        phony = _phonies.get(key)
        if phony is None:
            # Allocated on the default stream so that no stream owns it.
            with use_stream(default_stream(device)):
                phony = torch.empty(0, device=device, requires_grad=requires_grad)
            _phonies[key] = phony
    return phony
