"""FSDP2-sharded stages on (pp 2, dp_shard 2) and replicas on (pp 2, dp_replicate 2) against the plain model.

One process launch runs many configurations (4 processes on 2 cores are
slow to start): every schedule, ZeRO-3 and ZeRO-2, both checkpoint modes,
tied embeddings sharded on the first and last stage, skips, ``loss_reduction="count"``,
a ``recompute=`` config and gradient clipping. Each is compared with the plain
model on one process on the global batch: the loss of every step, every
gradient gathered to a full tensor, and the weights after 3 AdamW steps. The
all-gathers and reduce-scatters of each step are counted by wrapping the
collectives FSDP calls.
"""
from __future__ import annotations

import copy
import inspect
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import pipe.distributed as pd
from dist_models import skip_model
from spawn_ranks import run_ranks

VOCAB, WIDTH, SEQ, ROWS = 11, 8, 3, 8  # global batch: 8 sequences of 3 tokens


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)

    def forward(self, ids: Tensor) -> Tensor:
        return self.embedding(ids)


class Mix(nn.Module):
    """A pre-norm residual MLP block, as in a transformer."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.norm(x))


def lm(tied: bool) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(Embed(), *[Mix() for _ in range(6)], Head())
    if tied:
        model[7].out.weight = model[0].embedding.weight  # the embedding is the LM head
    return model


def tokens(seed: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    return ids, torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)


def padded(seed: int) -> tuple[Tensor, Tensor]:
    ids, target = tokens(seed)
    target[1::3, -1] = -100  # padding: ignored by the loss, so "count" differs from a mean of means
    return ids, target


def ce(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def ce_count(output: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    total = F.cross_entropy(output.flatten(0, 1), target.flatten(), reduction="sum")
    return total, (target != -100).sum()


def _full(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


# The single-tensor collectives FSDP calls: torch 2.13's names, or torch 2.11's.
GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


class Collectives:
    """Counts FSDP's all-gathers and reduce-scatters (torch.distributed's single-tensor collectives)."""

    def __init__(self) -> None:
        self.counts = {"all_gather": 0, "reduce_scatter": 0}
        self._saved = (getattr(dist, GATHER), getattr(dist, SCATTER))

    def __enter__(self) -> "Collectives":
        gather, scatter = self._saved

        def counted(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                self.counts[kind] += 1
                return fn(*args, **kwargs)
            return call

        setattr(dist, GATHER, counted("all_gather", gather))
        setattr(dist, SCATTER, counted("reduce_scatter", scatter))
        return self

    def __exit__(self, *exc: Any) -> None:
        setattr(dist, GATHER, self._saved[0])
        setattr(dist, SCATTER, self._saved[1])


def _compare(model: pd.DistributedPipe, plain: nn.Sequential, label: str, *, tied: bool = False,
             loss_fn: Callable[..., Any] = ce, reduction: str = "mean", clip: Optional[float] = None,
             inputs: Optional[Callable[[int], tuple[Tensor, Tensor]]] = None) -> tuple[int, int]:
    """3 AdamW steps of ``model`` and of ``plain`` on the same global batches; returns step 1's collectives."""
    make = inputs or tokens
    parts, part = model.topology.data_parallel, model.topology.replica
    rows = slice(part * ROWS // parts, (part + 1) * ROWS // parts)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    reference = torch.optim.AdamW(plain.parameters(), lr=0.01)
    named = dict(plain.named_parameters(remove_duplicate=False))
    counts = (0, 0)
    for step in range(3):
        x, y = make(step)
        with Collectives() as collectives:
            loss = model.step(x[rows], y[rows], loss_fn, broadcast_loss=True)
        if step == 0:
            counts = (collectives.counts["all_gather"], collectives.counts["reduce_scatter"])
        out = plain(x)
        if reduction == "count":
            total, count = ce_count(out, y)
            expected = total / count
        else:
            expected = loss_fn(out, y)
        expected.backward()
        assert loss is not None
        torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{label}: loss of step {step}\n{m}")
        if clip is not None:
            norm = model.clip_grad_norm_(clip)
            expected_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), clip)
            torch.testing.assert_close(norm, expected_norm, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{label}: gradient norm\n{m}")
        for name, param in model.named_parameters():
            assert param.grad is not None, f"{label}: {name} has no gradient"
            torch.testing.assert_close(_full(param.grad), named[name].grad, atol=1e-5, rtol=1e-4,
                                       msg=lambda m: f"{label}: gradient of {name}, step {step}\n{m}")
            # Both optimizers step on the same gradients: AdamW turns their rounding into lr-sized weight
            # differences on some CPUs (tests/distributed/decoder.py's train_against says why).
            named[name].grad.copy_(_full(param.grad))
        optimizer.step()
        reference.step()
        optimizer.zero_grad()
        reference.zero_grad()
    for name, param in model.named_parameters():
        torch.testing.assert_close(_full(param.detach()), named[name].detach(), atol=1e-5, rtol=1e-4,
                                   msg=lambda m: f"{label}: {name} after 3 AdamW steps\n{m}")
    if tied and model.is_first:
        assert model._tied.counts(model.get_parameter("0.embedding.weight")), label
    return counts


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("looped-bfs", 2), ("zbv", 2)]


