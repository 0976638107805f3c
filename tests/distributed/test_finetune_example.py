"""examples/finetune_hf.py end to end under torchrun: a local HF directory in, trained, resumed at another layout, out.

The model is a tiny LLaMA built from a config and saved here with
``save_pretrained`` (nothing is downloaded); the text is Python's own help.
The exactness of each part (loading, checkpoints across layouts, the export)
is tested against the plain model in test_hf.py and test_state*.py; this test
checks the road a user takes: the script runs, resumes at another layout, and
its export loads with ``from_pretrained``.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from torchrun_launch import aborted_at_exit, run_torchrun

ROOT = Path(__file__).resolve().parents[2]


def _launch(nproc: int, args: list[str], done: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",  # the CPU path, as on CI
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for _ in range(2):  # once more only if gloo aborted while exiting after the work was done
        proc = run_torchrun([f"--nproc-per-node={nproc}"], [str(ROOT / "examples" / "finetune_hf.py"), *args],
                            cwd=ROOT, env=env, timeout=200, start_new_session=True)
        out = proc.stdout + proc.stderr
        if not aborted_at_exit(proc.returncode, out, done):
            break
    assert proc.returncode == 0, out[-5000:]
    assert done in out, out[-5000:]
    return out


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_fine_tune_a_local_hf_model_resume_at_another_layout_and_load_the_export(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    from pydoc_data.topics import topics

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    pretrained = transformers.LlamaForCausalLM(config)
    pretrained.save_pretrained(tmp_path / "model")
    text = tmp_path / "train.txt"
    text.write_text("\n".join(topics[name] for name in sorted(topics))[:40_000], encoding="utf-8")
    out = tmp_path / "run"
    common = ["--model", str(tmp_path / "model"), "--data", str(text), "--out", str(out), "--seq-len", "16",
              "--batch-size", "4", "--chunks", "2", "--eval-every", "2", "--lr", "1e-3"]

    first = _launch(2, [*common, "--pp", "2", "--steps", "2", "--save-every", "2"], "done: steps 0-2")
    assert (out / "loss.png").stat().st_size > 1000 and (out / "checkpoint" / ".metadata").is_file(), first
    # The same run resumed on another layout: one stage, its parameters sharded over 2 ranks by FSDP2.
    second = _launch(2, [*common, "--pp", "1", "--dp-shard", "2", "--steps", "4", "--resume", str(out / "checkpoint")],
                     "done: steps 2-4")
    assert f"resumed from {out / 'checkpoint'} at step 2" in second, second[-3000:]

    exported, info = transformers.AutoModelForCausalLM.from_pretrained(out / "hf", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    before = dict(pretrained.named_parameters())
    moved = [name for name, p in exported.named_parameters() if not torch.equal(p, before[name])]
    assert all(torch.isfinite(p).all() for p in exported.parameters())
    assert len(moved) == len(before), sorted(set(before) - set(moved))  # 4 steps of AdamW moved every tensor
    held = exported(torch.arange(16).view(1, 16)).logits
    assert held.shape == (1, 16, 256) and torch.isfinite(held).all()
