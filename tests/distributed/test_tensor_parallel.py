"""Tensor-parallel stages on (pp 2, tp 2), 4 gloo ranks, against the plain decoder in each process.

Megatron's column/row split of the blocks, and torchtitan's sequence parallelism
(DTensor activations sharded on the sequence cross every stage boundary): the
loss, every gradient gathered to a full tensor, the gradient norm clipped over
pipeline and tensor-parallel ranks, and the weights after 3 AdamW steps.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel

from decoder import decoder, lm_data, lm_loss, tensor_parallel_plan, train_against
from pipe.distributed import DistributedPipe, make_mesh
from pipe.distributed.tensor_parallel import resolve_plan, verify_plan
from pipe.skip import pop, skippable, stash
from spawn_ranks import run_ranks

CASES = [  # (sequence parallel, schedule, checkpoint, recompute config, compiled)
    (False, "1f1b", "except_last", None, False),
    (False, "zbv", "except_last", None, False),  # split backward: DTensor weights' gradients in W
    (True, "gpipe", "always", None, False),
    (True, "interleaved", "except_last", None, False),  # a reduce-scatter's output leaves a stage of one layer
    (False, "1f1b", "never", {"recompute_config": {"recompute": [2, 1]}}, False),  # tensor-parallel blocks replayed
    (True, "1f1b", "never", {"recompute_config": {"select_recompute": {r"mlp\.fc": True}}}, False),  # per-op
    (True, "1f1b", "except_last", None, True),  # compiled tensor-parallel blocks (aot_eager: seconds)
]
if torch.torch_version.TorchVersion(torch.__version__) < "2.13":  # compile= is refused there
    CASES = [case for case in CASES if not case[-1]]


def _against_plain(sequence_parallel: bool, schedule: str, checkpoint: str,
                   recompute: Any = None, compiled: bool = False) -> dict[str, Any]:
    mesh = make_mesh(pp=2, tp=2)
    model = decoder(0)
    reference = copy.deepcopy(model)
    virtual = 2 if schedule in ("interleaved", "zbv") else 1
    piped = DistributedPipe(model, chunks=2, checkpoint=checkpoint, schedule=schedule, virtual_stages=virtual,
                            mesh=mesh, tensor_parallel=tensor_parallel_plan(sequence_parallel),
                            recompute=recompute,
                            compile={"backend": "aot_eager"} if compiled else False)
    arrived: list[type] = []  # what stage 1's first layer received
    if 1 in piped.partitions:
        piped.partitions[1][0].register_forward_pre_hook(lambda module, args: arrived.append(type(args[0])))
    trained = train_against(piped, reference, f"sequence_parallel={sequence_parallel} {schedule}", clip=0.5,
                            weights_atol=1e-6, batch=lambda step: 6 if step == 2 else 4)  # a new batch size:
    # its dimensions become dynamic when compiled
    return {"sharded": sorted(name for name, p in piped.named_parameters()
                              if isinstance(p, DTensor) and p.to_local().numel() < p.numel()),
            "arrived": sorted({t.__name__ for t in arrived}), "norm": trained["norm"]}


@skippable(stash=["embedded"])
class StashEmbedded(nn.Module):
    """Passes the residual stream on and stashes it (a sequence-sharded DTensor under sequence parallelism)."""

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        yield stash("embedded", x)
        return x


@skippable(pop=["embedded"])
class AddEmbedded(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        embedded = yield pop("embedded")
        return x + embedded


def _skip_across_stages() -> dict[str, Any]:
    """A skip that carries a sequence-sharded DTensor from stage 0 to stage 1, against the plain model."""
    model = decoder(0)  # embedding, 2 blocks, head
    model = nn.Sequential(model[0], StashEmbedded(), model[1], model[2], AddEmbedded(), model[3])
    reference = copy.deepcopy(model)
    piped = DistributedPipe(model, chunks=2, balance=[3, 3], schedule="1f1b", checkpoint="except_last",
                            mesh=make_mesh(pp=2, tp=2), tensor_parallel=tensor_parallel_plan(True))
    popped: list[type] = []
    if 1 in piped.partitions:
        piped.partitions[1][1].register_forward_hook(lambda module, args, out: popped.append(type(out)))
    train_against(piped, reference, "skip", steps=2)
    return {"popped": sorted({t.__name__ for t in popped})}


def _loss_parallel() -> dict[str, Any]:
    """torchtitan's loss parallelism: logits stay sharded on the vocabulary into the loss, under ``loss_parallel``."""
    plan = tensor_parallel_plan(True)
    plan["*.out"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    model = decoder(0)
    reference = copy.deepcopy(model)
    piped = DistributedPipe(model, chunks=2, schedule="1f1b", checkpoint="except_last", mesh=make_mesh(pp=2, tp=2),
                            tensor_parallel=plan)
    train_against(piped, reference, "loss parallel", steps=2, context=loss_parallel)
    x, y = lm_data(2)
    with loss_parallel():
        evaluated = piped.eval_step(x, y, lm_loss, broadcast_loss=True)
    torch.testing.assert_close(evaluated, lm_loss(reference(x), y).detach())
    # Without the context, torch's cross entropy meets a sharded DTensor: the error says what to do.
    try:
        piped.step(x, y, lm_loss, broadcast_loss=True)
        refused = "no error"
    except Exception as error:  # the last stage's rank raises the cause, the others name that rank
        refused = str(error)
    return {"head sharded": isinstance(piped.get_parameter("3.out.weight"), DTensor) if piped.is_last else None,
            "refused": refused}


def _tied_embedding_and_head(sequence_parallel: bool) -> float:
    """The embedding of stage 0 tied to the head of stage 1, both vocabulary-sharded: the largest error."""
    model = decoder(0)
    model[3].out.weight = model[0].tok.weight
    reference = copy.deepcopy(model)
    plan = dict(tensor_parallel_plan(sequence_parallel))
    if not sequence_parallel:
        plan["0.tok"] = RowwiseParallel(input_layouts=Replicate())
        plan["*.out"] = ColwiseParallel(output_layouts=Replicate())
    piped = DistributedPipe(model, chunks=2, schedule="1f1b", mesh=make_mesh(pp=2, tp=2), tensor_parallel=plan)
    return train_against(piped, reference, f"tied sp={sequence_parallel}")["worst"]


def _tensor_parallel_ranks(rank: int, world: int) -> list[dict[str, Any]]:
    results = [_against_plain(*case) for case in CASES]
    results.append(_loss_parallel())
    tied = {"sp": _tied_embedding_and_head(True), "no sp": _tied_embedding_and_head(False)}
    # A tie sharded on one stage and whole on the other cannot sum its gradients: refused on both holders.
    model = decoder(0)
    model[3].out.weight = model[0].tok.weight
    try:
        DistributedPipe(model, chunks=2, mesh=make_mesh(pp=2, tp=2),
                        tensor_parallel={"0.tok": RowwiseParallel(input_layouts=Replicate())})
        tied["mixed"] = "no error"
    except ValueError as error:
        tied["mixed"] = str(error)
    results.append(tied)
    results.append(_skip_across_stages())
    # A plan entry naming no module of any stage is refused on every rank, naming it.
    with pytest.raises(ValueError, match=r"tensor_parallel entry '\*\.attn\.qkv' matches no module of any stage"):
        DistributedPipe(decoder(0), chunks=2, mesh=make_mesh(pp=2, tp=2), tensor_parallel={"*.attn.qkv": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"tensor_parallel= needs a mesh with a 'tp' dimension"):
        DistributedPipe(decoder(0), chunks=2, mesh=make_mesh(pp=2, dp_shard=2),
                        tensor_parallel={"*.mlp.fc": ColwiseParallel()})
    return results


def test_tensor_parallel_stages_against_the_plain_model() -> None:
    results = run_ranks(_tensor_parallel_ranks, 4, deadline=240)
    for k, (sequence_parallel, schedule, _, _, _) in enumerate(CASES):
        case = [r[k] for r in results]
        # Both blocks' attention and MLP weights are tp shards on the ranks that hold them.
        sharded = set().union(*(r["sharded"] for r in case))
        assert {"1.attn.q.weight", "2.mlp.proj.weight", "2.attn.proj.weight"} <= sharded, (schedule, sharded)
        # Without sequence parallelism a plain tensor reaches stage 1; with it, a DTensor rebuilt on the receiver.
        arrived = {kind for r in case for kind in r["arrived"]}
        assert arrived == {"DTensor" if sequence_parallel else "Tensor"}, (schedule, arrived)
    for k in range(len(CASES)):
        assert len({r[k]["norm"] for r in results}) == 1  # the same on every rank
    for r in results:  # tied embedding and head, both vocabulary-sharded, exact; a mixed layout refused
        tied = r[-2]
        assert tied["sp"] <= 1e-5 and tied["no sp"] <= 1e-5, tied
        assert "the tied weight '0.tok.weight' is laid out differently on the ranks that hold it" in tied["mixed"], tied
    loss_parallel_results = [r[-3] for r in results]
    assert [r["head sharded"] for r in loss_parallel_results] == [None, None, True, True], loss_parallel_results
    for r in loss_parallel_results[2:]:  # the last stage's ranks compute the loss and name the fix
        assert "loss_fn got the last stage's output as a DTensor" in r["refused"], r
        assert "loss_parallel(): pipe.step(...)" in r["refused"], r
    # The skip's sum on stage 1 is a DTensor again: the stashed DTensor crossed as its shard and was rebuilt.
    assert {kind for r in results for kind in r[-1]["popped"]} == {"DTensor"}


def _refused_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    raise ValueError("this loss refuses every step")


def _after_a_failed_step(rank: int, world: int) -> dict[str, Any]:
    """A compiled tensor-parallel pipeline trains, a step fails (its groups shut down), then new pipelines on new
    meshes train: one eager (its DTensors on the new mesh's groups?), one compiled (its graphs recompiled?)."""
    compiled = {"backend": "aot_eager"}

    def pipeline(model: nn.Module, **options: Any) -> tuple[DistributedPipe, Any]:
        mesh = make_mesh(pp=2, tp=2)
        return DistributedPipe(model, chunks=2, mesh=mesh, tensor_parallel=tensor_parallel_plan(True), **options), mesh

    model = decoder(0)
    reference = copy.deepcopy(model)
    train_against(pipeline(model, compile=compiled)[0], reference, "before the failure", steps=1)
    failing, _ = pipeline(decoder(0))
    x, y = lm_data(0)
    try:
        failing.step(x, y, _refused_loss)
        failed = "no error"
    except Exception as error:  # the last stage's ranks raise it, the others name them
        failed = str(error)
    model = decoder(0)
    reference = copy.deepcopy(model)
    eager, mesh = pipeline(model)
    groups = {p.device_mesh.get_group().group_name for p in eager.parameters() if isinstance(p, DTensor)}
    worst = train_against(eager, reference, "eager after the failure", steps=2)["worst"]
    model = decoder(0)
    reference = copy.deepcopy(model)
    worst = max(worst, train_against(pipeline(model, compile=compiled)[0], reference, "compiled after the failure",
                                     steps=1)["worst"])
    return {"failed": failed, "groups": sorted(groups), "tp group": mesh.get_group("tp").group_name, "worst": worst}


@pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < "2.13", reason="compile= needs torch 2.13")
def test_a_tensor_parallel_pipeline_after_a_failed_step_trains_on_its_new_mesh() -> None:
    """Regression: after a failed step, the tensor-parallel pipelines built next in the process train.

    The failure shuts down the failed pipeline's connections (pipe.distributed.connections.abort). A new mesh
    of the same shape compares equal to the old one, and both DTensor's cached layouts and the graphs compiled
    for the old mesh used to put the new pipeline's collectives on the old groups: its first one failed with
    "Connection closed by peer" (pipe.distributed.mesh.forget_cached_meshes).
    """
    results = run_ranks(_after_a_failed_step, 4, deadline=240)
    for rank, r in enumerate(results):
        assert "this loss refuses every step" in r["failed"], (rank, r["failed"])
        assert r["groups"] == [r["tp group"]], (rank, r)  # every DTensor parameter on the new mesh's "tp" group
        assert r["worst"] <= 1e-5, (rank, r)


def test_plan_names_resolve_per_stage_and_overlaps_are_refused() -> None:
    stages = [decoder(0)[:2], decoder(0)[2:]]
    plan = tensor_parallel_plan(False)
    resolved = resolve_plan(plan, stages)
    assert sorted(resolved[0]) == ["1.attn.k", "1.attn.proj", "1.attn.q", "1.attn.v", "1.mlp.fc", "1.mlp.proj"]
    assert sorted(resolved[1])[0] == "2.attn.k"
    with pytest.raises(ValueError, match=r"entries '\*\.mlp\.fc' and '2\.mlp\.\*' both match module '2\.mlp\.fc'"):
        resolve_plan({"*.mlp.fc": ColwiseParallel(), "2.mlp.*": ColwiseParallel()}, stages)
    with pytest.raises(TypeError, match=r"tensor_parallel entry '\*\.mlp\.fc': 'colwise' must map a module name"):
        verify_plan({"*.mlp.fc": "colwise"})