def _sharded(rank: int, world: int) -> dict[str, Any]:
    mesh = pd.make_mesh(pp=2, dp_shard=2)
    report: dict[str, Any] = {}
    for schedule, virtual in SCHEDULES:
        for raf, checkpoint in ((True, "always"), (False, "except_last")):
            tied = schedule != "zbv"  # ZB-V puts the first and last stage on one rank (refused with FSDP)
            plain = lm(tied)
            model = pd.DistributedPipe(copy.deepcopy(plain), chunks=2, checkpoint=checkpoint, schedule=schedule,
                                       virtual_stages=virtual, mesh=mesh,
                                       shard=pd.Shard(reshard_after_forward=raf, unit="stage"))
            label = f"{schedule} zero{3 if raf else 2} {checkpoint}"
            report[label] = _compare(model, plain, label, tied=tied)
    # Loss over the tokens that count, a recompute config, gradient clipping across pp and shard ranks.
    plain = lm(True)
    model = pd.DistributedPipe(copy.deepcopy(plain), chunks=2, checkpoint="never", mesh=mesh,
                               loss_reduction="count", recompute={"recompute_config": {"recompute": [2, 1]}})
    report["count+recompute+clip"] = _compare(model, plain, "count", tied=True, loss_fn=ce_count,
                                              reduction="count", clip=0.5, inputs=padded)
    # Skips between stages, on sharded stages.
    skips = skip_model(1, 4, 6)
    model = pd.DistributedPipe(copy.deepcopy(skips), chunks=2, schedule="gpipe", mesh=mesh)

    def floats(seed: int) -> tuple[Tensor, Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(ROWS, 6, generator=generator), torch.randn(ROWS, 6, generator=generator)

    report["skips"] = _compare(model, skips, "skips", loss_fn=F.mse_loss, inputs=floats)
    # Two stages of one rank sharing a weight: FSDP cannot shard it twice, said at once.
    try:
        pd.DistributedPipe(lm(True), chunks=2, schedule="zbv", mesh=mesh)
        report["zbv tied"] = "no error"
    except ValueError as error:
        report["zbv tied"] = str(error)
    return report


@pytest.mark.timeout(280)
def test_sharded_pipeline_matches_the_plain_model_under_every_schedule() -> None:
    results = run_ranks(_sharded, 4, deadline=260.0, timeout=60.0)
    for rank, report in enumerate(results):
        for schedule, virtual in SCHEDULES:
            # 8 layers: 4 per rank in 1 or 2 stages; each layer is one FSDP group (the stages hold no
            # parameters of their own). ZeRO-2 gathers and reduce-scatters each group once per step.
            assert report[f"{schedule} zero2 except_last"] == (4, 4), (rank, schedule, report)
            gathers, scatters = report[f"{schedule} zero3 always"]
            assert scatters == 4, (rank, schedule, report)
            if virtual == 1:
                assert gathers == 4, (rank, schedule, report)
        # One stage per rank gathers once; two stages: every switch between them gathers again under ZeRO-3.
        # Looped BFS and interleaved with 2 micro-batches on 2 ranks: stage runs F F | F F B B | B B -> 3 runs
        # of 2 groups (rank 1 in interleaved: F F | F B F B | B B, also 3).
        assert report["looped-bfs zero3 always"][0] == 6, report
        assert report["interleaved zero3 always"][0] == 6, report
        assert report["zbv zero3 always"][0] >= 4, report
        # Shard()'s default under ZeRO-3 with 1F1B: each of the rank's 4 layers gathered around each of its 2
        # forwards and 2 backwards (16), but where a layer stays gathered from one action to the next: the last
        # layer from F1 into B0 on ranks 0 and 1 (F0 F1 B0 B1), and on the last stage's ranks 2 and 3 (F0 B0 F1
        # B1) from each forward into its backward and the first layer from B0 into F1 (13); its gradients
        # reduce-scattered once a step (4).
        assert report["count+recompute+clip"] == (15 if rank < 2 else 13, 4), (rank, report)
        # Skips on the default unit: each of the rank's 3 layers reduce-scattered once a step, gathered around each
        # forward, recomputation and backward of its own (how many depends on where FSDP keeps the last layer
        # gathered into its backward: 14 or 16 here), not once a step as a stage whole would be (3).
        gathers, scatters = report["skips"]
        assert scatters == 3 and gathers > 3, report
        assert "tied weight '0.embedding.weight' of stages [0, 3] on pipeline rank 0 is held by two stages" \
            in report["zbv tied"], report
    print({k: v for k, v in results[0].items() if k != "zbv tied"})


def _replicas(rank: int, world: int) -> list[str]:
    """(pp 2, dp_replicate 2) through the mesh, HSDP on (pp 1, dp_replicate 2, dp_shard 2), mixed precision."""
    checked = []
    for mesh, label in ((pd.make_mesh(pp=2, dp_replicate=2), "replicas"),
                        (pd.make_mesh(pp=1, dp_replicate=2, dp_shard=2), "hsdp")):
        plain = lm(False)
        model = pd.DistributedPipe(copy.deepcopy(plain), chunks=2, schedule="1f1b", mesh=mesh)
        _compare(model, plain, label, clip=0.5)
        checked.append(f"{label}:{model.topology.pipeline_rank}/{model.topology.replica}")
    # FSDP's mixed precision: bfloat16 compute and gathers, float32 reduction; within bfloat16's tolerance.
    plain = lm(True)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = pd.DistributedPipe(copy.deepcopy(plain), chunks=2, mesh=pd.make_mesh(pp=2, dp_shard=2),
                               shard=pd.Shard(mp_policy=policy))
    x, y = tokens(0)
    rows = slice(model.topology.replica * 4, model.topology.replica * 4 + 4)
    loss = model.step(x[rows], y[rows], ce, broadcast_loss=True)
    expected = ce(plain(x), y)
    expected.backward()
    assert loss is not None and abs(float(loss) - float(expected)) < 2e-2, (loss, expected)
    named = dict(plain.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.dtype == torch.float32, name
        error = (_full(param.grad) - named[name].grad).abs().max() / named[name].grad.abs().max()
        assert error < 5e-2, (name, float(error))
    checked.append("bf16")
    return checked


@pytest.mark.timeout(200)
def test_replicas_hsdp_and_mixed_precision_match_the_plain_model() -> None:
    results = run_ranks(_replicas, 4, deadline=180.0, timeout=60.0)
    assert results == [["replicas:0/0", "hsdp:0/0", "bf16"], ["replicas:0/1", "hsdp:0/1", "bf16"],
                       ["replicas:1/0", "hsdp:0/2", "bf16"], ["replicas:1/1", "hsdp:0/3", "bf16"]]


def _lm_sum_count(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """A causal LM's summed next-token loss and its token count (padding is -100)."""
    flat_labels = labels[:, 1:].reshape(-1)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), flat_labels, reduction="sum"), \
        (flat_labels != -100).sum()


def _split_lm_against_plain(piped: pd.DistributedPipe, reference: nn.Module, label: str,
                            first: dict[str, float]) -> list[int]:
    """3 AdamW steps of a split HF language model at (pp 2, dp_shard 2) against the plain model on the global
    batch (8 padded rows; each replica takes its 4): the loss, every gradient (step 0 within ``first``, later
    steps within 1e-5 / 1e-4, from weights AdamW's rounding moved apart) and the weights after. Returns each
    step's reduce-scatters."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from split_models import lm_batch

    lm_sum_count = _lm_sum_count
    optimizer = torch.optim.AdamW(piped.parameters(), lr=0.01)
    expected_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    part = slice(piped.topology.replica * 4, piped.topology.replica * 4 + 4)
    scatters = []
    for step in range(3):
        ids, mask, labels = lm_batch(8, 8, seed=step)
        with Collectives() as collectives:
            loss = piped.step((ids[part], mask[part]), labels[part], lm_sum_count, broadcast_loss=True)
        scatters.append(collectives.counts["reduce_scatter"])
        total, counted = lm_sum_count(reference(ids, attention_mask=mask).logits, labels)
        (total / counted).backward()
        assert loss is not None
        torch.testing.assert_close(loss, (total / counted).detach(), atol=1e-5, rtol=1e-5)
        tolerance = first if step == 0 else dict(atol=1e-5, rtol=1e-4)
        for name, parameter in piped.named_parameters():
            assert parameter.grad is not None, name
            torch.testing.assert_close(_full(parameter.grad), reference.get_parameter(name).grad, **tolerance,
                                       msg=lambda m: f"{label}, step {step} {name}: {m}")
        optimizer.step()
        expected_optimizer.step()
        optimizer.zero_grad()
        expected_optimizer.zero_grad()
    # Adam normalises each gradient: the attention key bias, whose gradient is zero up to rounding (softmax
    # ignores a per-query constant), moves by rounding-sized steps scaled up, so weights get 1e-4 here.
    for name, parameter in piped.named_parameters():
        torch.testing.assert_close(_full(parameter.detach()), reference.get_parameter(name).detach(),
                                   atol=1e-4, rtol=1e-4, msg=lambda m: f"{label}, {name} after 3 AdamW steps: {m}")
    return scatters


def _gpt2(rank: int, world: int) -> float:
    """HuggingFace GPT-2 cut by pipe.split, sharded on (pp 2, dp_shard 2), tied embeddings, padded batches."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import pipe
    from split_models import gpt2, lm_batch

    torch.manual_seed(0)
    model = gpt2()
    reference = copy.deepcopy(model)
    ids, mask, _ = lm_batch(8, 8)
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=["transformer.h.1"])
    piped = pd.DistributedPipe(stages, chunks=2, checkpoint="except_last", schedule="1f1b",
                               mesh=pd.make_mesh(pp=2, dp_shard=2), loss_reduction="count")
    _split_lm_against_plain(piped, reference, "gpt2", first=dict(atol=1e-5, rtol=1e-4))
    return float(_full(model.get_input_embeddings().weight.detach()).sum())


