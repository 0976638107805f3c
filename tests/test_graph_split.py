"""pipe.split against the plain model: outputs, every gradient, state-dict keys both ways, and the errors."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipe
from pipe import Pipe, PipeSequential
from pipe.graph_split import SplitError, SplitStage
from helpers import assert_same_grads
from split_models import TinyLM, assert_same_state, lm_batch, lm_loss


@pytest.fixture(scope="module")
def tiny() -> tuple[TinyLM, nn.Sequential]:
    torch.manual_seed(0)
    model = TinyLM()
    ids, mask, _ = lm_batch()
    return model, pipe.split(model, (ids, mask), at=["blocks.1", "norm"])


def assert_same_step(stages: nn.Module, model: nn.Module, reference: nn.Module, ids: torch.Tensor,
                     mask: torch.Tensor, labels: torch.Tensor) -> None:
    """The split ``stages`` of ``model`` give ``reference``'s loss and every gradient, to the last bit."""
    model.zero_grad()
    reference.zero_grad()
    loss = lm_loss(stages(ids, mask), labels)
    expected = lm_loss(reference(ids, mask), labels)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    loss.backward()
    expected.backward()
    assert_same_grads(model, reference, atol=0, rtol=0)


def test_split_returns_stages_that_compute_the_plain_model(tiny: tuple[TinyLM, nn.Sequential]) -> None:
    model, stages = tiny
    assert isinstance(stages, PipeSequential) and len(stages) == 3
    assert all(isinstance(stage, SplitStage) for stage in stages)
    reference = copy.deepcopy(model)
    # Other batch sizes and lengths than the example's: both dimensions were captured as dynamic.
    for size, length, seed in ((4, 8, 1), (3, 6, 2), (1, 5, 3)):
        ids, mask, labels = lm_batch(size, length, seed)
        assert_same_step(stages, model, reference, ids, mask, labels)


def test_stages_are_the_models_parameters_under_their_original_keys(tiny: tuple[TinyLM, nn.Sequential]) -> None:
    model, stages = tiny
    # The tied weight: in the first stage (embedding) and the last (head), the same object.
    first = dict(stages[0].named_parameters())
    last = dict(stages[2].named_parameters())
    assert any(p is model.embed.weight for p in first.values())
    assert any(p is model.embed.weight for p in last.values())
    assert list(stages.state_dict()) == list(model.state_dict())  # "embed.weight" and "head.weight", once each


def test_checkpoints_move_between_split_and_original_model(tiny: tuple[TinyLM, nn.Sequential]) -> None:
    model, stages = tiny
    torch.manual_seed(5)
    other = TinyLM()
    stages.load_state_dict(other.state_dict())  # original -> split (strict)
    assert_same_state(model, other, atol=0, rtol=0)
    assert model.head.weight is model.embed.weight  # still tied
    fresh = TinyLM()
    fresh.load_state_dict(stages.state_dict())  # split -> original (strict)
    assert_same_state(fresh, other, atol=0, rtol=0)
    stages.load_state_dict(stages.state_dict())  # its own form


def test_pipe_state_dict_has_the_original_keys() -> None:
    """Stages that pass one tensor run in Pipe as they are; Pipe's state dict is the original model's."""

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 8)
            self.mid = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
            self.out = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.mid(torch.relu(self.inp(x))))

    torch.manual_seed(0)
    model = Mlp()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 4)
    piped = Pipe(pipe.split(model, (x,), at=["mid", "out"]), chunks=4, balance=[2, 1], devices=["cpu", "cpu"])
    assert list(piped.state_dict()) == list(reference.state_dict())
    piped.load_state_dict(reference.state_dict())
    piped(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert_same_grads(model, reference, atol=1e-6, rtol=1e-5)
    piped.close()


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 4])
def test_tied_lm_through_pipe_over_several_steps(checkpoint: str, chunks: int) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    ids, mask, labels = lm_batch(8, 8)
    stages = pipe.split(model, (ids, mask), at=["blocks.2"])
    piped = Pipe(stages, chunks=chunks, checkpoint=checkpoint, balance=[1, 1], devices=["cpu", "cpu"])
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    expected_optimizer = torch.optim.Adam(reference.parameters(), lr=0.05)
    for step in range(3):
        ids, mask, labels = lm_batch(8, 8, seed=step)
        optimizer.zero_grad()
        expected_optimizer.zero_grad()
        loss = lm_loss(piped(ids, mask), labels)
        expected = lm_loss(reference(ids, mask), labels)
        torch.testing.assert_close(loss, expected)
        loss.backward()
        expected.backward()
        assert_same_grads(model, reference, atol=1e-6, rtol=1e-5)
        optimizer.step()
        expected_optimizer.step()
    assert_same_state(model, reference, atol=1e-5, rtol=1e-4)
    assert model.head.weight is model.embed.weight
    piped.close()


