"""The recompute/swap config: every form, precedence, errors, logging, and applying it with and without Pipe."""
from __future__ import annotations

import copy
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from recompute_models import assert_same_as_plain, blocks, sample, step
from torch import nn

from pipe import Pipe
from pipe.recompute import (
    DEFAULT_SELECT,
    FullRecompute,
    OffloadLayer,
    SelectiveRecompute,
    apply_recompute_config,
    parse_config,
    policy_of,
)

ROOT = Path(__file__).resolve().parents[2]
STAGES = [2, 3]


def full(config: Any, stages: list[int] = STAGES) -> list[bool]:
    return [l.recompute for l in parse_config(config, stages).layers]


def select(config: Any, stages: list[int] = STAGES) -> list[tuple[str, ...]]:
    return [l.select for l in parse_config(config, stages).layers]


@pytest.mark.parametrize("value, expected", [
    (True, [1, 1, 1, 1, 1]),
    (False, [0, 0, 0, 0, 0]),
    ([1, 2], [1, 0, 1, 1, 0]),
    ([True, 0], [1, 1, 0, 0, 0]),
    ([0, False], [0, 0, 0, 0, 0]),
    ([[2], [1]], [1, 1, 1, 0, 0]),   # 2D: flattened chunk-major, one count per (virtual) stage
    (None, [0, 0, 0, 0, 0]),
])
def test_recompute_forms(value: Any, expected: list[int]) -> None:
    assert full({"recompute": value}) == [bool(e) for e in expected]


def test_select_recompute_forms() -> None:
    default = tuple(DEFAULT_SELECT)
    assert select({"select_recompute": True}) == [default] * 5
    assert select({"select_recompute": [1, 0]}) == [default, (), (), (), ()]
    assert select({"select_recompute": [r"mlp\.act", "attn"]}) == [(r"mlp\.act", "attn")] * 5
    assert select({"select_recompute": r"mlp\.act"}) == [(r"mlp\.act",)] * 5
    assert select({"select_recompute": {r"mlp\.act": True, "attn": [0, 1], "ln1": False}}) == \
        [(r"mlp\.act",), (r"mlp\.act",), (r"mlp\.act", "attn"), (r"mlp\.act",), (r"mlp\.act",)]


def test_precedence() -> None:
    strategy = parse_config({
        "recompute_config": {"recompute": [0, 3], "select_recompute": {"mlp": [0, 1, 4]}},
        "swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 2, "layers": [2, 3]}],
                        "op_swap": [{"op_name": "attn", "layers": [3, 4]}]},
    }, [5])
    # With swap on, lists are layer indices (MindFormers).
    layers = strategy.layers
    assert [l.recompute for l in layers] == [True, False, False, True, False]
    assert [l.select for l in layers] == [(), ("mlp",), (), (), ("mlp",)]  # full recompute wins
    assert [(l.swap, l.op_swap) for l in layers] == [(None, ())] * 2 + [(2, ())] + [(None, ())] * 2
    assert "recompute wins over offload" in layers[4].describe()  # ...also selective over op swap
    strategy = parse_config({"recompute_config": {"recompute": [0]},
                             "swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 2, "layers": [1, 2]}],
                                             "op_swap": [{"op_name": "attn", "layers": [2, 3]}]}}, [4])
    assert [(l.recompute, l.swap, l.op_swap) for l in strategy.layers] == [
        (True, None, ()), (False, 2, ()), (False, 2, ()), (False, None, ("attn",))]  # ...layer swap covers op swap
    assert "covered by the layer swap" in strategy.layers[2].describe()


def test_swap_defaults() -> None:
    strategy = parse_config({"swap_config": {"swap": True, "default_prefetch": 3}}, [2, 2])
    assert [l.swap for l in strategy.layers] == [3, 3, 3, 3]  # swap: True alone offloads every layer
    strategy = parse_config({"swap_config": {"swap": True, "checkpoint_swap": True}}, [2, 2])
    assert strategy.checkpoint_swap == 1 and all(l.swap is None for l in strategy.layers)
    with pytest.warns(UserWarning, match="swap is False: nothing is offloaded"):
        parse_config({"swap_config": {"layer_swap": [{"layers": [0]}]}}, [2])


