"""``DistributedPipe`` does what ``Pipe`` does: the recompute/swap config per stage, offload in stages, deferred BatchNorm.

Each rank checks against the plain module itself (loss, every gradient of its
layers, running statistics, counted kept bytes) and returns plain values.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipe.core.schedule import Schedule
from pipe.distributed import DistributedPipe, make_mesh
from pipe.recompute import ActivationMemory, parse_config, policy_of
from pipe.recompute.attach import apply_strategy
from spawn_ranks import run_ranks
from torchrun_launch import aborted_at_exit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recompute"))
from recompute_models import blocks  # noqa: E402  (the recompute tests' transformer blocks)

SCHEDULES = ("gpipe", "1f1b", "interleaved")
D, T = 8, 6

# MindFormers' per-stage form: one count per pipeline rank (dealt over a rank's chunks when interleaved).
CONFIG_2 = {"recompute_config": {"recompute": [1, 0], "select_recompute": {r"mlp\.act": [0, 2]}}}
CONFIG_4 = {"recompute_config": {"recompute": [1, 0, 2, 0], "select_recompute": {r"mlp\.act": [0, 2, 0, 1]}}}
SWAP = {"swap_config": {"swap": True, "min_bytes": 0, "checkpoint_swap": {"backward_prefetch": 1},
                        "layer_swap": [{"backward_prefetch": 2, "layers": [1, 3]}],
                        "op_swap": [{"op_name": "mlp", "backward_prefetch": 1, "layers": [2]}]}}


# -- the config's per-rank forms, without processes ---------------------------------------------------


def _counts(value: Any, stages: list[int], ranks: Optional[int]) -> list[int]:
    strategy = parse_config({"recompute": value}, stages, ranks=ranks)
    return [sum(l.recompute for l in strategy.layers if l.stage == s) for s in range(len(stages))]


def test_per_rank_counts_are_dealt_over_the_chunks_as_mindformers_does() -> None:
    # 2 ranks x 2 chunks, 2 layers per stage; stage s on rank s % 2. Rank 0's 3 layers: chunk 0, chunk 1, chunk 0.
    assert _counts([3, 1], [2, 2, 2, 2], ranks=2) == [2, 1, 1, 0]
    assert _counts([True, 0], [2, 2, 2, 2], ranks=2) == [2, 0, 2, 0]
    # A full chunk is skipped: rank 0 has stages of 1 and 3 layers.
    assert _counts([3, 0], [1, 2, 3, 2], ranks=2) == [1, 0, 2, 0]
    # One count per stage (chunk-major) and the 2D [chunk][rank] form say the same.
    assert _counts([2, 0, 1, 0], [2, 2, 2, 2], ranks=2) == [2, 0, 1, 0]
    assert _counts([[2, 0], [1, 0]], [2, 2, 2, 2], ranks=2) == [2, 0, 1, 0]
    # Without virtual stages a rank is a stage: per rank = per stage.
    assert _counts([1, 2], [2, 2], ranks=2) == [1, 2]
    # The normalised config (per stage) reads back the same.
    strategy = parse_config({"recompute": [3, 1]}, [2, 2, 2, 2], ranks=2)
    again = parse_config(strategy.to_config(), [2, 2, 2, 2], ranks=2)
    assert [l.recompute for l in again.layers] == [l.recompute for l in strategy.layers]


@pytest.mark.parametrize("value, match", [
    ([1, 0, 0], r"recompute = \[1, 0, 0\] gives 3 per-stage counts but there are 4 stages .* one count per "
                r"pipeline rank \(2\)"),
    ([5, 0], r"recompute\[0\] = 5 but pipeline rank 0 has only 4 layers \(stages \[0, 2\]"),
    ([[1, 0, 0], [0, 0, 0]], r"rows of \[3, 3\] counts but the pipeline has 2 virtual stages \(chunks\) of 2 ranks"),
])
def test_per_rank_errors_name_the_value_and_the_fix(value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_config({"recompute": value}, [2, 2, 2, 2], ranks=2)


# -- the config on ranks, against the plain module ----------------------------------------------------


def _data(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, T, D, generator=generator), torch.randn(size, T, D, generator=generator)


def _check_grads(pipe: DistributedPipe, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                 loss: Optional[torch.Tensor], label: str) -> None:
    plain = copy.deepcopy(model)
    expected = F.mse_loss(plain(x), y)
    expected.backward()
    grads = {name: p.grad for name, p in plain.named_parameters()}
    if pipe.is_last:
        assert loss is not None
        torch.testing.assert_close(loss, expected.detach(), msg=lambda m: f"{label}: loss\n{m}")
    for name, parameter in pipe.named_parameters():
        assert parameter.grad is not None, f"{label}: {name} has no gradient"
        torch.testing.assert_close(parameter.grad, grads[name], msg=lambda m: f"{label}: {name}\n{m}")


def _stage_inputs(model: nn.Sequential, balance: list[int], stage: int, x: torch.Tensor, chunks: int
                  ) -> list[torch.Tensor]:
    """What the plain model gives stage ``stage`` for each micro-batch."""
    start = sum(balance[:stage])
    with torch.no_grad():
        return [model[:start](part) for part in x.chunk(chunks)]


def _kept_bytes(layers: nn.Sequential, inputs: list[torch.Tensor]) -> int:
    """Bytes the layers keep for backward over all the micro-batch inputs, once selective plans are made."""
    kept = 0
    for x in inputs:
        for attempt in range(3):  # a selective layer plans in its first call, its narrowed regions in the second
            source = x.detach().requires_grad_()
            with ActivationMemory() as memory:
                out = layers(source)
                if attempt == 2:
                    kept += memory.live_bytes
            del out
    return kept


def _measured_kept(pipe: DistributedPipe, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes alive on this rank when its first backward starts (gpipe: after every forward), second step,
    less what a checkpointed cell recomputed ahead of its gradient (without offload it does; with, it does not)."""
    from pipe.core.checkpoint import Checkpointing
    from pipe.core.lowering import Kind

    runtime = pipe._runtime
    originals = (runtime.executors[Kind.BACKWARD], Checkpointing.recompute_ahead)
    for _ in range(2):  # the first step plans the selective layers
        seen: list[int] = []
        recomputed = [0]
        pipe.zero_grad(set_to_none=True)
        with ActivationMemory() as memory:
            def backward(*args: Any, **kwargs: Any) -> None:
                seen.append(memory.live_bytes - recomputed[0])
                originals[0](*args, **kwargs)

            def recompute_ahead(record: Checkpointing) -> None:
                before = memory.live_bytes
                originals[1](record)
                recomputed[0] += memory.live_bytes - before

            runtime.executors[Kind.BACKWARD] = backward
            Checkpointing.recompute_ahead = recompute_ahead  # type: ignore[method-assign]
            try:
                pipe.step(x, y, F.mse_loss)
            finally:
                runtime.executors[Kind.BACKWARD] = originals[0]
                Checkpointing.recompute_ahead = originals[1]  # type: ignore[method-assign]
    return seen[0]


