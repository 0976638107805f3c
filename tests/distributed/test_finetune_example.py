"""examples/finetune_hf.py end to end under torchrun: a local HF directory in, trained, resumed at another layout, out.

The model is a tiny LLaMA built from a config and saved here with
``save_pretrained`` (nothing is downloaded); the text is Python's own help.
The exactness of each part (loading, checkpoints across layouts, the export)
is tested against the plain model in test_hf.py and test_state*.py; these
tests check the road a user takes: the script runs, keeps its last k
checkpoints, resumes by itself (at another layout, or where an interrupted run
stopped, with the losses the uninterrupted run had), writes one metrics line
per step, and its export loads with ``from_pretrained``. The flag parsing, the
config file, the choice of checkpoint to resume from and the LR schedule are
tested in this process, without ranks.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import yaml

from pipe.distributed import state
from torchrun_launch import aborted_at_exit, run_torchrun

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "finetune_hf.py"
METRICS = {"step", "loss", "lr", "tokens_per_s", "seconds", "peak_memory_bytes", "max_peak_memory_bytes"}


def _launch(nproc: int, args: list[str], done: str, rerun: bool = True) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",  # the CPU path, as on CI
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for _ in range(2):  # once more only if gloo aborted while exiting after the work was done
        proc = run_torchrun([f"--nproc-per-node={nproc}"], [str(SCRIPT), *args],
                            cwd=ROOT, env=env, timeout=200, start_new_session=True)
        out = proc.stdout + proc.stderr
        if not aborted_at_exit(proc.returncode, out, done):
            break
        if not rerun:  # a resumed run would resume again from its own end: its work is done and written
            return out
    assert proc.returncode == 0, out[-5000:]
    assert done in out, out[-5000:]
    return out


def _tiny_model_and_text(folder: Path) -> tuple[Any, Path]:
    transformers = pytest.importorskip("transformers")
    from pydoc_data.topics import topics

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    pretrained = transformers.LlamaForCausalLM(config)
    pretrained.save_pretrained(folder / "model")
    text = folder / "train.txt"
    text.write_text("\n".join(topics[name] for name in sorted(topics))[:40_000], encoding="utf-8")
    return pretrained, text


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_fine_tune_a_local_hf_model_in_bf16_resume_at_another_layout_and_load_the_export(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    pretrained, text = _tiny_model_and_text(tmp_path)
    out = tmp_path / "run"
    common = ["--model", str(tmp_path / "model"), "--data", str(text), "--out", str(out), "--seq-len", "16",
              "--batch-size", "4", "--chunks", "2", "--eval-every", "2", "--lr", "1e-3"]

    # --dtype bf16 unsharded: the model in bfloat16, exported so.
    first = _launch(2, [*common, "--pp", "2", "--steps", "2", "--save-every", "2", "--dtype", "bf16"],
                    "done: steps 0-2")
    assert "dtype: bf16 parameters and compute" in first, first[-3000:]
    assert (out / "loss.png").stat().st_size > 1000, first
    assert state.latest(out / "checkpoints") == out / "checkpoints" / "step-00000002", first
    assert transformers.AutoModelForCausalLM.from_pretrained(out / "hf").dtype == torch.bfloat16
    # The same run resumed on another layout: one stage, its parameters sharded over 2 ranks by FSDP2, in fp32
    # with bf16 compute (FSDP's mixed precision; the checkpoint's bf16 tensors load into fp32 ones); --resume
    # given the folder of step checkpoints takes its newest.
    second = _launch(2, [*common, "--pp", "1", "--dp-shard", "2", "--steps", "4", "--resume", str(out / "checkpoints"),
                         "--dtype", "bf16"], "done: steps 2-4")
    assert f"resumed from {out / 'checkpoints' / 'step-00000002'} at step 2" in second, second[-3000:]
    assert "dtype: bf16 compute, fp32 parameters and gradient reduction (FSDP mixed precision)" in second
    assert [record["step"] for record in _metrics(out)] == [1, 2, 3, 4]  # the first run's lines, then the second's

    exported, info = transformers.AutoModelForCausalLM.from_pretrained(out / "hf", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    assert exported.dtype == torch.float32  # FSDP kept fp32 parameters
    before = dict(pretrained.named_parameters())
    moved = [name for name, p in exported.named_parameters() if not torch.equal(p, before[name])]
    assert all(torch.isfinite(p).all() for p in exported.parameters())
    assert len(moved) == len(before), sorted(set(before) - set(moved))  # 4 steps of AdamW moved every tensor
    held = exported(torch.arange(16).view(1, 16)).logits
    assert held.shape == (1, 16, 256) and torch.isfinite(held).all()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_keep_the_last_checkpoints_and_resume_auto_continues_an_interrupted_run_exactly(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    _, text = _tiny_model_and_text(tmp_path)
    out = tmp_path / "run"
    flags = ["--model", str(tmp_path / "model"), "--data", str(text), "--out", str(out), "--seq-len", "16",
             "--batch-size", "4", "--chunks", "2", "--eval-every", "3", "--pp", "2", "--steps", "6",
             "--save-every", "1", "--keep", "3", "--lr", "1e-3", "--warmup", "2", "--min-lr", "1e-4",
             "--async-save", "--accumulate", "2"]  # checkpoints written in the background; 2 passes per step
    first = _launch(2, flags, "done: steps 0-6")
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000004", "step-00000005", "step-00000006"], first
    uninterrupted = _metrics(out)
    assert [record["step"] for record in uninterrupted] == [1, 2, 3, 4, 5, 6], uninterrupted
    assert all(set(record) == METRICS for record in uninterrupted), uninterrupted[0]
    assert all(record["peak_memory_bytes"] <= record["max_peak_memory_bytes"] for record in uninterrupted)
    assert all(record["peak_memory_bytes"] > 0 and record["tokens_per_s"] > 0 for record in uninterrupted)
    lrs = [record["lr"] for record in uninterrupted]  # 2 steps of warmup, then cosine down to --min-lr
    assert lrs[:2] == [0.5e-3, 1e-3] and lrs[-1] == pytest.approx(1e-4) and lrs[2:] == sorted(lrs[2:], reverse=True)
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["steps"] == 6 and config["min-lr"] == 1e-4 and config["model"] == str(tmp_path / "model"), config

    # The job dies during the save of step 6, after step 5's was lost too: step 4 is the newest complete one.
    shutil.rmtree(checkpoints / "step-00000005")
    (checkpoints / "step-00000006").rename(checkpoints / ("step-00000006" + state.STAGING))
    (checkpoints / ("step-00000006" + state.STAGING) / ".metadata").unlink()
    # Restarted from the configuration it saved (a config-file run, the same as the flags' run) with --resume auto.
    second = _launch(2, ["--config-file", str(out / "config.yaml"), "--resume", "auto"], "done: steps 4-6",
                     rerun=False)
    assert f"resumed from {checkpoints / 'step-00000004'} at step 4" in second, second[-3000:]
    resumed = _metrics(out)
    assert [record["step"] for record in resumed] == [1, 2, 3, 4, 5, 6], resumed  # one line per step
    exact = ("step", "loss", "lr")  # bit for bit: the same weights, Adam moments, batches and LR schedule
    assert [[record[key] for key in exact] for record in resumed] == [[record[key] for key in exact]
                                                                       for record in uninterrupted]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000004", "step-00000005", "step-00000006"]
    assert yaml.safe_load((out / "config.yaml").read_text()) == {**config, "resume": "auto"}


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("finetune_hf_example", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {name: value for name, value in vars(args).items() if name != "config_file"}


def test_a_config_file_gives_the_flags_and_the_command_line_overrides_it(tmp_path: Path) -> None:
    example = _example()
    flags = ["--model", "m", "--data", "d.txt", "--out", "o", "--pp", "4", "--dp-shard", "2", "--steps", "30",
             "--lr", "0.001", "--min-lr", "1e-05", "--warmup", "3", "--schedule", "gpipe", "--resume", "auto",
             "--async-save", "--accumulate", "4"]
    given = example.parse_args(flags)
    run = tmp_path / "run.yaml"
    run.write_text("model: m\ndata: d.txt\nout: o\npp: 4\ndp_shard: 2\nsteps: 30\nlr: 1e-3\nmin-lr: 1.0e-5\n"
                   "warmup: 3\nschedule: gpipe\nresume: auto\nseed: null\nasync-save: true\naccumulate: 4\n"
                   )  # dashes or underscores; null: default; a switch is true or false
    assert _settings(example.parse_args(["--config-file", str(run)])) == _settings(given)
    # What a run saves as out/config.yaml gives the same run back.
    run.write_text(yaml.safe_dump(example.effective_config(given)))
    assert _settings(example.parse_args(["--config-file", str(run)])) == _settings(given)
    # The command line wins, also for one of the alternatives --model / --config.
    changed = example.parse_args(["--config-file", str(run), "--steps", "40", "--config", "c.json"])
    assert _settings(changed) == {**_settings(given), "steps": 40, "model": None, "config": Path("c.json")}
    run.write_text("steps: 2.5\nmodel: m\ndata: d\nout: o\n")  # a value is checked as the flag's would be
    with pytest.raises(SystemExit):
        example.parse_args(["--config-file", str(run)])


@pytest.mark.parametrize("text, message", [
    ("model: m\nstep: 10\n", r"run.yaml: unknown key 'step'; the known keys are the flags' names: model, config, "
                               r"data, out, pp, dp-shard, .*, steps, "),
    ("dp-shard: 2\ndp_shard: 2\n", r"'dp-shard' and 'dp_shard' are one flag; give it once"),
    ("- steps: 10\n", r"run.yaml: holds a list, not a mapping of flags to values"),
    ("steps: [1, 2]\n", r"steps: \[1, 2\] is not a value of the flag; give one number, word or path"),
    ("async-save: 1\n", r"async-save: 1 is not a value of the flag; give true or false"),
    ("steps: true\n", r"steps: True is not a value of the flag; give one number"),
    ("steps: 10\n  bad: [\n", r"run.yaml: not YAML"),
])
def test_a_config_file_with_a_key_that_is_no_flag_is_refused_naming_it(tmp_path: Path, text: str,
                                                                        message: str) -> None:
    example = _example()
    run = tmp_path / "run.yaml"
    run.write_text(text)
    with pytest.raises(SystemExit, match=message):
        example.parse_args(["--config-file", str(run), "--data", "d", "--out", "o"])
    with pytest.raises(SystemExit, match=r"--config-file .*absent.yaml: No such file"):
        example.parse_args(["--config-file", str(tmp_path / "absent.yaml")])


def test_resume_takes_the_newest_complete_checkpoint_and_refuses_a_folder_without_one(tmp_path: Path) -> None:
    example = _example()
    out = tmp_path / "run"
    args = example.parse_args(["--config", "c", "--data", "d", "--out", str(out), "--resume", "auto"])
    assert example.resume_from(args) is None  # a first run: nothing to resume from, step 0
    model = torch.nn.Linear(2, 2)
    for step in (1, 2):
        state.save(state.step_path(out / "checkpoints", step), model, step=step)
    (out / "checkpoints" / "step-00000003.saving").mkdir()
    assert example.resume_from(args) == out / "checkpoints" / "step-00000002"
    args.resume = str(out / "checkpoints")  # a folder of step checkpoints: its newest complete one
    assert example.resume_from(args) == out / "checkpoints" / "step-00000002"
    args.resume = str(out / "checkpoints" / "step-00000001")  # a checkpoint: itself
    assert example.resume_from(args) == out / "checkpoints" / "step-00000001"
    empty = tmp_path / "empty"
    (empty / "step-00000004.saving").mkdir(parents=True)
    args.resume = str(empty)
    with pytest.raises(SystemExit, match=r"--resume .*empty: no complete checkpoint there \(saves that did not "
                                         r"finish: step-00000004.saving\); give a checkpoint folder, a folder of "
                                         r"them \(.*checkpoints\), or --resume auto"):
        example.resume_from(args)
    args.resume = str(tmp_path / "nowhere")
    with pytest.raises(SystemExit, match=r"nowhere: no complete checkpoint there \(the folder does not exist\)"):
        example.resume_from(args)


def test_the_lr_warms_up_then_decays_and_a_restored_schedule_continues_it_bit_for_bit() -> None:
    example = _example()
    args = example.parse_args(["--config", "c", "--data", "d", "--out", "o", "--steps", "10", "--warmup", "3",
                               "--lr", "0.01", "--min-lr", "0.001"])

    def lrs(schedule: torch.optim.lr_scheduler.LambdaLR, steps: range) -> list[float]:
        taken = []
        for _ in steps:
            taken.append(schedule.optimizer.param_groups[0]["lr"])
            schedule.optimizer.step()
            schedule.step()
        return taken

    parameter = torch.nn.Parameter(torch.zeros(1))
    whole = lrs(example.lr_schedule(torch.optim.AdamW([parameter], lr=args.lr), args), range(10))
    assert whole[:3] == pytest.approx([0.01 / 3, 0.02 / 3, 0.01]) and whole[-1] == pytest.approx(0.001)
    assert whole[3:] == sorted(whole[3:], reverse=True)
    assert whole[6] == pytest.approx(0.001 + 0.009 * 0.5 * (1 + math.cos(math.pi * 3 / 6)))
    first = example.lr_schedule(torch.optim.AdamW([parameter], lr=args.lr), args)
    before = lrs(first, range(4))
    saved = first.state_dict()
    again = example.lr_schedule(torch.optim.AdamW([parameter], lr=args.lr), args)  # a new process: step 0
    example.restore_schedule(again, saved, 4, args)
    assert before + lrs(again, range(4, 10)) == whole
