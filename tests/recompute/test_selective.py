"""Op-level selective recompute: choose ops by name regex or kind, keep the rest."""
from __future__ import annotations

import copy

import pytest
import torch
from recompute_models import assert_same_as_plain, blocks, kept_bytes, sample
from torch.utils.checkpoint import CheckpointPolicy

from pipe.recompute import SelectiveRecompute, policy_of, recompute, select_recompute
from pipe.recompute import selective
from pipe.recompute.op_decisions import op_name
from pipe.recompute.selective import Selection


@pytest.mark.parametrize("names, ops", [
    ((), ["gelu"]),
    ((), ["softmax"]),
    ((), ["gelu", "softmax", "layer_norm"]),
    ([r"mlp\.act"], ()),
    ([r"attn\.softmax"], ()),
    (["mlp"], ()),
    ([r"mlp\.fc1", r"(.*\.)?gelu"], ["softmax"]),
])
def test_every_selection_keeps_outputs_and_gradients(names: list[str], ops: list[str]) -> None:
    assert_same_as_plain(blocks(), lambda m: [select_recompute(b, names, ops) for b in m], sample(), steps=3)


def test_dropout_masks_are_replayed() -> None:
    # On the CPU dropout is bernoulli_/div_/mul (in-place writes): chosen or not, it must replay.
    assert_same_as_plain(blocks(dropout=0.5), lambda m: [select_recompute(b, ops=["softmax"]) for b in m], sample())
    assert_same_as_plain(blocks(dropout=0.5), lambda m: [select_recompute(b, [r"attn\.drop"]) for b in m], sample())


@pytest.mark.parametrize("ops", [["gelu"], ["softmax"], ["gelu", "softmax"]])
def test_memory_drops(ops: list[str]) -> None:
    plain, x = blocks(), sample()
    marked = copy.deepcopy(plain)
    for b in marked:
        select_recompute(b, ops=ops)
    kept_bytes(marked, x)  # plans the layer...
    kept_bytes(marked, x)  # ...and the submodules it narrows to
    assert kept_bytes(marked, x) < kept_bytes(plain, x)


def test_gelu_saving_is_exactly_its_output() -> None:
    plain, x = blocks(n=1), sample()
    marked = copy.deepcopy(plain)
    select_recompute(marked[0], ops=["gelu"])
    kept_bytes(marked, x)
    kept_bytes(marked, x)
    assert policy_of(marked[0]).delegates == [marked[0].mlp]  # type: ignore[union-attr]
    gelu_output = x.numel() * 4 * x.element_size()  # [B, T, 4d]
    assert kept_bytes(plain, x) - kept_bytes(marked, x) == gelu_output


def test_recomputing_the_op_alone_saves_nothing() -> None:
    # The docs' point: checkpointing nn.GELU by itself keeps its input, and fc2 keeps its output anyway.
    plain, x = blocks(n=1), sample()
    alone = copy.deepcopy(plain)
    recompute(alone[0].mlp.act)
    assert kept_bytes(alone, x) == kept_bytes(plain, x)


def test_softmax_pulls_in_the_scores_that_feed_it() -> None:
    model = blocks(n=1)
    select_recompute(model[0], ops=["softmax"])
    model(sample()).sum().backward()
    policy = policy_of(model[0])
    assert isinstance(policy, SelectiveRecompute)
    (plan,) = policy.decisions()
    names = [op_name(f) for f in plan.ops]
    decisions = dict(zip(names, plan.decisions))  # last decision per op name
    first_bmm = names.index("bmm")  # q @ k^T, which only the softmax needs
    assert plan.decisions[first_bmm] == CheckpointPolicy.MUST_RECOMPUTE
    assert decisions["softmax"] == CheckpointPolicy.MUST_RECOMPUTE
    assert decisions["layer_norm"] == CheckpointPolicy.MUST_SAVE
    assert plan.freed_bytes > 0 and plan.chosen == {"op:softmax": 1}