def _config_on_ranks(rank: int, world: int) -> dict[str, Any]:
    """Every schedule, checkpoint='never': gradients, marks on own layers only, kept bytes per rank."""
    config = CONFIG_2 if world == 2 else CONFIG_4
    layers = 4 if world == 2 else 8
    model = blocks(layers, D)
    x, y = _data(8, seed=world)
    report: dict[str, Any] = {}
    for schedule in SCHEDULES:
        virtual = 2 if schedule == "interleaved" else 1
        pipe = DistributedPipe(copy.deepcopy(model), chunks=world, checkpoint="never", schedule=schedule,
                               virtual_stages=virtual, loss_fn=F.mse_loss, recompute=config)
        strategy = pipe.recompute_strategy
        assert strategy is not None
        # The same normalisation as parse_config on the whole pipeline, with one count per rank.
        expected = parse_config(config, pipe.balance, ranks=world)
        assert strategy.to_config() == expected.to_config()
        owned = {name for name, _ in pipe.named_children()}
        for layer in strategy.layers:
            if layer.name in owned:
                marked = policy_of(pipe.get_submodule(layer.name))
                assert (marked is not None) == (layer.recompute or bool(layer.select)), (schedule, layer)
        for _ in range(2):
            pipe.zero_grad()
            loss = pipe.step(x, y)
            _check_grads(pipe, model, x, y, loss, f"{schedule} rank {rank}")
        report[schedule] = sorted((l.index, l.describe()) for l in strategy.layers if l.name in owned)
        if schedule == "gpipe":
            # Kept bytes: the pipeline's saving on this rank is the plain stage's saving on its micro-batches.
            plain = DistributedPipe(copy.deepcopy(model), chunks=world, checkpoint="never", schedule="gpipe")
            saved = _measured_kept(plain, x, y) - _measured_kept(pipe, x, y)
            stage = pipe.stages[0]
            start = sum(pipe.balance[:stage])
            inputs = _stage_inputs(model, pipe.balance, stage, x, world)
            bare = copy.deepcopy(model[start:start + pipe.balance[stage]])
            configured = copy.deepcopy(bare)
            apply_strategy(expected, dict(zip(range(start, start + len(configured)), configured)))
            expected_saving = _kept_bytes(bare, inputs) - _kept_bytes(configured, inputs)
            report["saved_bytes"] = saved
            report["expected_saved_bytes"] = expected_saving
    return report