def test_dropout_captured_in_training_follows_the_mode_and_batch_norm_is_refused_in_the_other() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    x = torch.randn(8, 4)
    stages = pipe.split(model, (x,), at=["2"])
    assert not any(stage.mode_dependent for stage in stages)
    torch.manual_seed(1)
    trained = stages(x)
    torch.manual_seed(1)
    torch.testing.assert_close(trained, model(x), atol=0, rtol=0)  # the same mask: the same op, the same RNG
    stages.eval()
    model.eval()
    torch.testing.assert_close(stages(x), model(x), atol=0, rtol=0)  # no dropout in eval
    assert not torch.equal(stages(x), trained)
    # Captured in eval mode, dropout keeps its eval behaviour: training is refused (p may not be in the graph).
    evaluation = pipe.split(model, (x,), at=["2"])
    evaluation.train()
    with pytest.raises(RuntimeError, match=r"captured in eval mode.*split model.train\(\) again"):
        evaluation(x)
    # Batch norm's statistics stay as captured: refused in the other mode, with the documented fix.
    normed = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).train()
    stages = pipe.split(normed, (x,), at=["2"])
    stages.eval()
    with pytest.raises(RuntimeError, match=r"captured in training mode.*split model.eval\(\) again"):
        stages(x)
    again = pipe.split(normed.eval(), (x,), at=["2"])  # the documented fix
    torch.testing.assert_close(again(torch.ones(2, 4)), normed(torch.ones(2, 4)))


def test_attention_dropout_captured_in_training_is_off_in_eval() -> None:
    """HF passes scaled_dot_product_attention ``dropout=p`` in training, 0 in eval; captured in training, the graph
    held ``dropout_p=p``, and an eval of the split model kept dropping attention weights (no error)."""
    pytest.importorskip("transformers")
    from split_models import llama

    torch.manual_seed(0)
    model = llama(layers=2).train()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    ids, mask, _ = lm_batch(4, 8)
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=["model.layers.1"])
    torch.manual_seed(1)
    trained = stages(ids, mask)
    torch.manual_seed(1)
    torch.testing.assert_close(trained, model(ids, attention_mask=mask).logits)
    stages.eval()
    model.eval()
    torch.testing.assert_close(stages(ids, mask), model(ids, attention_mask=mask).logits)
    assert not torch.allclose(stages(ids, mask), trained)


def test_bad_cut_points_are_named() -> None:
    model = TinyLM()
    ids, mask, _ = lm_batch()
    with pytest.raises(ValueError, match=r"has no such submodule.*named_modules"):
        pipe.split(model, (ids, mask), at=["blocks.7"])
    with pytest.raises(ValueError, match=r"at is empty"):
        pipe.split(model, (ids, mask), at=[])
    with pytest.raises(TypeError, match=r"list of module paths"):
        pipe.split(model, (ids, mask), at="norm")
    with pytest.raises(ValueError, match=r"lists a module twice"):
        pipe.split(model, (ids, mask), at=["norm", "norm"])


def test_an_example_batch_of_one_row_is_refused_before_the_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.export would fix dim 0 at 1 and the first step with micro-batches of 2 would fail in the first stage
    # (the next stage waiting out its receive timeout): refused at once, before anything is captured.
    captured = []
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: captured.append(a) or pytest.fail("captured"))
    model = TinyLM()
    ids, mask, _ = lm_batch(1, 8)
    with pytest.raises(ValueError, match=r"example batch has 1 row \(example_args\[0\] has shape \[1, 8\]\).*"
                                         r"at least 2 rows, e\.g\. torch\.zeros\(2, 8, dtype=torch\.int64\)"):
        pipe.split(model, (ids, mask), at=["norm"])
    with pytest.raises(ValueError, match=r"example_args\[0\] has shape \[1, 8\].*torch\.zeros\(2, 8, "
                                         r"dtype=torch\.int64, device='meta'\)"):
        pipe.split(model, ids.to("meta"), {"mask": mask.to("meta")}, at=["norm"])
    assert not captured


