"""Compiled stages in the thread runner: ``Pipe(compile=...)`` against the plain eager model.

Backend ``aot_eager`` (dynamo's graphs and AOT autograd's joint forward and
backward, eager kernels) runs on a machine without a C++ compiler, as CI's
fresh machine may be; one test runs inductor where a compiler is found.
Every test counts the frames dynamo compiles: after the first step, other
batch sizes, a smaller last micro-batch and checkpoint replays compile nothing.
Tolerance: outputs and gradients within ``assert_close``'s float32 defaults
(rtol 1.3e-6, atol 1e-5), as compiled graphs may fuse and reorder sums.
"""
from __future__ import annotations

import copy
import logging
import re
import shutil
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend

import pipe
from pipe import Pipe
from pipe.compile import CompileError, compiled_layers, verify_compile
from pipe.split_blocks import blocks_of
from helpers import assert_same_grads
from split_models import VOCAB, assert_same_lm_step, gpt2, lm_batch, tied_model

# compile= is refused below torch 2.13 (pipe.compile.verify_compile says why).
pytestmark = pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < "2.13",
                                reason="compile= needs torch >= 2.13")

CHECKPOINTS = ("always", "except_last", "never")


class Block(nn.Module):
    """A pre-norm MLP block with a residual and dropout."""

    def __init__(self, width: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.dropout(self.down(F.gelu(self.up(self.norm(x)))))


def blocks(dropout: float = 0.0, layers: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(dropout=dropout) for _ in range(layers)])


def _train(model: nn.Module, x: Tensor) -> Tensor:
    output = model(x)
    output.square().mean().backward()
    return output.detach()