@pytest.mark.parametrize("world", [2, 4])
def test_config_per_stage_matches_plain_module_on_every_schedule(world: int) -> None:
    reports = run_ranks(_config_on_ranks, world, deadline=150.0)
    for rank, report in enumerate(reports):
        assert report["saved_bytes"] == report["expected_saved_bytes"], (rank, report)
    # Rank 0 recomputes one layer fully (the first of its first chunk), whatever the schedule.
    for schedule in SCHEDULES:
        assert reports[0][schedule][0] == (0, "full recompute"), reports[0][schedule]
    # Ranks with a full-recompute or selective count save memory; the others save nothing.
    assert reports[0]["saved_bytes"] > 0 and reports[1]["saved_bytes"] > 0
    if world == 4:
        assert reports[3]["saved_bytes"] > 0


def _errors(rank: int, world: int) -> list[str]:
    messages = []
    model = blocks(4, D)
    # Three per-stage counts for a 2-stage pipeline: Pipe's error, raised on every rank before any step.
    for bad in ({"recompute": [1, 0, 0]}, {"recompute": [3, 0]}):
        with pytest.raises(ValueError) as info:
            DistributedPipe(copy.deepcopy(model), chunks=2, recompute=bad)
        with pytest.raises(ValueError) as pipe_side:
            parse_config(bad, [2, 2])
        assert str(info.value) == str(pipe_side.value)
        messages.append(str(info.value))
    # Ranks given different configs fail together, naming the difference, instead of hanging.
    with pytest.raises(ValueError, match="ranks disagree on recompute"):
        DistributedPipe(copy.deepcopy(model), chunks=2, recompute={"recompute": [rank, 0]})
    return messages


def test_a_config_for_other_stages_fails_on_every_rank_with_pipes_error() -> None:
    first, second = run_ranks(_errors, 2)
    assert first == second
    assert "gives 3 per-stage counts but there are 2 stages" in first[0]
    assert "recompute[0] = 3 but stage 0 has only 2 layers" in first[1]


# -- offload in stages --------------------------------------------------------------------------------