def test_narrowed_to_the_submodules_that_hold_the_chosen_ops() -> None:
    model = blocks(n=1)
    select_recompute(model[0], ops=["gelu", "softmax"])
    for _ in range(2):
        model(sample()).sum().backward()
    layer_policy = policy_of(model[0])
    assert isinstance(layer_policy, SelectiveRecompute)
    (plan,) = layer_policy.decisions()
    assert plan.regions == ["attn", "mlp"]
    attn_policy = policy_of(model[0].attn)
    assert isinstance(attn_policy, SelectiveRecompute) and attn_policy.prefix == "attn"
    assert attn_policy.decisions()[0].chosen == {"op:softmax": 1}
    # a regex naming the whole block's residual path cannot narrow: one checkpoint for the layer
    whole = blocks(n=1)
    select_recompute(whole[0], names=[r"ln2", r"mlp\.act"])
    whole(sample()).sum().backward()
    assert policy_of(whole[0]).decisions()[0].regions == [""]  # type: ignore[union-attr]
    recompute(model[0])  # replacing the policy takes the narrowed ones off too
    assert policy_of(model[0].attn) is None and policy_of(model[0].mlp) is None


def test_changed_shapes_plan_again() -> None:
    plain = blocks(n=1)
    model = assert_same_as_plain(plain, lambda m: select_recompute(m[0], ops=["gelu"]), sample(seq=6))
    assert_same_as_plain(plain, lambda m: m.load_state_dict(model.state_dict()), sample(seq=6))
    for seq in (3, 5):
        torch.testing.assert_close(model(sample(seq=seq)), plain(sample(seq=seq)), rtol=0, atol=0)
    assert len(policy_of(model[0]).decisions()) == 3  # type: ignore[union-attr]


def test_selection_matching() -> None:
    selection = Selection([r"mlp\.act", r"attn\.softmax"], ["silu"])
    assert selection.match(["mlp", "mlp.act"], "gelu") == r"mlp\.act"
    assert selection.match(["attn"], "softmax") == r"attn\.softmax"
    assert selection.match(["attn"], "bmm") is None
    assert selection.match([], "silu") == "op:silu"
    assert op_name(torch.ops.aten._softmax.default) == "softmax"
    assert op_name(torch.ops.aten.native_dropout.default) == "dropout"


def test_a_pattern_choosing_nothing_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selective, "_warned", set())
    model = blocks(n=2)
    for b in model:
        select_recompute(b, names=[r"mlp\.activation"])
    with pytest.warns(UserWarning, match="chose no operation") as caught:
        model(sample()).sum().backward()
    messages = [str(w.message) for w in caught if "chose no operation" in str(w.message)]
    assert len(messages) == 1 and "mlp.act" in messages[0], messages  # once, not once per layer


def test_bad_input() -> None:
    block = blocks(n=1)[0]
    with pytest.raises(ValueError, match=r"select_recompute regex 'mlp\(' is not a valid regular expression"):
        select_recompute(block, names=["mlp("])
    with pytest.raises(ValueError, match="unknown op kind 'gelux'"):
        select_recompute(block, ops=["gelux"])
    with pytest.raises(ValueError, match="needs at least one name regex or op kind"):
        select_recompute(block)


def test_a_replay_that_asks_the_policy_again_gets_the_forwards_answers() -> None:
    # torch 2.11's selective checkpoint asks the policy again during the replay (ctx.is_recompute) and
    # looks up what it is told was saved; torch 2.13 replays from what the forward stored. Both must
    # get, call by call, what the forward was told, a mismatch's fallback included.
    from types import SimpleNamespace

    from pipe.recompute.op_decisions import OpDecisions

    ops = [torch.ops.aten.addmm.default, torch.ops.aten.gelu.default, torch.ops.aten.addmm.default]
    plan = OpDecisions(ops, [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_RECOMPUTE,
                             CheckpointPolicy.MUST_SAVE])
    mismatches: list[str] = []
    policy = plan.policy(lambda: mismatches.append("mismatch"))
    forward, replay = SimpleNamespace(is_recompute=False), SimpleNamespace(is_recompute=True)
    told = [policy(forward, op) for op in ops]
    assert told == plan.decisions and not mismatches
    assert [policy(replay, op) for op in ops] == told
    # A forward that strays from the plan keeps everything from there on; the replay is told the same.
    policy = plan.policy(lambda: mismatches.append("mismatch"))
    strayed = [ops[0], torch.ops.aten.relu.default, ops[2]]
    told = [policy(forward, op) for op in strayed]
    assert told == [CheckpointPolicy.MUST_SAVE] * 3 and mismatches == ["mismatch"] and plan.stale
    assert [policy(replay, op) for op in strayed] == told
