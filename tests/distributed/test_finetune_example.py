"""examples/finetune_hf.py end to end under torchrun: a local HF directory in, trained, resumed at another layout, out.

The model is a tiny LLaMA built from a config and saved here with
``save_pretrained`` (nothing is downloaded); the text is Python's own help.
The exactness of each part (loading, checkpoints across layouts, the export)
is tested against the plain model in test_hf.py and test_state*.py; these
tests check the road a user takes: the script runs, keeps its last k
checkpoints, resumes by itself (at another layout, or where an interrupted run
stopped, with the losses the uninterrupted run had; from a token file, reading on
from the batch after the last; under ``torchrun --max-restarts`` after a rank was
SIGKILLed), writes one metrics line per step, and its export loads with
``from_pretrained``. ``prepare`` and the token file's reading are tested in
this process. The flag parsing, the
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
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from pipe.distributed import state
from pipe.distributed.local_ranks import free_port
from torchrun_launch import aborted_at_exit, run_torchrun

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "finetune_hf.py"
METRICS = {"step", "loss", "lr", "tokens_per_s", "seconds", "peak_memory_bytes", "max_peak_memory_bytes",
           "data_position"}


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
    # FSDP2 gathers a decoder layer at a time there (DistributedPipe's default), each only when it runs.
    second = _launch(2, [*common, "--pp", "1", "--dp-shard", "2", "--steps", "4", "--resume", str(out / "checkpoints"),
                         "--dtype", "bf16", "--no-prefetch"], "done: steps 2-4")
    assert f"resumed from {out / 'checkpoints' / 'step-00000002'} at step 2" in second, second[-3000:]
    # The weights are read once, from the checkpoint; the model directory gives the config.
    assert f"bytes held) from {tmp_path / 'model'}" in first, first[-3000:]
    assert f"bytes held) from {tmp_path / 'model'}" not in second, second[-3000:]
    assert f"weights from {out / 'checkpoints' / 'step-00000002'} (the config from {tmp_path / 'model'})" in second
    assert "dtype: bf16 compute, fp32 parameters and gradient reduction (FSDP mixed precision)" in second
    assert "FSDP2 gathers a layer at a time, each only when it runs" in second
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
@pytest.mark.timeout(300)
def test_a_gpt2_with_dropout_fine_tunes_with_tensor_parallelism_and_evaluates_without_dropout(tmp_path: Path) -> None:
    """GPT-2 keeps its config's dropout (0.1: embeddings, residuals, attention) and its fused q, k, v: the recipe at
    (pp 2, tp 2), its tied embedding and head split by the vocabulary too (--tp-vocabulary), trains, evaluates
    (the split graph's dropout off in eval_step) and exports what from_pretrained reads back."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    from pydoc_data.topics import topics

    config = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=4, n_head=4, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    assert config.resid_pdrop == config.attn_pdrop == config.embd_pdrop == 0.1
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "model")
    text = tmp_path / "train.txt"
    text.write_text("\n".join(topics[name] for name in sorted(topics))[:20_000], encoding="utf-8")
    out = tmp_path / "run"
    done = _launch(4, ["--model", str(tmp_path / "model"), "--data", str(text), "--out", str(out), "--seq-len", "16",
                       "--batch-size", "4", "--chunks", "2", "--steps", "2", "--eval-every", "2", "--lr", "1e-3",
                       "--pp", "2", "--tp", "2", "--tp-vocabulary"], "done: steps 0-2")
    assert "tensor parallel over 2 ranks in transformer.h.0: 4 linear layers" in done, done[-3000:]
    # rank 0's log: the tied weight split by the vocabulary where the first stage's embedding reads it
    assert "tensor parallel over 2 ranks in the stage: 1 linear layers" in done, done[-3000:]
    assert "held-out" in done, done[-3000:]
    exported = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    assert exported.config.resid_pdrop == 0.1 and all(torch.isfinite(p).all() for p in exported.parameters())


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
             "--async-save", "--accumulate", "2",  # checkpoints written in the background; 2 passes per step
             "--trace-every", "3", "--peak-tflops", "0.5"]  # steps 3 and 6 recorded; the MFU of a 0.5 TFLOP/s device
    first = _launch(2, flags, "done: steps 0-6")
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000004", "step-00000005", "step-00000006"], first
    uninterrupted = _metrics(out)
    assert [record["step"] for record in uninterrupted] == [1, 2, 3, 4, 5, 6], uninterrupted
    traced = {"bubble_fraction", "idle_fraction"}  # every rank's trace of the step, explained on rank 0
    assert all(set(record) == METRICS | {"mfu"} | (traced if record["step"] % 3 == 0 else set())
               for record in uninterrupted), uninterrupted
    assert all(0 < record["mfu"] < 1 for record in uninterrupted)
    assert all(0 < record["bubble_fraction"] <= record["idle_fraction"] < 1 for record in uninterrupted
               if record["step"] % 3 == 0), uninterrupted
    assert sorted(p.name for p in (out / "trace").iterdir()) == ["step-3.0.json", "step-3.1.json", "step-6.0.json",
                                                                 "step-6.1.json"]
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


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_token_file_is_read_in_order_and_resume_auto_continues_with_the_next_batch_exactly(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    _, text = _tiny_model_and_text(tmp_path)
    tokens = tmp_path / "tokens.bin"
    prepared = subprocess.run([sys.executable, str(SCRIPT), "prepare", "--model", str(tmp_path / "model"), "--text",
                               str(text), "--out", str(tokens)], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                  filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))))
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    count = len(text.read_bytes())  # the model has no tokenizer: UTF-8 bytes
    sequences = (count - count // 10) // 16
    assert f"wrote {count:,} tokens (uint16, vocabulary 256, tokenizer bytes (UTF-8)) to {tokens}" in prepared.stdout
    out = tmp_path / "run"
    flags = ["--model", str(tmp_path / "model"), "--data", str(tokens), "--out", str(out), "--seq-len", "16",
             "--batch-size", "4", "--chunks", "2", "--eval-every", "3", "--pp", "1", "--dp-shard", "2",
             "--steps", "5", "--save-every", "1", "--keep", "3", "--lr", "1e-3", "--accumulate", "2"]
    first = _launch(2, flags, "done: steps 0-5")  # each of the 2 data-parallel ranks reads its 2 rows of 4
    assert (f"data: {tokens}, {count:,} tokens of a vocabulary of 256 (tokenizer bytes (UTF-8)): {sequences:,} "
            "sequences of 16 a pass, read in order from sequence 0 (pass 1)") in first, first[-3000:]
    uninterrupted = _metrics(out)
    assert [record["data_position"] for record in uninterrupted] == [8, 16, 24, 32, 40]  # 2 passes of 4 a step

    # The job dies during the save of step 5, after step 4's was lost: step 3 is the newest complete checkpoint.
    checkpoints = out / "checkpoints"
    shutil.rmtree(checkpoints / "step-00000005")
    (checkpoints / "step-00000004").rename(checkpoints / ("step-00000004" + state.STAGING))
    (checkpoints / ("step-00000004" + state.STAGING) / ".metadata").unlink()
    second = _launch(2, [*flags, "--resume", "auto"], "done: steps 3-5", rerun=False)
    assert f"resumed from {checkpoints / 'step-00000003'} at step 3" in second, second[-3000:]
    assert "read in order from sequence 24 (pass 1)" in second, second[-3000:]  # the next batch, not the first
    resumed = _metrics(out)
    exact = ("step", "loss", "lr", "data_position")  # bit for bit: the same batches after the resume
    assert [[record[key] for key in exact] for record in resumed] == [[record[key] for key in exact]
                                                                       for record in uninterrupted]


def _launch_restartable(nproc: int, args: list[str], **extra_env: str) -> str:
    """The recipe under ``torchrun --max-restarts 3`` with a c10d rendezvous on 127.0.0.1, as a long job runs."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **extra_env,
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # a store of each attempt's own (launch/single_node.sh's)
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for _ in range(3):  # a new port only if the one found free was taken before the rendezvous bound it
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                               f"--nproc-per-node={nproc}", "--max-restarts=3", "--rdzv-backend=c10d",
                               f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id=test{os.getpid()}",
                               # The agent hosts its store, or fails with EADDRINUSE (launched again). Without
                               # is_host, an agent that finds the port taken (on a busy machine, by another test's
                               # store) joins that store and fails when it ends ("Connection was likely closed" in
                               # num_nodes_waiting), as once on a 16-core machine.
                               "--rdzv-conf=is_host=1",
                               str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
                              start_new_session=True)
        out = proc.stdout + proc.stderr
        if proc.returncode == 0 or "EADDRINUSE" not in out:
            break
    first_error = next((line for line in out.splitlines() if "Error" in line), "")
    assert proc.returncode == 0, f"first error line: {first_error}\n...\n{out[-4000:]}"
    return out


@pytest.mark.slow
@pytest.mark.timeout(2000)
def test_a_rank_killed_mid_run_under_torchrun_max_restarts_resumes_by_itself_with_the_uninterrupted_losses(
        tmp_path: Path) -> None:
    """Issue 52, item 3: 4 ranks (pp 2 x dp_shard 2, gloo), rank 1 SIGKILLed as step 4 begins, in the first attempt.

    Whatever the machine's speed, the newest complete checkpoint then is step 2's: saves are asynchronous, and
    step 3's is published only by the wait of step 4's save, which rank 1 never reaches.
    """
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    _, text = _tiny_model_and_text(tmp_path)
    example = _example()
    example.prepare(tmp_path / "model", [text], tmp_path / "tokens.bin")

    def flags(out: Path) -> list[str]:
        return ["--model", str(tmp_path / "model"), "--data", str(tmp_path / "tokens.bin"), "--out", str(out),
                "--seq-len", "16", "--batch-size", "8", "--chunks", "2", "--pp", "2", "--dp-shard", "2",
                "--steps", "6", "--save-every", "1", "--keep", "2", "--async-save", "--lr", "1e-3",
                "--warmup", "2", "--eval-every", "3", "--resume", "auto"]

    whole = _launch_restartable(4, flags(tmp_path / "whole"), FINETUNE_KILL="")
    assert "done: steps 0-6" in whole and "FINETUNE_KILL" not in whole, whole[-3000:]
    uninterrupted = _metrics(tmp_path / "whole")

    out = tmp_path / "killed"
    killed = _launch_restartable(4, flags(out), FINETUNE_KILL="1:4")
    assert killed.count("FINETUNE_KILL: rank 1 kills itself (SIGKILL) as step 4 begins") == 1, killed[-6000:]
    assert "local_rank: 1" in killed and "exitcode: -9" in killed, killed[-6000:]  # torchrun saw the SIGKILL
    assert f"resumed from {out / 'checkpoints' / 'step-00000002'} at step 2" in killed, killed[-6000:]
    assert "read in order from sequence 16 (pass 1)" in killed, killed[-6000:]  # the next batch, not the first
    assert "done: steps 2-6" in killed, killed[-6000:]
    resumed = _metrics(out)
    exact = ("step", "loss", "lr", "data_position")  # bit for bit
    assert [[record[key] for key in exact] for record in resumed] == [[record[key] for key in exact]
                                                                       for record in uninterrupted]
    assert [record["data_position"] for record in resumed] == [8, 16, 24, 32, 40, 48]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000005", "step-00000006"]


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


@pytest.mark.parametrize("flags, message", [
    (["--fsdp-unit", "layer"], "--fsdp-unit layer gathers the layers FSDP2 shards: give --dp-shard > 1 too"),
    (["--dp-shard", "2", "--fsdp-unit", "stage", "--keep-gathered"],
     "--keep-gathered keeps each layer gathered through the backwards: it goes with FSDP2 gathering a layer at a time"),
    (["--keep-gathered"], "--keep-gathered keeps each layer gathered through the backwards: it goes with FSDP2"),
    (["--dp-shard", "2", "--fsdp-unit", "stage", "--no-prefetch"],
     "--no-prefetch gathers each layer only when it runs: it goes with FSDP2 gathering a layer at a time"),
    (["--tp-vocabulary"], "--tp-vocabulary splits the vocabulary over the tensor-parallel ranks: give --tp 2"),
])
def test_fsdp_unit_flags_without_what_they_need_are_refused_naming_the_fix(
        flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    example = _example()
    with pytest.raises(SystemExit):
        example.parse_args(["--model", "m", "--data", "d", "--out", "o", *flags])
    assert message in capsys.readouterr().err
    settings = example.parse_args(["--model", "m", "--data", "d", "--out", "o", "--dp-shard", "2", "--fsdp-unit",
                                   "layer", "--keep-gathered"])
    assert (settings.fsdp_unit, settings.keep_gathered) == ("layer", True)
    settings = example.parse_args(["--model", "m", "--data", "d", "--out", "o", "--dp-shard", "2", "--no-prefetch"])
    assert (settings.fsdp_unit, settings.no_prefetch) == (None, True)  # a layer at a time, DistributedPipe's default


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


def _bpe_model(folder: Path, text: str, vocab_size: int) -> Any:
    """A model directory holding a config of ``vocab_size`` ids and a byte-level BPE tokenizer of 300 trained here."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    bpe.train_from_iterator([text], tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(folder)
    transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4).save_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


