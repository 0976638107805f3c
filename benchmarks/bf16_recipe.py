"""bf16 against fp32 through the fine-tuning recipe: the loss after 100 steps (issue 49, item 5; target: within 2%).

The model of docs/finetune.md (a 4-layer LLaMA, vocabulary 256) saved in
bfloat16, as a bf16 checkpoint from a hub is, and the page's data (Python's
help pages as UTF-8 bytes); `examples/finetune_hf.py` trains it on 4 gloo
ranks at (pp 2, dp_shard 2) with the page's settings for 100 steps, twice:
`--dtype fp32` (the checkpoint's values in float32) and `--dtype bf16` (float32
parameters and AdamW state, FSDP's mixed precision: bf16 compute, fp32
gradient reduction). Prints each run's loss and held-out loss at the end and
their ratio, and saves benchmarks/results/bf16_recipe.json.

Run:
    python benchmarks/bf16_recipe.py              # 2 x 100 steps: a few minutes on 2 CPU cores
    python benchmarks/bf16_recipe.py --steps 20
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RECIPE = ROOT / "examples" / "finetune_hf.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model_and_data(folder: Path) -> tuple[Path, Path]:
    import torch
    import transformers
    from pydoc_data.topics import topics

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)  # a bf16 checkpoint
    model.save_pretrained(folder / "model")
    text = folder / "corpus.txt"
    text.write_text("\n".join(topics[k] for k in sorted(topics)), encoding="utf-8")
    tokens = folder / "tokens.bin"
    subprocess.run([sys.executable, str(RECIPE), "prepare", "--model", str(folder / "model"), "--text", str(text),
                    "--out", str(tokens)], check=True, capture_output=True, text=True)
    return folder / "model", tokens


def _run(folder: Path, model: Path, tokens: Path, dtype: str, steps: int) -> dict[str, Any]:
    out = folder / f"run-{dtype}"
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=4",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
               "--rdzv-conf=is_host=1", str(RECIPE),  # host the store, never join one found on the port
               "--model", str(model), "--data", str(tokens), "--out", str(out), "--pp", "2", "--dp-shard", "2",
               "--steps", str(steps), "--batch-size", "8", "--seq-len", "32", "--lr", "1e-3", "--warmup", "5",
               "--min-lr", "1e-4", "--eval-every", str(steps), "--save-every", str(steps), "--dtype", dtype]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"the {dtype} run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    held_out = re.search(r"held-out ([0-9.]+) -> ([0-9.]+)", proc.stdout + proc.stderr)
    if held_out is None:
        raise SystemExit(f"the {dtype} run's summary line has no held-out loss:\n{proc.stderr[-2000:]}")
    return {"first_loss": metrics[0]["loss"], "last_loss": metrics[-1]["loss"], "steps": metrics[-1]["step"],
            "held_out": float(held_out.group(2))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pipe-bf16-") as directory:
        folder = Path(directory)
        model, tokens = _model_and_data(folder)
        runs = {dtype: _run(folder, model, tokens, dtype, args.steps) for dtype in ("fp32", "bf16")}
    ratio = runs["bf16"]["last_loss"] / runs["fp32"]["last_loss"]
    held = runs["bf16"]["held_out"] / runs["fp32"]["held_out"]
    for dtype, run in runs.items():
        print(f"{dtype}: loss {run['first_loss']:.4f} -> {run['last_loss']:.4f} after {run['steps']} steps, "
              f"held-out {run['held_out']}")
    print(f"bf16 / fp32 loss after {args.steps} steps: {ratio:.4f} (target within 2%: {abs(ratio - 1) <= 0.02}); "
          f"held-out: {held:.4f}")
    result = {"steps": args.steps, "layout": "pp 2 x dp_shard 2", "runs": runs, "loss_ratio": ratio,
              "held_out_ratio": held}
    (HERE / "results").mkdir(exist_ok=True)
    path = HERE / "results" / ("bf16_recipe.json" if args.steps == 100 else f"bf16_recipe-{args.steps}.json")
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