def test_a_model_on_meta_is_captured_with_its_example_inputs_on_meta(monkeypatch: pytest.MonkeyPatch) -> None:
    # Examples on the CPU beside a model built on meta: torch 2.11's export refuses the two devices, so the
    # examples go to meta (only shapes and dtypes are captured). Materialised on the CPU, the stages compute the
    # plain model, with no meta device left in their graphs.
    devices = []
    export = torch.export.export

    def recording(module, args, kwargs=None, **options):  # noqa: ANN001, ANN202: stands for torch.export.export
        devices.extend(t.device.type for t in torch.utils._pytree.tree_leaves((args, kwargs))
                       if isinstance(t, torch.Tensor))
        return export(module, args, kwargs, **options)

    monkeypatch.setattr(torch.export, "export", recording)
    torch.manual_seed(0)
    reference = TinyLM()
    with torch.device("meta"):
        model = TinyLM()
    ids, mask, _ = lm_batch()
    stages = pipe.split(model, (ids, mask), at=["blocks.1"])
    assert devices and set(devices) == {"meta"}, devices
    assert ids.device.type == "cpu" and mask.device.type == "cpu"  # the caller's tensors are left alone
    stages.to_empty(device="cpu")
    stages.load_state_dict(reference.state_dict())
    assert all("device(type='meta')" not in stage.code for stage in stages)
    with torch.no_grad():
        torch.testing.assert_close(stages(ids, mask), reference(ids, mask), rtol=0, atol=0)


def test_inputs_whose_dim_0_is_no_batch_are_captured() -> None:
    # A 0-d tensor has no batch dimension, and a tensor of one row beside a batch of 4 is not split (a NoChunk):
    # neither makes the example a batch of 1.
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, bias: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x) + bias) * scale

    torch.manual_seed(0)
    model = Scaled()
    bias, scale = torch.randn(1, 4), torch.tensor(0.5)
    stages = pipe.split(model, (torch.randn(4, 4), bias, scale), at=["b"])
    for rows in (1, 3):
        x = torch.randn(rows, 4)
        torch.testing.assert_close(stages(x, bias, scale), model(x, bias, scale), rtol=0, atol=0)


def test_static_sizes_are_captured_as_given_and_other_shapes_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # dynamic=False: torch.export is asked for static sizes (no symbolic size to reason about, the fast capture),
    # the graphs hold only ints, and each stage refuses an input of another shape, naming it, where the graph's
    # constant sizes would fail deep inside or broadcast. A batch of 1 row is an example like any other then.
    asked = []
    export = torch.export.export

    def recording(module, args, kwargs=None, **options):  # noqa: ANN001, ANN202: stands for torch.export.export
        asked.append(options["dynamic_shapes"])
        return export(module, args, kwargs, **options)

    monkeypatch.setattr(torch.export, "export", recording)
    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    for size in (1, 3):
        ids, mask, labels = lm_batch(size, 6, seed=size)
        stages = pipe.split(model, (ids, mask), at=["blocks.1", "norm"], dynamic=False)
        dims = torch.utils._pytree.tree_leaves(asked.pop())
        assert dims and all(dim is torch.export.Dim.STATIC for dim in dims), dims
        assert stages[0].static_shapes == ((size, 6), (size, 6))
        for stage in stages:
            for node in stage.graph.nodes:
                value = node.meta.get("val")
                if isinstance(value, torch.Tensor):
                    assert all(isinstance(n, int) for n in value.shape), (node, value.shape)
        assert_same_step(stages, model, reference, ids, mask, labels)
        ids, mask, _ = lm_batch(size + 1, 6)
        with pytest.raises(ValueError, match=rf"captured at static sizes .*input 0 must have shape \[{size}, 6\], "
                                             rf"got \[{size + 1}, 6\].*one micro-batch.*dynamic=True"):
            stages(ids, mask)
        assert copy.deepcopy(stages)[1].static_shapes == stages[1].static_shapes
    with pytest.raises(TypeError, match=r"dynamic must be True or False, got 'no'"):
        pipe.split(model, (ids, mask), at=["norm"], dynamic="no")


def test_the_planner_measures_a_static_split_at_its_one_micro_batch_only() -> None:
    # The planner times each layer at every chunk count's micro-batch; pieces captured at static sizes run at one.
    from pipe.plan import profile_costs

    torch.manual_seed(0)
    ids, mask, _ = lm_batch(8, 6)
    pieces = pipe.split(TinyLM(), (ids[:2], mask[:2]), at=["blocks.1", "norm"], dynamic=False)
    with pytest.raises(ValueError, match=r"micro-batches of \[8, 4, 2\] rows \(chunks=\[1, 2, 4\] of the batch of 8\).*"
                                         r"static sizes.*micro-batches of 2 rows.*dynamic=True.*chunks=\[4\] alone"):
        profile_costs(pieces, (ids, mask), (1, 2, 4), rounds=1)
    costs = profile_costs(pieces, (ids, mask), (4,), rounds=1)
    assert list(costs.forward) == [2] and len(costs.forward[2]) == 3  # the micro-batch of 2 rows, 3 pieces


def test_a_cut_point_that_runs_twice_is_refused() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(self.b(x)))

    with pytest.raises(ValueError, match=r"module 'b' ran 2 times"):
        pipe.split(Twice(), (torch.randn(4, 4),), at=["b"])


