"""Compiled stages on gloo ranks: ``DistributedPipe(compile=...)`` against the plain eager model.

1F1B, ZB-H1 and ZB-V (the split backward's I and W walk the compiled blocks'
graphs; torch's runtime refuses compiled stages there), every checkpoint mode,
two batch sizes with an uneven last micro-batch; the frames dynamo compiles
are counted: a second step compiles nothing. Then the split GPT-2 (tied
embedding replicas on both ranks) under ZB-H1. Backend ``aot_eager``, which
needs no C++ compiler; tolerance: ``assert_close``'s float32 defaults.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import pipe
from dist_models import batch, blocks, check_against_oracle
from pipe.distributed import DistributedPipe
from spawn_ranks import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from split_models import gpt2, lm_batch, lm_loss, predicted_tokens  # noqa: E402

# compile= is refused below torch 2.13 (pipe.compile.verify_compile says why).
pytestmark = pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < "2.13",
                                reason="compile= needs torch >= 2.13")


def _blocks(rank: int, world: int) -> list[str]:
    counter = CompileCounterWithBackend("aot_eager")
    checked = []
    for schedule in ("1f1b", "zb-h1", "zbv"):
        for checkpoint in ("always", "except_last", "never"):
            model = blocks(8)
            piped = DistributedPipe(copy.deepcopy(model), chunks=4, checkpoint=checkpoint, schedule=schedule,
                                    loss_fn=F.mse_loss, compile={"backend": counter})
            assert piped.compiled_layers and list(piped.state_dict()) == [
                key for key in model.state_dict() if key.split(".")[0] in piped.compiled_layers]
            frames = []
            for size, seed in ((10, 0), (14, 1)):  # micro-batches 3 3 2 2, then 4 4 4 2
                inputs, target = batch(size, seed)
                piped.zero_grad()
                loss = piped.step(inputs, target)
                check_against_oracle(piped, model, inputs, target, loss, f"{schedule}/{checkpoint}/B={size}")
                frames.append(counter.frame_count)
            assert frames[1] == frames[0], f"{schedule}/{checkpoint}: the second step recompiled"
            checked.append(f"{schedule}/{checkpoint}")
    return checked


def test_compiled_blocks_match_the_plain_model_in_every_schedule_and_mode() -> None:
    expected = [f"{s}/{c}" for s in ("1f1b", "zb-h1", "zbv") for c in ("always", "except_last", "never")]
    assert run_ranks(_blocks, 2, deadline=240) == [expected, expected]


def _split_gpt2(rank: int, world: int) -> int:
    torch.manual_seed(0)
    model = gpt2()
    reference = copy.deepcopy(model)
    ids, mask, _ = lm_batch(8, 8)
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=["transformer.h.1"])
    counter = CompileCounterWithBackend("aot_eager")
    piped = DistributedPipe(stages, chunks=4, checkpoint="except_last", schedule="zb-h1", loss_reduction="sum",
                            compile={"backend": counter})
    frames = []
    for step in range(2):
        ids, mask, labels = lm_batch(8, 8, seed=step)
        tokens = predicted_tokens(labels)
        piped.zero_grad()
        reference.zero_grad()
        loss = piped.step((ids, mask), labels, lambda logits, y: lm_loss(logits, y, tokens))
        expected = lm_loss(reference(ids, attention_mask=mask).logits, labels)
        expected.backward()
        if piped.is_last:
            torch.testing.assert_close(loss, expected)
        for name, parameter in piped.named_parameters():  # the plain model's names
            torch.testing.assert_close(parameter.grad, reference.get_parameter(name).grad, atol=1e-5,
                                       rtol=1e-4, msg=lambda m: f"step {step} {name}: {m}")
        frames.append(counter.frame_count)
    assert frames[1] == frames[0] > 0
    return frames[0]


@pytest.mark.slow
def test_split_gpt2_compiled_under_zero_bubble() -> None:
    pytest.importorskip("transformers")
    assert all(frames > 0 for frames in run_ranks(_split_gpt2, 2, deadline=240))