class Recompiles(logging.Handler):
    """The reasons dynamo gives for each recompilation (its ``recompiles`` log), while in a ``with`` block."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.reasons.append(record.getMessage())

    def __enter__(self) -> "Recompiles":
        torch._logging.set_logs(recompiles=True)
        logging.getLogger("torch._dynamo").addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        logging.getLogger("torch._dynamo").removeHandler(self)
        torch._logging.set_logs()


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_matches_eager_and_compiles_once(checkpoint: str) -> None:
    counter = CompileCounterWithBackend("aot_eager")
    plain = blocks()
    piped = Pipe(copy.deepcopy(plain), chunks=3, checkpoint=checkpoint, balance=[2, 2],
                 compile={"backend": counter})
    assert piped.compiled_layers == ["0", "1", "2", "3"]
    assert list(piped.state_dict()) == list(plain.state_dict())  # no _orig_mod. in the keys
    # Batch sizes 8 (3+3+2), 11 (4+4+3; 3+3+1 is avoided: size 1 specialises), 6 and 10, and new sequence
    # lengths: none of them may recompile for its shape. The two worker threads meet the block's variants
    # (pipe.compile lists them: grad mode, whether the input needs grad, a micro-batch at storage offset 0)
    # in an order that depends on timing, and dynamo itself sometimes recompiles when two threads check its
    # guards at once ("Unexpected recompilation: runtime guards failed even though they passed during
    # recompilation-reason analysis"), so what is checked is the reason of every recompilation.
    with Recompiles() as recompiles:
        for step, shape in enumerate([(8, 5, 16), (11, 5, 16), (6, 5, 16), (8, 9, 16), (10, 7, 16)]):
            x = torch.randn(*shape, generator=torch.Generator().manual_seed(step))
            piped.zero_grad()
            plain.zero_grad()
            torch.testing.assert_close(_train(piped, x), _train(plain, x))
            assert_same_grads(piped, plain, atol=1e-5, rtol=1.3e-6)
    by_shape = [reason for reason in recompiles.reasons if re.search(r"size mismatch|stride mismatch", reason)]
    assert not by_shape, f"recompiled for a shape: {by_shape}"
    # A graph per shape would compile at least 5 per variant met; the variants alone are 8 at most.
    assert 1 <= counter.frame_count <= 12, (f"{counter.frame_count} graphs for 5 shapes: {recompiles.reasons}")


def test_checkpoint_replays_dropout_exactly() -> None:
    # One partition, so the random draws come in one order: a checkpointed step and one that keeps its
    # activations draw the same masks, and the recomputation must draw them again.
    counter = CompileCounterWithBackend("aot_eager")
    model = blocks(dropout=0.25)
    grads = {}
    for checkpoint in ("never", "always"):
        piped = Pipe(copy.deepcopy(model), chunks=4, checkpoint=checkpoint, balance=[4],
                     compile={"backend": counter})
        x = torch.randn(10, 3, 16, generator=torch.Generator().manual_seed(1))
        torch.manual_seed(7)
        _train(piped, x)
        grads[checkpoint] = {name: p.grad for name, p in piped.named_parameters()}
    for name, grad in grads["never"].items():
        torch.testing.assert_close(grads["always"][name], grad, msg=lambda m: f"{name}: {m}")


def test_tied_weights() -> None:
    model = tied_model()
    reference = copy.deepcopy(model)
    piped = Pipe(model, chunks=4, checkpoint="except_last", balance=[2, 3], compile={"backend": "aot_eager"})
    assert len(list(piped.parameters())) == len(list(reference.parameters()))
    x = torch.randint(0, VOCAB, (8, 5), generator=torch.Generator().manual_seed(0))
    loss = piped(x).logsumexp(-1).mean()
    expected = reference(x).logsumexp(-1).mean()
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    assert_same_grads(piped, reference, atol=1e-5, rtol=1.3e-6)


@pytest.mark.slow
def test_split_gpt2_compiles_each_layer_once_whatever_the_depth() -> None:
    """A stage of pipe.split compiles its outlined layers, not the whole stage: alike layers share one class and
    one compile, so a model twice as deep compiles as many graphs."""
    pytest.importorskip("transformers")
    frames = {}
    for layers in (2, 4):
        torch.manual_seed(0)
        model = gpt2(layers=layers)
        ids, mask, labels = lm_batch(8, 8)
        stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False},
                            at=[f"transformer.h.{layers // 2}"])
        reference = copy.deepcopy(model)
        counter = CompileCounterWithBackend("aot_eager")
        piped = Pipe(stages, chunks=4, checkpoint="except_last", balance=[1, 1], compile={"backend": counter})
        assert piped.compiled_layers == [f"{name}.{block.path}" for name, stage in stages.named_children()
                                         for block in blocks_of(stage)]
        assert f"1.transformer.h.{layers - 1}" in piped.compiled_layers
        for step in range(2):
            ids, mask, labels = lm_batch(8, 8, seed=step)
            model.zero_grad()
            reference.zero_grad()
            assert_same_lm_step(piped, model, reference, ids, mask, labels)
            if step == 0:
                first = counter.frame_count
        assert counter.frame_count == first  # the second step compiles nothing
        frames[layers] = first
    assert frames[4] == frames[2], frames
    # unit="stage": each stage as one graph (what compile= did before), as exact.
    torch.manual_seed(0)
    model = gpt2(layers=4)
    ids, mask, labels = lm_batch(8, 8)
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=["transformer.h.2"])
    reference = copy.deepcopy(model)
    piped = Pipe(stages, chunks=4, checkpoint="except_last", balance=[1, 1],
                 compile={"backend": "aot_eager", "unit": "stage"})
    assert piped.compiled_layers == ["0", "1"]
    assert_same_lm_step(piped, model, reference, ids, mask, labels)


class Breaks(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        torch._dynamo.graph_break()
        return x * 2


def test_errors_name_the_layer_and_the_fix() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Breaks())
    piped = Pipe(model, chunks=2, balance=[1, 1], compile={"backend": "aot_eager", "fullgraph": True})
    with pytest.raises(CompileError, match=r"layer '1' \(Breaks\).*fullgraph': False"):
        piped(torch.randn(4, 4))
    # Without fullgraph, dynamo runs the break eagerly: the right numbers, two graphs.
    model = nn.Sequential(nn.Linear(4, 4), Breaks())
    piped = Pipe(copy.deepcopy(model), chunks=2, balance=[1, 1], compile={"backend": "aot_eager"})
    x = torch.randn(4, 4)
    torch.testing.assert_close(piped(x), model(x))
    excluded = Pipe(copy.deepcopy(model), balance=[1, 1], compile={"backend": "aot_eager", "exclude": ["1"]})
    assert excluded.compiled_layers == ["0"] and compiled_layers(excluded) == ["0"]
    with pytest.raises(ValueError, match="unknown keys.*'fulgraph'"):
        verify_compile({"fulgraph": True})
    with pytest.raises(TypeError, match="compile must be True, False or a dict"):
        Pipe(nn.Sequential(nn.Linear(2, 2)), compile="yes")
    with pytest.raises(TypeError, match=r"compile\['fullgraph'\] must be True or False"):
        verify_compile({"fullgraph": 1})
    with pytest.raises(ValueError, match=r"compile\['unit'\] must be one of \('block', 'stage'\).*'layer'"):
        verify_compile({"unit": "layer"})
    # Tensor-parallel stages compile with static shapes: torch 2.13 fails on DTensors with symbolic ones.
    assert verify_compile({"backend": "aot_eager"})["dynamic"] is True  # type: ignore[index]
    assert verify_compile({"backend": "aot_eager"}, tensor_parallel=True)["dynamic"] is False  # type: ignore[index]
    with pytest.raises(ValueError, match=r"compile=\{'dynamic': True\} fails on tensor-parallel stages"):
        verify_compile({"backend": "aot_eager", "dynamic": True}, tensor_parallel=True)


def test_a_torch_older_than_2_13_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen on torch 2.11 (a GPU machine's image): concurrent compiles crashed, no recompile_limit=, and the
    # I/W split failed on compiled blocks' autograd nodes.
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(RuntimeError, match=r"compile= needs torch >= 2.13 \(this is torch 2.11.0\+cu130\).*"
                                           r"upgrade torch, or pass compile=False"):
        Pipe(blocks(layers=2), chunks=2, balance=[1, 1], compile=True)
    assert verify_compile(False) is None  # eager needs nothing


def test_inductor_without_a_compiler_and_skippable_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    from pathlib import Path

    import pipe.compile

    monkeypatch.setattr(pipe.compile, "_has_cxx_compiler", lambda: True)
    # torch.compile takes a mode or options: a mode becomes its options, random ops stay eager's.
    options = verify_compile({"mode": "max-autotune-no-cudagraphs"})
    assert options is not None and options["mode"] is None
    assert options["options"]["max_autotune"] and options["options"]["fallback_random"]
    monkeypatch.setattr(pipe.compile, "_has_cxx_compiler", lambda: False)
    with pytest.raises(ValueError, match=r"needs a C\+\+ compiler.*compile=\{'backend': 'aot_eager'\}"):
        Pipe(nn.Sequential(nn.Linear(2, 2)), compile=True)
    sys.path.insert(0, str(Path(__file__).parent / "skip"))
    from models import PopLinear, StashLinear

    model = nn.Sequential(StashLinear(4), nn.Linear(4, 4), PopLinear(4))
    with pytest.warns(UserWarning, match="layer '0' is @skippable"):
        piped = Pipe(copy.deepcopy(model), chunks=2, balance=[2, 1], compile={"backend": "aot_eager"})
    assert piped.compiled_layers == ["1"]
    x = torch.randn(4, 4)
    torch.testing.assert_close(piped(x), model(x))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor needs a C++ compiler on the CPU")
def test_inductor() -> None:
    plain = blocks(layers=2)
    piped = Pipe(copy.deepcopy(plain), chunks=2, checkpoint="never", balance=[1, 1], compile=True)
    for size in (6, 5):
        x = torch.randn(size, 3, 16, generator=torch.Generator().manual_seed(size))
        piped.zero_grad()
        plain.zero_grad()
        torch.testing.assert_close(_train(piped, x), _train(plain, x))
        assert_same_grads(piped, plain, atol=1e-5, rtol=1e-5)


def test_split_backward_over_compiled_blocks_runs_each_backward_once() -> None:
    from pipe.core.iw_backward import IWBackward

    plain = blocks(layers=2)
    compiled = copy.deepcopy(plain)
    Pipe(compiled, balance=[2], compile={"backend": "aot_eager"})  # compiles compiled's layers in place
    x = torch.randn(6, 3, 16, generator=torch.Generator().manual_seed(0))
    expected_input = x.clone().requires_grad_()
    plain(expected_input).square().mean().backward()
    leaf = x.clone().requires_grad_()
    output = compiled(leaf)
    loss = output.square().mean()
    split = IWBackward([loss], None, [leaf], list(compiled.parameters()))
    nodes = []  # the compiled blocks' nodes, and how often each runs its backward
    walk = [loss.grad_fn]
    while walk:
        node = walk.pop()
        if type(node).__name__ == "CompiledFunctionBackward":
            nodes.append(node)
        walk += [child for child, _ in node.next_functions if child is not None]
    runs = {node: 0 for node in nodes}
    for node in nodes:
        node.register_prehook(lambda grads, node=node: runs.__setitem__(node, runs[node] + 1))
    assert len(nodes) == 2
    (input_grad,) = split.backward_input()
    assert set(runs.values()) == {1}
    split.backward_weight()
    assert set(runs.values()) == {1}, "W ran a compiled block's backward again"
    torch.testing.assert_close(input_grad, expected_input.grad)
    assert_same_grads(compiled, plain, atol=1e-5, rtol=1.3e-6)