def test_data_dependent_control_flow_points_at_the_docs() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.a(x)
            if x.sum() > 0:  # depends on the values
                x = -x
            return self.b(x)

    with pytest.raises(SplitError, match=r"docs/split.md.*What cannot be split"):
        pipe.split(Branchy(), (torch.randn(4, 4),), at=["b"])


def test_moving_a_stage_points_captured_device_arguments_at_its_device() -> None:
    """torch.export bakes ``arange(device=cpu)`` into the graph; a stage moved elsewhere must create tensors there."""
    torch.manual_seed(0)
    model = TinyLM()
    ids, mask, _ = lm_batch()
    stages = pipe.split(model, (ids, mask), at=["blocks.1"])
    assert "device(type='cpu')" in stages[0].code
    stages[0].to("meta")  # any other device: the graph's device arguments follow the parameters
    assert "device(type='cpu')" not in stages[0].code and "device(type='meta')" in stages[0].code


def test_tied_split_model_on_two_devices_keeps_one_weight_and_the_original_keys() -> None:
    """"cpu" and "cpu:0" are two devices to Pipe: the head's partition uses a per-forward copy of the embedding."""
    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    ids, mask, labels = lm_batch(8, 8)
    piped = Pipe(pipe.split(model, (ids, mask), at=["norm"]), chunks=4, balance=[1, 1], devices=["cpu", "cpu:0"])
    assert list(piped.state_dict()) == list(reference.state_dict())
    assert len(list(piped.parameters())) == len(list(reference.parameters()))
    lm_loss(piped(ids, mask), labels).backward()
    lm_loss(reference(ids, mask), labels).backward()
    assert_same_grads(model, reference, atol=1e-6, rtol=1e-5)
    other = TinyLM()
    piped.load_state_dict(other.state_dict())
    assert_same_state(model, other, atol=0, rtol=0)
    piped.close()


class TableLM(nn.Module):
    """Two linears, then a table made from a buffer and the positions added (like LLaMA's rotary cos)."""

    def __init__(self, persistent: bool, written: bool) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("freq", torch.arange(1.0, 5.0), persistent=persistent)
        self.written = written

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], dtype=torch.float32)
        table = torch.cos(positions[:, None] * self.freq)  # [s, 4]
        if self.written:
            self.freq.mul_(1.0)  # an in-place write: the buffer is state, not a constant
        hidden = self.second(self.first(ids.float().unsqueeze(-1).expand(-1, -1, 4)))
        return hidden + table + (ids > 0).unsqueeze(-1)  # ids enter the second stage, as a mask's would


@pytest.mark.parametrize("persistent,written,remade", [(False, False, True), (True, False, False),
                                                       (False, True, False)])
def test_a_table_made_from_a_constant_buffer_is_made_again_not_sent(persistent: bool, written: bool,
                                                                    remade: bool) -> None:
    # Made again only from a buffer outside the state dict (a checkpoint could change a saved one in one
    # stage only) that nothing writes. Of several stages using it, the later ones hold a copy (see the
    # LLaMA test in test_split_real_models.py).
    torch.manual_seed(0)
    model = TableLM(persistent, written)
    ids = torch.randint(0, 5, (2, 3))
    stages = pipe.split(model, (ids,), at=["second"])
    received = [tuple(n.meta["val"].shape) for n in stages[1].graph.nodes if n.op == "placeholder"]
    assert (len(received) == 2) == remade, received  # ids and the hidden state, or the table too
    holds = "freq" in dict(stages[1].named_buffers())
    assert holds == remade
    if remade:  # only the second stage uses the table now: it holds the model's buffer itself
        assert stages[1].get_buffer("freq") is model.freq and "freq" not in dict(stages[0].named_buffers())
    torch.testing.assert_close(stages(ids), model(ids), rtol=0, atol=0)


def test_device_arguments_in_nested_graphs_follow_the_stage_s_tensors() -> None:
    # torch.export (2.11) puts a higher-order op's body (a LLaMA's rotary embedding under wrap_with_autocast) in
    # a submodule graph of its own; captured on meta, its device arguments must follow the stage's tensors too
    # (found on a GPU: "_assert_tensor_metadata ... Expected: meta, Got: cuda:0").
    import torch.fx as fx

    from pipe.split_stage import retarget_devices

    class Inner(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.arange(x.size(0), device=torch.device("meta"))

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))
            self.inner = fx.symbolic_trace(Inner())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x * self.weight)

    outer = fx.symbolic_trace(Outer())
    outer.inner = fx.symbolic_trace(Inner())  # kept as a submodule graph, as export keeps a HOP's body
    retarget_devices(outer)
    devices = [n.kwargs["device"] for n in outer.inner.graph.nodes if "device" in n.kwargs]
    assert devices == [torch.device("cpu")]
    torch.testing.assert_close(outer.inner(torch.zeros(3)), torch.arange(3.0))