def _expected_prefetch(program: list[str], cell: tuple[int, int], prefetch: int) -> Optional[str]:
    """The action at whose start the units of ``cell`` come back, or None (fetched when used)."""
    i, s = cell
    f, b = program.index(f"F{i}@{s}"), program.index(f"B{i}@{s}")
    if prefetch == 0:
        return None
    k = b - prefetch if b - prefetch > f else f + 1
    return program[k] if k < b else None


def _check_order(events: list[tuple[Any, ...]], program: list[str], prefetch_of: dict[str, int]) -> int:
    """Offload in the cell's forward, back at the action the schedule says, then used in its backward."""
    current = None
    where: dict[tuple[str, Any, str], str] = {}
    for event in events:
        if event[0] == "run":
            current = event[1]
            continue
        kind, cell, name = event
        key = (kind, cell, name)
        if kind == "offload":
            assert current == f"F{cell[0]}@{cell[1]}", (event, current)
        elif kind == "use":
            assert current == f"B{cell[0]}@{cell[1]}", (event, current)
        where.setdefault(key, current)
    checked = 0
    for (kind, cell, name), at in where.items():
        if kind != "offload":
            continue
        expected = _expected_prefetch(program, cell, prefetch_of[name])
        if expected is None:
            assert ("fetch", cell, name) in where and ("prefetch", cell, name) not in where, (cell, name)
        else:
            assert where.get(("prefetch", cell, name)) == expected, (cell, name, expected, where)
            assert ("fetch", cell, name) not in where
        assert ("use", cell, name) in where
        checked += 1
    return checked


def _swap_on_ranks(rank: int, world: int) -> dict[str, int]:
    """layer_swap, op_swap and checkpoint_swap: gradients, event order from the schedule, units released."""
    model = blocks(4 if world == 2 else 8, D)
    x, y = _data(8, seed=3)
    checked: dict[str, int] = {}
    for schedule in SCHEDULES:
        virtual = 2 if schedule == "interleaved" else 1
        pipe = DistributedPipe(copy.deepcopy(model), chunks=4, checkpoint="except_last", schedule=schedule,
                               virtual_stages=virtual, loss_fn=F.mse_loss, recompute=SWAP)
        swap = pipe._runtime.swap
        assert swap is not None
        swap.record_events = True
        prefetch_of = {f"stage {s} checkpoint": 1 for s in pipe.stages}
        prefetch_of.update({"layer 1 (1)": 2, "layer 3 (3)": 2, "layer 2 (2)": 1})
        program = [str(a) for a in Schedule(schedule, world, 4, virtual).actions(pipe.topology.pipeline_rank)]
        count = 0
        for _ in range(2):
            swap.events.clear()
            pipe.zero_grad()
            loss = pipe.step(x, y)
            _check_grads(pipe, model, x, y, loss, f"swap {schedule} rank {rank}")
            count += _check_order(swap.events, program, prefetch_of)
            for offloader in swap.offloaders():
                assert offloader.pending_units() == 0  # every host copy was used and let go
        boundary = [o for s, o in swap.checkpoint_offloaders.items() if s > 0]
        assert all(o.offloaded_bytes > 0 for o in boundary)
        checked[schedule] = count
    # The received input of a checkpointed cell is let go once its host copy is made: the CPU plays the device
    # (the host copy is not counted), so as the first backward (B3) starts the rank holds three micro-batches'
    # inputs less than without offload (B2's came back as B3 started: one action ahead), plus the one-element
    # stand-in per micro-batch that collects the input's gradient.
    boundary_only = {"swap_config": {"swap": True, "checkpoint_swap": True, "min_bytes": 0}}
    kept = [_measured_kept(DistributedPipe(copy.deepcopy(model), chunks=4, checkpoint="always", schedule="gpipe",
                                           recompute=config), x, y) for config in (None, boundary_only)]
    if pipe.stages[0] > 0:
        away = 3 * x.numel() * x.element_size() // 4  # 3 of the 4 inputs: the activations are as wide as x
        assert kept[1] - kept[0] == 4 * 4 - away, kept  # 4 micro-batches x one float32 stand-in
    else:
        assert kept[1] == kept[0]  # stage 0's inputs are the caller's: not offloaded
    return checked