@pytest.mark.parametrize("config", [
    {"recompute": [1, 0]},
    {"recompute": True, "select_recompute": True},
    {"recompute": [[1], [3]], "select_recompute": {r"mlp\.act": [2, 3], "attn": True}},
    {"recompute_config": {"select_recompute": ["mlp"]},
     "swap_config": {"swap": True, "op_swap": [{"op_name": "attn", "backward_prefetch": 2, "layers": [0, 4]}],
                     "checkpoint_swap": {"backward_prefetch": 2}}},
    {"recompute_config": {"recompute": [0, 3]},
     "swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 1, "layers": [0, 1]},
                                                  {"backward_prefetch": 4, "layers": [3]}]}},
])
def test_normalised_config_reads_back(config: dict[str, Any]) -> None:
    strategy = parse_config(config, STAGES)
    again = parse_config(strategy.to_config(), STAGES)
    assert again.layers == strategy.layers
    assert again.to_config() == strategy.to_config()
    assert again.checkpoint_swap == strategy.checkpoint_swap


def test_strategy_is_logged_per_layer(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pipe.recompute"):
        strategy = apply_recompute_config(blocks(), {"recompute": [1, 1], "select_recompute": [r"mlp\.act"]},
                                          stages=[2, 2])
    messages = [r.getMessage() for r in caplog.records]
    assert repr(strategy.to_config()) in messages[0]
    assert "layer 0 (stage 0, 0): full recompute (select_recompute ['mlp\\\\.act'] dropped: full recompute wins)" \
        in messages
    assert "layer 3 (stage 1, 3): select_recompute ['mlp\\\\.act']" in messages


@pytest.mark.parametrize("config, error, match", [
    ({"recompute": [1, 0, 0]}, ValueError, r"gives 3 per-stage counts but there are 2 stages \(layers per stage \[2, 3\]\)"),
    ({"recompute": [3, 0]}, ValueError, r"recompute\[0\] = 3 but stage 0 has only 2 layers"),
    ({"recompute": [-1, 0]}, ValueError, r"recompute\[0\] = -1: a per-stage count must be an int >= 0"),
    ({"recompute": "yes"}, TypeError, "recompute must be True/False or a list of per-stage counts"),
    ({"recompute": True, "reccompute": 1}, ValueError, r"unknown recompute_config keys \['reccompute'\]"),
    ({"swap": True}, ValueError, r"unknown recompute_config keys \['swap'\].*put swap keys under swap_config"),
    ({"swap_config": {"swap": True, "prefetch": 1}}, ValueError, r"unknown swap_config keys \['prefetch'\]"),
    ({"select_recompute": ["mlp("]}, ValueError, r"select_recompute regex 'mlp\(' is not a valid regular expression"),
    ({"select_recompute": {"attn": [1, 2, 3]}}, ValueError, r"select_recompute\['attn'\] = \[1, 2, 3\] gives 3"),
    ({"select_recompute": ["attn", 1]}, TypeError, "mixes regexes and counts"),
    ({"swap_config": {"swap": True, "layer_swap": [{"layers": [7]}]}}, ValueError, r"layers \[7\] out of range"),
    ({"swap_config": {"swap": True, "layer_swap": [{"layers": [1]}, {"layers": [1]}]}}, ValueError,
     "layer 1 is already in another layer_swap entry"),
    ({"swap_config": {"swap": True, "op_swap": [{"op_name": "a(", "layers": [1]}]}}, ValueError,
     r"op_swap\[0\] op_name regex 'a\('"),
    ({"swap_config": {"swap": True, "op_swap": [{"layers": [1]}]}}, ValueError, r"missing keys \['op_name'\]"),
    ({"swap_config": {"swap": True, "layer_swap": [{"layers": True, "backward_prefetch": -2}]}}, ValueError,
     "backward_prefetch = -2"),
    ({"recompute_config": {"recompute": [9]}, "swap_config": {"swap": True}}, ValueError,
     r"layer indices \[9\] out of range"),
])
def test_errors_name_the_value_and_the_fix(config: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        parse_config(config, STAGES)


def test_stages_must_cover_the_layers() -> None:
    with pytest.raises(ValueError, match=r"stages \[2, 2\] cover 4 layers but the model has 5"):
        apply_recompute_config(blocks(n=5), {"recompute": True}, stages=[2, 2])


def test_mindformers_communication_keys_warn() -> None:
    with pytest.warns(UserWarning, match=r"\['mp_comm_recompute'\] are about MindSpore's communication"):
        parse_config({"recompute": True, "mp_comm_recompute": True, "select_comm_recompute": False}, STAGES)


MIXED = {
    "recompute_config": {"recompute": [1, 0], "select_recompute": {r"mlp\.act": True, r"attn\.softmax": [0, 1]}},
    "swap_config": {"swap": False},
}
SWAPPED = {
    "recompute_config": {"select_recompute": {"mlp": [0]}},
    "swap_config": {"swap": True, "min_bytes": 0, "layer_swap": [{"backward_prefetch": 2, "layers": [1]}],
                    "op_swap": [{"op_name": "attn", "backward_prefetch": 1, "layers": [2, 3]}]},
}


@pytest.mark.parametrize("config", [MIXED, SWAPPED, {"recompute": True}, {"select_recompute": True}])
def test_applied_without_pipe_keeps_gradients(config: dict[str, Any]) -> None:
    model = assert_same_as_plain(blocks(dropout=0.3), lambda m: apply_recompute_config(m, config, stages=[2, 2]),
                                 sample())
    kinds = [type(policy_of(layer)).__name__ for layer in model]
    assert kinds == {id(MIXED): ["FullRecompute", "SelectiveRecompute", "SelectiveRecompute", "SelectiveRecompute"],
                     id(SWAPPED): ["SelectiveRecompute", "OffloadLayer", "OffloadLayer", "OffloadLayer"]}.get(
        id(config), kinds)


def pipe_step(model: nn.Sequential, x: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    pipe = Pipe(model, chunks=2, balance=[2, 2], devices=["cpu", "cpu"], **kwargs)
    try:
        return step(pipe, x)
    finally:
        pipe.close()


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("config", [MIXED, SWAPPED])
def test_inside_pipe_keeps_gradients(config: dict[str, Any], checkpoint: str) -> None:
    # No dropout: micro-batches draw their masks separately from the un-split batch.
    plain, x = blocks(), sample()
    expected = step(plain, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # checkpoint="always" warns that the config has no effect
        for _ in range(2):
            got = pipe_step(copy.deepcopy(plain), x, checkpoint=checkpoint, recompute=config)
            torch.testing.assert_close(got[0], expected[0])
            for g, e in zip(got[1], expected[1]):
                torch.testing.assert_close(g, e)
            torch.testing.assert_close(got[2], expected[2])


def test_stage_is_the_partition() -> None:
    pipe = Pipe(blocks(), chunks=2, checkpoint="never", balance=[1, 3], devices=["cpu", "cpu"],
                recompute={"recompute": [1, 2]})
    assert [isinstance(policy_of(layer), FullRecompute) for layer in pipe] == [True, True, True, False]
    assert pipe.recompute_strategy is not None and pipe.recompute_strategy.stages == [1, 3]
    with pytest.raises(ValueError, match=r"recompute\[0\] = 2 but stage 0 has only 1 layers"):
        Pipe(blocks(), balance=[1, 3], devices=["cpu", "cpu"], recompute={"recompute": [2, 2]})
    pipe.close()


def test_full_recompute_by_config_matches_checkpoint_always() -> None:
    plain, x = blocks(), sample()
    by_config = pipe_step(copy.deepcopy(plain), x, checkpoint="never", recompute={"recompute": True})
    by_pipe = pipe_step(copy.deepcopy(plain), x, checkpoint="always")
    for a, b in zip((by_config[0], *by_config[1], by_config[2]), (by_pipe[0], *by_pipe[1], by_pipe[2])):
        torch.testing.assert_close(a, b)


def test_checkpoint_swap_offloads_the_boundary_inputs() -> None:
    plain, x = blocks(), sample()
    config = {"swap_config": {"swap": True, "checkpoint_swap": {"backward_prefetch": 1}, "min_bytes": 0}}
    pipe = Pipe(copy.deepcopy(plain), chunks=2, checkpoint="always", balance=[2, 2], devices=["cpu", "cpu"],
                recompute=config)
    strategy = pipe.recompute_strategy
    assert strategy is not None and strategy.checkpoint_offloaders[0] is None
    offloader = strategy.checkpoint_offloaders[1]
    assert offloader is not None
    offloader.record_events = True
    got, expected = step(pipe, x), step(plain, x)
    for a, b in zip((got[0], *got[1], got[2]), (expected[0], *expected[1], expected[2])):
        torch.testing.assert_close(a, b)
    # one unit per micro-batch, backward in reverse: micro-batch 1 fetched, 0 prefetched
    assert offloader.events == [("offload", 0), ("offload", 1), ("fetch", 1), ("use", 1), ("prefetch", 0), ("use", 0)]
    pipe.close()


def test_pipe_warns_when_the_config_cannot_act() -> None:
    with pytest.warns(UserWarning, match=r"checkpoint='always'\) recomputes every partition"):
        Pipe(blocks(), balance=[2, 2], devices=["cpu", "cpu"], checkpoint="always", recompute={"recompute": [1, 0]}).close()
    with pytest.warns(UserWarning, match="checkpoint='never' keeps none"):
        Pipe(blocks(), balance=[2, 2], devices=["cpu", "cpu"], checkpoint="never",
             recompute={"swap_config": {"swap": True, "checkpoint_swap": True}}).close()


def test_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "recompute.yaml"
    path.write_text("recompute_config:\n  recompute: [1, 0]\n  select_recompute:\n    'mlp\\.act': True\n"
                    "context: {mode: 0}   # other MindFormers sections are ignored\n")
    strategy = parse_config(str(path), [2, 2])
    assert [(l.recompute, l.select) for l in strategy.layers] == [
        (True, ()), (False, (r"mlp\.act",)), (False, (r"mlp\.act",)), (False, (r"mlp\.act",))]
    bad = tmp_path / "bad.yaml"
    bad.write_text("recompute_config: [1, 2\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        parse_config(bad, [4])


@pytest.mark.parametrize("name", ["recompute.yaml", "recompute_swap.yaml"])
def test_the_example_yaml_files_apply_to_the_example_model(name: str) -> None:
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from transformer_lm import build_model
    finally:
        sys.path.remove(str(ROOT / "examples"))
    torch.manual_seed(0)
    plain = build_model(vocab_size=11, width=16, layers=4, heads=2, seq_len=8, dropout=0.0)
    x = torch.randint(11, (2, 8))
    model = copy.deepcopy(plain)
    strategy = apply_recompute_config(model, ROOT / "examples" / name, stages=[3, 3])
    assert any(l.recompute or l.select for l in strategy.layers)
    for _ in range(2):
        model.zero_grad()
        plain.zero_grad()
        model(x).sum().backward()
        plain(x).sum().backward()
        for a, b in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    if name == "recompute.yaml":
        assert isinstance(policy_of(model[3]), FullRecompute)
        assert isinstance(policy_of(model[1]), SelectiveRecompute)
    else:
        assert isinstance(policy_of(model[2]), OffloadLayer) and isinstance(policy_of(model[1]), SelectiveRecompute)


@pytest.mark.timeout(120)
def test_the_example_script_runs_as_documented() -> None:
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "recompute_config.py"), "--steps", "1", "--width", "16",
         "--seq-len", "16", "--batch-size", "4", "--chunks", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "max |grad diff| 0.0e+00" in proc.stderr and "layer 3 (stage 1, 3): full recompute" in proc.stderr