def test_prepare_writes_the_texts_tokens_by_the_model_directorys_tokenizer_and_a_header(tmp_path: Path,
                                                                                        capsys: Any) -> None:
    from pydoc_data.topics import topics

    example = _example()
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(topics["if"], encoding="utf-8")
    b.write_text(topics["while"] + " naïve", encoding="utf-8")
    tokenizer = _bpe_model(tmp_path / "model", topics["if"] + topics["for"], vocab_size=320)
    out = tmp_path / "data" / "tokens.bin"
    example.main(["prepare", "--model", str(tmp_path / "model"), "--text", str(a), str(b), "--out", str(out)])
    expected = [*tokenizer(a.read_text())["input_ids"], 1, *tokenizer(b.read_text())["input_ids"], 1]  # </s> is 1
    header = json.loads((tmp_path / "data" / "tokens.bin.json").read_text())
    assert header == {"format": "pipe-tokens-1", "vocab_size": 320, "dtype": "uint16", "count": len(expected),
                      "tokenizer": str(tmp_path / "model"), "tokenizer_class": type(tokenizer).__name__,
                      "end_of_text": 1, "texts": [str(a), str(b)]}
    assert np.fromfile(out, dtype=np.uint16).tolist() == expected
    assert f"wrote {len(expected):,} tokens (uint16, vocabulary 320" in capsys.readouterr().out
    assert sorted(p.name for p in out.parent.iterdir()) == ["tokens.bin", "tokens.bin.json"]  # nothing half-written

    # A directory without a tokenizer: UTF-8 bytes; more than 65536 ids: uint32.
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=70_000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4).save_pretrained(tmp_path / "big")
    header = example.prepare(tmp_path / "big", [b], tmp_path / "bytes.bin")
    assert header["dtype"] == "uint32" and header["tokenizer"] == "bytes (UTF-8)" and header["end_of_text"] is None
    assert np.fromfile(tmp_path / "bytes.bin", dtype=np.uint32).tolist() == list(b.read_bytes())