@pytest.mark.parametrize("world", [2, 4])
def test_offload_follows_the_schedule(world: int) -> None:
    results = run_ranks(_swap_on_ranks, world, deadline=150.0)
    for result in results:
        assert all(count > 0 for count in result.values()), results


def test_a_checkpointed_cell_lets_its_received_input_go() -> None:
    """The tap: the runner keeps a one-element stand-in, the graph keeps nothing of the received leaf."""
    import gc
    import weakref

    from pipe.core.checkpoint import cell
    from pipe.core.microbatch import Batch
    from pipe.distributed.recompute_ranks import RankSwap
    from pipe.recompute import Offloader

    layer = nn.Linear(D, D)
    received = torch.randn(4, D, requires_grad=True)
    expected = torch.autograd.grad(torch.tanh(layer(received)).sum(), received)[0]
    offloader = Offloader(1, min_bytes=0, prefetch_on_use=False)
    storage = weakref.ref(received.untyped_storage())
    batch, kept = RankSwap.tap(Batch(received))
    del received
    compute, finalize, _ = cell(lambda b: Batch(torch.tanh(layer(b.value))), batch, True, (0, 1), offloader.hooks())
    del batch
    output = compute()
    finalize(output)
    gc.collect()
    assert storage() is None  # only the host copy remains
    output.value.sum().backward()
    torch.testing.assert_close(kept.tensors[0].grad, expected)
    assert kept.tensors[0].untyped_storage().nbytes() == 4


def test_the_caller_prefetches_by_tag_and_distance() -> None:
    """Offloader(prefetch_on_use=False): nothing comes back by itself; prefetch(tag, distance) brings a cell's units."""
    from pipe.recompute import Offloader

    offloader = Offloader(1, min_bytes=0, prefetch_on_use=False, record_events=True)
    layer = nn.Sequential(nn.Linear(D, D), nn.Tanh())
    outputs = {}
    for tag, far in (("a", 2), ("b", 1)):
        with offloader.tagged(tag), offloader.unit(tag, backward_prefetch=far):
            outputs[tag] = layer(torch.randn(3, D, requires_grad=True))
    offloader.prefetch("a", 2)   # a's prefetch distance is 2: due
    offloader.prefetch("b", 2)   # b's is 1: not yet
    assert offloader.events == [("offload", 0), ("offload", 1), ("prefetch", 0)]
    outputs["b"].sum().backward()  # b fetched when used; a is not prefetched by the neighbour rule
    outputs["a"].sum().backward()
    assert offloader.events[3:] == [("fetch", 1), ("use", 1), ("use", 0)]
    assert offloader.pending_units() == 0


# At module level: the ranks of CUDA tests are spawned (a fork cannot use CUDA once the parent has).
def _offload_on_cuda(rank: int, world: int) -> bool:
    device = torch.device("cuda", 0)
    model = blocks(4, D)
    x, y = _data(8, seed=5)
    pipe = DistributedPipe(copy.deepcopy(model), chunks=2, checkpoint="except_last", schedule="gpipe",
                           loss_fn=F.mse_loss, recompute=SWAP, device=device)
    loss = pipe.step(x.to(device), y.to(device))
    plain = copy.deepcopy(model).to(device)
    expected = F.mse_loss(plain(x.to(device)), y.to(device))
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    swap = pipe._runtime.swap
    assert swap is not None and any(o.offloaded_bytes for o in swap.offloaders())
    return all(s.device.type == "cuda" for o in swap.offloaders() for s in o._streams.values() if s is not None)