def _in_place_on_the_output(rank: int, world: int, unit: str) -> list[str]:
    import warnings

    from decoder import decoder, full, lm_data, lm_loss

    def scaled_in_place(output: Tensor, target: Tensor) -> Tensor:  # FSDP warns this may skip its gather
        return lm_loss(output.mul_(2.0), target)

    plain = decoder(0)  # its head is a Linear with a bias: on (B, T, d) it returns a view
    named = dict(plain.named_parameters())
    x, y = lm_data(0, batch=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning shown, except what pipe filters after this
        model = pd.DistributedPipe(copy.deepcopy(plain), chunks=2, mesh=pd.make_mesh(pp=1, dp_shard=2),
                                   shard=pd.Shard(reshard_after_forward=True, unit=unit))
        loss = model.step(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2], scaled_in_place, broadcast_loss=True)
        warnings.warn("a module of the user's returned a view tensor")  # still shown: the filter is pipe's alone
    expected = scaled_in_place(plain(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for name, param in model.named_parameters():
        torch.testing.assert_close(full(param.grad), named[name].grad, atol=1e-6, rtol=1e-5, msg=name)
    return [str(w.message) for w in caught if "view tensor" in str(w.message)]


@pytest.mark.timeout(120)
def test_an_in_place_op_on_a_sharded_stage_s_output_is_exact_and_fsdp_s_view_warning_hidden_by_stage() -> None:
    # The head's Linear returns a view; FSDP warns that an in-place op on it skips its pre-backward gather.
    # With unit="stage" the runner gathers every stage before each of its actions and reduces explicitly, so it
    # cannot: the gradients equal the plain model's, and pipe hides the warning for the modules it wraps.
    shown = ["a module of the user's returned a view tensor"]
    assert run_ranks(_in_place_on_the_output, 2, "stage", deadline=100.0, timeout=30.0) == [shown, shown]
    # A layer at a time (the default) its own hooks gather each layer: FSDP's warning stays (here the head, the
    # last layer, is still gathered for its backward, and the gradients are exact).
    # (torch 2.11's FSDP2 has no such warning.)
    import torch.distributed.fsdp._fully_shard._fsdp_state as fsdp_state
    warns = "returned a view tensor" in inspect.getsource(fsdp_state)
    for seen in run_ranks(_in_place_on_the_output, 2, "block", deadline=100.0, timeout=30.0):
        assert seen[-1] == shown[0] and any(w.startswith("FSDP2-wrapped module (") for w in seen[:-1]) == warns, seen


@pytest.mark.timeout(280)
def test_split_gpt2_sharded_matches_the_plain_model() -> None:
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from split_models import gpt2

    gpt2()  # imports transformers' lazy modules once, here: the forked ranks inherit them
    results = run_ranks(_gpt2, 4, deadline=240.0, timeout=60.0)
    assert all(r == results[0] for r in results)  # the tied embedding equal on every rank and shard


def _llama_by_unit(rank: int, world: int, unit: str, schedule: str, at: list[str], reduce: str,
                   keep: bool, prefetch: bool = True) -> dict[str, Any]:
    """A tied HuggingFace LLaMA of 6 decoder layers cut by pipe.split at (pp 2, dp_shard 2), 3 layers a stage,
    ZeRO-3 gathering a stage whole or each layer on its own; against the plain model for 3 AdamW steps and a
    held-out loss (eval_step). Before each layer's forward (and its recomputation) the hook counts the stage's
    layers then gathered; FSDP's gathers and reshards of the layers, prefetches included, give the most layers
    gathered or being gathered at once."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import pipe
    from pipe.split_blocks import blocks_of
    from split_models import lm_batch, llama

    torch.manual_seed(0)
    model = llama(layers=6)
    if schedule == "zbv":  # ZB-V puts the first and the last stage on one rank: FSDP cannot shard a tie there
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    reference = copy.deepcopy(model)
    ids, mask, _ = lm_batch(8, 8)
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=at)
    refused = ""
    if schedule == "zbv":
        with pytest.raises(ValueError) as error:
            pd.DistributedPipe(copy.deepcopy(stages), chunks=2, schedule=schedule,
                               mesh=pd.make_mesh(pp=2, dp_shard=2), shard=pd.Shard(unit="block"))
        refused = str(error.value)
    piped = pd.DistributedPipe(stages, chunks=2, checkpoint="except_last", schedule=schedule,
                               mesh=pd.make_mesh(pp=2, dp_shard=2), loss_reduction="count",
                               shard=pd.Shard(unit=unit, reduce=reduce, reshard_after_backward=not keep,
                                              prefetch=prefetch))
    layers = [block for stage in piped.partitions.values() for block in blocks_of(stage)]
    live: set[int] = set()
    beside_a_buffer: list[bool] = []
    most = [0]
    head_gathers = [0]
    by_block: dict[str, int] = {}  # a block's path -> its gathers, prefetches included

    def gathers(unshard: Callable[..., Any]) -> Callable[..., Any]:
        def call(group: Any, *args: Any, **kwargs: Any) -> Any:
            idle = group._all_gather_result is None and not group.is_unsharded
            result = unshard(group, *args, **kwargs)
            if idle and group._all_gather_result is not None and any(m in layers for m in group.modules):
                # a gather started while another one's buffer is still held: three blocks' bytes at once
                beside_a_buffer.append(group.comm_ctx.all_gather_state is not None)
                live.add(id(group))
                most[0] = max(most[0], len(live))
                head_gathers[0] += any(getattr(m, "path", None) == "lm_head" for m in group.modules)
                for m in group.modules:
                    if m in layers:
                        by_block[m.path] = by_block.get(m.path, 0) + 1
            return result
        return call

    def reshards(reshard: Callable[..., Any]) -> Callable[..., Any]:
        def call(group: Any, *args: Any, **kwargs: Any) -> Any:
            result = reshard(group, *args, **kwargs)
            if not group.is_unsharded and group._all_gather_result is None:
                live.discard(id(group))
            return result
        return call

    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    FSDPParamGroup.unshard = gathers(FSDPParamGroup.unshard)  # type: ignore[method-assign]
    FSDPParamGroup.reshard = reshards(FSDPParamGroup.reshard)  # type: ignore[method-assign]
    in_layers = {id(p) for block in layers for p in block.parameters()}
    own_groups = sum(any(id(p) not in in_layers for p in stage.parameters()) for stage in piped.partitions.values())
    gathered: list[int] = []

    buffers_kept: list[bool] = []
    from pipe.distributed.fsdp import _IntoParameter, _param_groups

    written: dict[int, int] = {}  # a unit of one parameter -> where its last all-gather wrote
    gather = _IntoParameter.__call__

    def writes(comm: Any, output_tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        written[id(comm._param)] = output_tensor.data_ptr()
        return gather(comm, output_tensor, *args, **kwargs)

    _IntoParameter.__call__ = writes  # type: ignore[method-assign]
    head_in_place: list[bool] = []

    def count(module: nn.Module, args: Any) -> None:
        gathered.append(sum(not isinstance(next(b.parameters()), DTensor) for b in layers))
        if unit == "block":  # the gather's buffer is freed once copied out (FSDP2 keeps it for a GPU's streams)
            buffers_kept.append(module._get_fsdp_state()._comm_ctx.all_gather_state is not None)
        if unit == "block" and getattr(module, "path", None) == "lm_head":  # one parameter: gathered into it
            fsdp_param = _param_groups(module._get_fsdp_state())[0].fsdp_params[0]
            head_in_place.append(written.get(id(fsdp_param)) == next(module.parameters()).data_ptr())

    for block in layers:
        block.register_forward_pre_hook(count)

    scatters = _split_lm_against_plain(piped, reference, unit, first=dict(atol=1e-6, rtol=1e-5))
    trained_head_gathers = head_gathers[0]
    trained_gathers = dict(by_block)
    ids, mask, labels = lm_batch(8, 8, seed=7)  # and a held-out loss, forward only
    part = slice(piped.topology.replica * 4, piped.topology.replica * 4 + 4)
    held_out = piped.eval_step((ids[part], mask[part]), labels[part], _lm_sum_count, broadcast_loss=True)
    with torch.no_grad():
        total, counted = _lm_sum_count(reference(ids, attention_mask=mask).logits, labels)
    torch.testing.assert_close(held_out, total / counted, atol=1e-5, rtol=1e-5)
    return {"layers": [block.path for block in layers], "gathered": gathered, "refused": refused, "scatters": scatters,
            "most at once": most[0], "head gathers": trained_head_gathers, "gathers by block": trained_gathers, "buffers kept": any(buffers_kept),
            "own groups": own_groups, "head gathered in place": head_in_place,
            "gathers beside a buffer": sum(beside_a_buffer),
            "sharded after the step": all(isinstance(p, DTensor) for p in piped.parameters()),
            "bytes gathered after the step": sum(
                t.untyped_storage().nbytes() for m in piped.modules() if hasattr(m, "_get_fsdp_state")
                and m is not piped for group in _param_groups(m._get_fsdp_state()) for fsdp_param in group.fsdp_params
                for t in fsdp_param.all_gather_outputs)}


@pytest.mark.timeout(280)
@pytest.mark.parametrize("unit, schedule, reduce, keep, prefetch", [
    ("block", "1f1b", "step", False, True), ("block", "1f1b", "micro-batch", False, True),
    ("block", "1f1b", "step", True, True), ("block", "1f1b", "step", False, False),
    ("stage", "1f1b", "step", False, True), ("stage", "zbv", "step", False, True)])
def test_split_llama_gathered_by_layer_or_by_stage_matches_the_plain_model(unit: str, schedule: str, reduce: str,
                                                                           keep: bool, prefetch: bool) -> None:
    """Shard(unit="block"): each decoder layer of a split stage is an FSDP unit gathered by its own hooks, so at
    most two (this one and the prefetched next) are gathered when a layer runs; unit="stage" gathers all three,
    under ZB-V (two stages a rank) too, where unit="block" is refused (its backward is split in two).
    reduce="micro-batch" reduce-scatters each layer's gradients after each of its backwards: as exact.
    reshard_after_backward=False (keep) leaves each layer gathered from its first backward to the stage's
    reduce: the last stage's second forward (after its first backward, in 1F1B) finds all three gathered.
    prefetch=False gathers each layer only when it runs: never two layers gathered or being gathered at once
    (with FSDP's prefetch, the next one is). The head's backward finds it gathered by its forward; no block's
    gather buffer outlives its copy-out, and no gather starts beside another's buffer; the head, one parameter,
    is gathered into its own storage; nothing stays gathered after a step."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from split_models import llama

    llama()  # imports transformers' lazy modules once, here: the forked ranks inherit them
    at = ["model.layers.3"] if schedule == "1f1b" else ["model.layers.2", "model.layers.3", "model.layers.5"]
    results = run_ranks(_llama_by_unit, 4, unit, schedule, at, reduce, keep, prefetch, deadline=240.0,
                        timeout=60.0)
    # (pp 2, dp_shard 2): ranks 0 and 1 hold the first pipeline rank's stages, ranks 2 and 3 the second's; the
    # final norm and the head are modules of their own, and so is the embedding where it is untied (under ZB-V).
    tail = ["model.norm", "lm_head"]
    held = ([[f"model.layers.{k}" for k in range(3)], [f"model.layers.{k}" for k in range(3, 6)] + tail]
            if schedule == "1f1b" else
            [["model.embed_tokens"] + [f"model.layers.{k}" for k in (0, 1, 5)] + tail,
             [f"model.layers.{k}" for k in (2, 3, 4)]])
    for rank, result in enumerate(results):
        if schedule == "zbv":
            assert result["refused"].startswith("shard=Shard(unit='block') with schedule 'zbv', which splits each "
                                                "backward"), result["refused"]
        modules = result["layers"]
        assert sorted(modules) == sorted(held[rank // 2])
        assert result["sharded after the step"]
        assert result["bytes gathered after the step"] == 0  # no gather left in flight, or landed and not freed
        if schedule == "1f1b":  # 3 steps x 2 micro-batches, the checkpointed micro-batch's replay, eval's 2
            assert len(result["gathered"]) == (3 * 3 + 2) * len(modules)
        if unit == "block":
            if keep:  # the first pipeline rank runs no forward after a backward (F0 F1 B0 B1); the second's F1
                # (F0 B0 F1 B1) finds every layer of the stage kept gathered since B0
                assert (max(result["gathered"]) <= 2 if rank < 2 else max(result["gathered"]) == len(modules)), \
                    result["gathered"]
            else:
                assert max(result["gathered"]) <= 2 and min(result["gathered"]) >= 1, result["gathered"]
                # With FSDP's prefetch the next layer gathers while one runs (and one finishing its reshard):
                # 3 at once were seen; without, one.
                assert (result["most at once"] > 1) == prefetch and result["most at once"] >= 1, result["most at once"]
            # Per step: the stage's own group once (where it has parameters outside its modules: the tied
            # embedding's), and each module once or once per micro-batch (2).
            each = 2 if reduce == "micro-batch" else 1
            assert result["scatters"] == [result["own groups"] + each * len(modules)] * 3, result["scatters"]
            assert not result["buffers kept"]
            assert result["gathers beside a buffer"] == 0, result["gathers beside a buffer"]
            # The head, the loss stage's last block, stays gathered from a forward that builds a graph to its
            # backward. Per step: for the checkpointed micro-batch's forward and its replay, and for the other's
            # forward, never for a backward (3; 5 when each backward gathered it again; 4 when FSDP ordered the
            # backward prefetch by the interleaved forwards and gathered the head once more, for nothing); kept
            # from its first backward to the reduce, for the checkpointed forward and the replay (2; 4 before).
            # Each block is gathered once per forward, replay and backward (F0 F1 R0 B0 B1 on the first pipeline
            # rank, F0 R0 B0 F1 B1 on the second: 5 a step), but where it stays gathered from one to the next:
            # a stage's last block from a replay to its backward (the head from any forward that builds a graph),
            # the second rank's first block from B0 to F1 (reduce="step"), and, kept (reshard_after_backward
            # False), every block from its first backward on (the first rank's B1, the second's F1).
            stage = [f"model.layers.{k}" for k in range(3)] if rank < 2 else held[1]
            expected = {path: 5 - keep for path in stage}
            expected[stage[-1]] -= 1 if rank < 2 else 2
            if rank >= 2 and reduce == "step" and not keep:
                expected[stage[0]] -= 1
            assert result["gathers by block"] == {path: 3 * n for path, n in expected.items()}, \
                result["gathers by block"]
            if rank >= 2:
                # The head, one parameter, is gathered into its own storage: never held twice.
                assert result["head gathered in place"] and all(result["head gathered in place"])
                assert result["head gathers"] == 3 * (2 if keep else 3), result["head gathers"]
        elif schedule == "1f1b":  # the whole stage of the module that runs
            assert set(result["gathered"]) == {len(modules)}, result["gathered"]
        else:  # ZB-V: each stage whole, and the next one's prefetch: at times more than by block's bound of 2
            assert max(result["gathered"]) > 2, result["gathered"]


class _ReadsAHolder(nn.Module):
    """Calls two layers and reads a third module's weight (as a split stage reads its holders of weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.holder = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(self.first(x)) @ self.holder.weight


def test_the_modules_a_stage_calls_are_listed_in_the_order_it_calls_them() -> None:
    from torch import fx

    from pipe.distributed.fsdp import _called, _calls

    piece = fx.symbolic_trace(_ReadsAHolder())
    after = nn.Linear(2, 2)
    stage = nn.Sequential(piece, after)  # a stage that calls its layers, one of them a graph
    calls = _calls(stage)
    assert [id(m) for m in calls] == [id(piece), id(piece.first), id(piece.second), id(after)]
    assert [id(m) for m in _calls(piece)] == [id(piece.first), id(piece.second)]
    assert _called(stage, piece.second) and _called(stage, after) and _called(piece, piece.first)
    assert not _called(stage, piece.holder) and not _called(piece, piece.holder)  # only read: no hooks run