def test_a_token_file_is_read_in_order_each_data_parallel_part_its_own_rows_and_from_the_start_again(
        tmp_path: Path) -> None:
    example = _example()
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4).save_pretrained(tmp_path / "model")
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(32, 127)) * 11)  # 1045 bytes: 104 held out, 941 // 8 = 117 sequences of 8
    example.prepare(tmp_path / "model", [text], tmp_path / "t.bin")
    data = example.TokenFile(tmp_path / "t.bin", 256, tmp_path / "model", seq_len=8)
    tokens = torch.tensor(list(text.read_bytes()))
    assert data.sequences == 117
    rows = tokens[:117 * 8].view(117, 8)
    assert torch.equal(data.batch(0, 4), rows[:4])
    assert torch.equal(data.batch(20, 6), rows[20:26])  # the 6 sequences after the 20 read before
    parts = [data.batch(20, 6, part, 3) for part in range(3)]  # 3 data-parallel parts: 2 rows each, in order
    assert [len(part) for part in parts] == [2, 2, 2] and torch.equal(torch.cat(parts), rows[20:26])
    assert torch.equal(data.batch(115, 4), torch.cat([rows[115:], rows[:2]]))  # past the end: from the start again
    assert torch.equal(data.batch(117 + 3, 2), rows[3:5])  # the second pass
    assert torch.equal(data.evaluation(3), tokens[-104:][:24].view(3, 8))  # the last 10%, held out
    assert data.batch(0, 1).dtype == torch.long