def _pinned_on_cuda(rank: int, world: int) -> list[bool]:
    device = torch.device("cuda", 0)
    x, y = _data(8, seed=5)
    pipe = DistributedPipe(blocks(4, D), chunks=2, checkpoint="never", schedule="gpipe", loss_fn=F.mse_loss,
                           recompute=SWAP, device=device)
    swap = pipe._runtime.swap
    assert swap is not None
    seen: list[bool] = []
    for offloader in swap.offloaders():
        def watch(kind: str, name: str, tag: Any, offloader: Any = offloader) -> None:
            if kind == "offload":  # the host copies of every unit alive now
                for unit in offloader._units.values():
                    seen.extend(ref().host.is_pinned() for ref in unit.stored if ref() is not None)
        offloader.observer = watch
    pipe.step(x.to(device), y.to(device))
    return seen


@pytest.mark.cuda
def test_offload_on_cuda_uses_pinned_memory_and_gives_the_same_gradients() -> None:
    assert run_ranks(_offload_on_cuda, 1) == [True]
    host = run_ranks(_pinned_on_cuda, 1)[0]
    assert host and all(host)


# -- deferred BatchNorm -------------------------------------------------------------------------------


def _bn_model() -> nn.Sequential:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Tanh(), nn.Linear(D, D),
                         nn.BatchNorm1d(D, momentum=None), nn.Tanh(), nn.Linear(D, D))


def _plain_statistics(statistics: nn.Sequential, plain: nn.Sequential, x: torch.Tensor, chunks: int) -> None:
    """Updates ``statistics``' BatchNorms as nn.BatchNorm does on the whole mini-batch of what each one sees.

    Each BatchNorm sees the micro-batches of its input (normalised upstream per
    micro-batch, as in any pipeline); the plain layer is given all of them at once.
    """
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [module.register_forward_pre_hook(lambda m, args, name=name: seen.setdefault(name, []).append(args[0]))
             for name, module in plain.named_modules() if isinstance(module, nn.BatchNorm1d)]
    with torch.no_grad():
        for part in x.chunk(chunks):
            plain(part)
        for hook in hooks:
            hook.remove()
        for name, inputs in seen.items():
            statistics.get_submodule(name)(torch.cat(inputs))


