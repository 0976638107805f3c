"""The recompute policies' defaults that need no torch, so that the planner's model reads them without torch."""
from __future__ import annotations

__all__: list[str] = []

#: What ``select_recompute: True`` chooses: the activation functions and the
#: attention softmax of every layer (MindFormers' default is the FFN's SiLU and mul).
DEFAULT_SELECT = (r"(.*\.)?(gelu|silu|softmax)",)
