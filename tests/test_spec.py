"""One validated spec: Pipe and DistributedPipe check their shared arguments once, worded alike."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from torch import nn

from pipe import Pipe
from pipe.distributed import DistributedPipe
from pipe.spec import PipelineSpec

BAD: list[tuple[dict[str, Any], type, str]] = [
    ({"chunks": 0}, ValueError, "chunks must be a positive int, got 0"),
    ({"chunks": 2.5}, TypeError, "chunks must be an int"),
    ({"checkpoint": "sometimes"}, ValueError, "checkpoint must be one of 'always', 'except_last', 'never', got 'sometimes'"),
    ({"deferred_batch_norm": 1}, TypeError, "deferred_batch_norm must be True or False, got 1"),
    ({"compile": "yes"}, (TypeError, ValueError), "compile"),  # type: ignore[list-item]
]


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))


@pytest.mark.parametrize("kwargs,error,message", BAD)
def test_both_front_ends_refuse_a_bad_argument_with_the_specs_words(kwargs: dict[str, Any], error: Any,
                                                                     message: str) -> None:
    with pytest.raises(error, match=message) as from_spec:
        PipelineSpec.checked(kwargs.get("chunks", 1), kwargs.get("checkpoint", "never"),
                             **{k: v for k, v in kwargs.items() if k not in ("chunks", "checkpoint")})
    with pytest.raises(error) as from_pipe:
        Pipe(_model(), **kwargs)
    with pytest.raises(error) as from_distributed:  # refused before any process group is needed
        DistributedPipe(_model(), **kwargs)
    assert str(from_pipe.value) == str(from_distributed.value) == str(from_spec.value)


def test_the_process_runners_own_arguments_are_refused_by_the_spec_too() -> None:
    with pytest.raises(ValueError, match="loss_reduction must be 'mean', 'sum' or 'count', got 'avg'"):
        DistributedPipe(_model(), loss_reduction="avg")
    with pytest.raises(ValueError, match="cpu_threads must be a positive int or None, got 0"):
        Pipe(_model(), cpu_threads=0)


def test_the_spec_is_frozen_and_describes_what_ranks_compare() -> None:
    spec = PipelineSpec.checked(4, "always", balance=[1, 1], schedule="1f1b", loss_reduction="count")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.chunks = 8  # type: ignore[misc]
    assert spec.describe() == {"chunks": 4, "checkpoint": "always", "schedule": "1f1b", "balance": [1, 1],
                               "virtual_stages": 1, "loss_reduction": "count",
                               "deferred_batch_norm": False, "recompute": False, "compile": False}
    pipe = Pipe(_model(), chunks=2, checkpoint="never")
    assert pipe.spec.chunks == pipe.chunks == 2 and pipe.spec.checkpoint == "never"