def _bn_on_ranks(rank: int, world: int) -> list[str]:
    """Running statistics equal the plain model's on the whole mini-batch (replica's part with data parallel)."""
    model = _bn_model()
    generator = torch.Generator().manual_seed(4)
    x, y = torch.randn(24, D, generator=generator), torch.randn(24, D, generator=generator)
    cases = [("gpipe", 1, 1), ("1f1b", 1, 1), ("interleaved", 2, 1)] if world == 2 else \
        [("1f1b", 1, 1), ("gpipe", 1, 2), ("interleaved", 2, 2)]
    done = []
    meshes: dict[int, Any] = {}  # replicas -> the mesh (made once per process: its groups stay)
    for schedule, virtual, replicas in cases:
        if replicas > 1 and replicas not in meshes:
            meshes[replicas] = make_mesh(pp=world // replicas, dp_replicate=replicas)
        for checkpoint in ("except_last", "never"):
            # A layer factory on 4 ranks (its layers are converted as they are made), the Sequential elsewhere.
            factory = world == 4 and replicas == 1
            source: Any = (lambda i: copy.deepcopy(model[i])) if factory else copy.deepcopy(model)
            pipe = DistributedPipe(source, chunks=4, checkpoint=checkpoint, schedule=schedule,
                                   layers=len(model) if factory else None, virtual_stages=virtual,
                                   mesh=meshes.get(replicas), loss_fn=F.mse_loss, deferred_batch_norm=True)
            share = 24 // replicas
            rows = slice(pipe.topology.replica * share, (pipe.topology.replica + 1) * share)
            statistics, plain = copy.deepcopy(model), copy.deepcopy(model)
            for step in range(3):  # momentum=None: a cumulative average, so the step count matters too
                pipe.zero_grad()
                loss = pipe.step(x[rows] + step, y[rows])
                _plain_statistics(statistics, plain, x[rows] + step, chunks=4)
            label = f"{schedule}/{checkpoint}/{replicas} replicas"
            expected_state = statistics.state_dict()
            for name, value in pipe.state_dict().items():
                if "running" in name or "num_batches" in name:
                    torch.testing.assert_close(value, expected_state[name], msg=lambda m: f"{label}: {name}\n{m}")
            # Gradients of the last step: each micro-batch is normalised with its own statistics, as in Pipe.
            if replicas == 1:
                parts = list(zip((x[rows] + 2).chunk(4), y[rows].chunk(4)))
                expected = sum(F.mse_loss(plain(a), b) * len(a) / share for a, b in parts)
                assert isinstance(expected, torch.Tensor)
                expected.backward()
                if pipe.is_last:
                    torch.testing.assert_close(loss, expected.detach(), msg=lambda m: f"{label}: loss\n{m}")
                grads = dict(plain.named_parameters())
                for name, parameter in pipe.named_parameters():
                    torch.testing.assert_close(parameter.grad, grads[name].grad, msg=lambda m: f"{label}: {name}")
            # Evaluation uses the running statistics, as the plain model does, and leaves them alone.
            pipe.eval()
            output = pipe(x[rows])
            statistics.eval()
            if pipe.is_last:
                torch.testing.assert_close(output, statistics(x[rows]).detach(), msg=lambda m: f"{label}: eval\n{m}")
            for name, value in pipe.state_dict().items():
                torch.testing.assert_close(value, expected_state[name], msg=lambda m: f"{label}: eval {name}\n{m}")
            done.append(label)
    return done


@pytest.mark.parametrize("world", [2, 4])
def test_deferred_batch_norm_matches_plain_module_on_the_mini_batch(world: int) -> None:
    results = run_ranks(_bn_on_ranks, world, deadline=150.0)
    assert all(len(r) == 6 for r in results)


def test_deferred_batch_norm_is_checked_across_ranks() -> None:
    with pytest.raises(TypeError, match="deferred_batch_norm must be True or False"):
        DistributedPipe(_bn_model(), deferred_batch_norm="yes")  # type: ignore[arg-type]


# -- the example --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_distributed_example_takes_the_recompute_yaml() -> None:
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, NPROC="2", THREADS="1", CUDA_VISIBLE_DEVICES="",  # the CPU path, as on CI
               PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    command = ["bash", "launch/single_node.sh", "examples/transformer_lm_distributed.py", "--steps", "2", "--layers",
               "4", "--width", "32", "--seq-len", "16", "--batch-size", "8", "--eval-batches", "1", "--checkpoint",
               "never", "--recompute", "examples/recompute.yaml", "--memory"]
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=80, start_new_session=True)
    out = proc.stdout + proc.stderr
    if aborted_at_exit(proc.returncode, out, "done: 2 steps"):  # the example's work is what this test checks
        proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=80,
                              start_new_session=True)
        out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "rank 0 (stages [0]): layer 0 (stage 0, 0): select_recompute" in out
    saved = [line for line in out.splitlines() if line.startswith("memory: rank")]
    assert len(saved) == 2 and all("(saved -" not in line and "(saved 0," not in line for line in saved), saved
    assert "done: 2 steps" in out


def _zero_bubble_refuses_checkpoint_swap(rank: int, world: int) -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    config = {"swap_config": {"swap": True, "checkpoint_swap": {"backward_prefetch": 1}}}
    with pytest.raises(ValueError, match="checkpoint_swap is not supported with schedule='zb-h1'"):
        DistributedPipe(model, chunks=2, checkpoint="always", schedule="zb-h1", recompute=config)


def test_zero_bubble_refuses_checkpoint_swap_on_every_rank() -> None:
    run_ranks(_zero_bubble_refuses_checkpoint_swap, 2)