def test_a_token_file_of_another_vocabulary_is_refused_naming_both_and_the_fix(tmp_path: Path) -> None:
    example = _example()
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4).save_pretrained(tmp_path / "bytes")
    text = tmp_path / "t.txt"
    text.write_text("some text " * 100)
    example.prepare(tmp_path / "bytes", [text], tmp_path / "t.bin")
    with pytest.raises(SystemExit, match=r"--data .*t.bin: its tokens are for a vocabulary of 256 ids \(tokenizer "
                                         r"bytes \(UTF-8\)\), the model .*other has 32000: a file of another "
                                         r"tokenizer; prepare the data with this model's: python "
                                         r"examples/finetune_hf.py prepare --model .*other --text FILE... --out "
                                         r".*t.bin"):
        example.TokenFile(tmp_path / "t.bin", 32000, tmp_path / "other", seq_len=8)
    (tmp_path / "t.bin").write_bytes(b"\0" * 10)  # cut short
    with pytest.raises(SystemExit, match=r"t.bin: 10 bytes, its header says 1000 uint16 tokens \(2000 bytes\): "
                                         r"prepare it again"):
        example.TokenFile(tmp_path / "t.bin", 256, tmp_path / "bytes", seq_len=8)
    (tmp_path / "u.bin").write_bytes(b"\0" * 10)  # no header
    args = example.parse_args(["--config", str(tmp_path / "bytes"), "--data", str(tmp_path / "u.bin"), "--out", "o"])
    with pytest.raises(SystemExit, match=r"--data .*u.bin: its header .*u.bin.json cannot be read \(No such file "
                                         r"or directory\); write the token file and its header with: python "
                                         r"examples/finetune_hf.py prepare --model"):
        example.open_data(args, 256)


def test_the_kill_drill_names_a_rank_and_a_step_of_the_first_attempt_only(monkeypatch: pytest.MonkeyPatch) -> None:
    example = _example()
    monkeypatch.delenv("FINETUNE_KILL", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert example.kill_drill(1) is None
    monkeypatch.setenv("FINETUNE_KILL", "1:25")
    assert [example.kill_drill(rank) for rank in range(3)] == [None, 25, None]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the restarted job runs on
    assert example.kill_drill(1) is None
    monkeypatch.setenv("FINETUNE_KILL", "rank1")
    with pytest.raises(SystemExit, match=r"FINETUNE_KILL='rank1': give RANK:STEP \(1:3: rank 1 kills itself as "
                                         r"step 3 begins\)"):
        example.kill_drill(1)
