"""Compiling a split model's stage a layer at a time against the whole stage at once: the first step's time.

``compile=`` on a stage of ``pipe.split`` compiles each of its outlined layers
(``pipe.split_blocks``; ``unit="block"``, the default); alike layers share one
class, so one compile serves them all, and the first step's cost no longer
grows with the stage's depth. Compiling the whole stage as one graph
(``unit="stage"``, what ``compile=`` did before) traces and compiles every
layer again. This measures both on a LLaMA built from a
config (width 256, 4 heads, vocabulary 1024; random weights), cut into two
stages, in ``Pipe`` with 2 micro-batches of 4 x 64 tokens, ``checkpoint="never"``:

* ``first_step_s``: the first forward and backward (compiling included);
* ``step_s``: the median of the next 5 steps (compiled).

Each measurement runs in a process of its own with inductor's caches off (a
cache would make the second run of a configuration cheap), the configurations
alternating, ``--runs`` times.

Run:
    python benchmarks/compile_split.py                       # inductor and aot_eager, 4 and 8 layers, 3 runs
    python benchmarks/compile_split.py --backends aot_eager --layers 4 --runs 1
Results: benchmarks/results/compile_split.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "compile_split.json"


def one(layers: int, unit: str, backend: str) -> dict[str, Any]:
    """One measurement in this process: a fresh model, compiled by ``unit`` ("layer" or "stage")."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import pipe
    from pipe import Pipe
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=1024, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 1024, (8, 64))
    mask = torch.ones_like(ids)
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False},
                        at=[f"model.layers.{layers // 2}"])
    piped = Pipe(stages, chunks=2, checkpoint="never", balance=[1, 1],
                 compile={"backend": backend, "unit": "block" if unit == "layer" else "stage"})

    def step() -> float:
        start = time.perf_counter()
        logits = piped(ids, mask)
        logits = logits[0] if isinstance(logits, tuple) else logits
        logits.float().square().mean().backward()
        return time.perf_counter() - start

    first = step()
    steps = [step() for _ in range(5)]
    return {"layers": layers, "unit": unit, "backend": backend, "first_step_s": round(first, 3),
            "step_s": round(statistics.median(steps), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--backends", nargs="+", default=["inductor", "aot_eager"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--one", nargs=3, metavar=("LAYERS", "UNIT", "BACKEND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1], args.one[2])))
        return
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    rows: list[dict[str, Any]] = []
    for run in range(args.runs):
        for backend in args.backends:
            for layers in args.layers:
                for unit in ("layer", "stage"):  # alternating within each run
                    done = subprocess.run([sys.executable, __file__, "--one", str(layers), unit, backend],
                                          capture_output=True, text=True, env=env, check=True)
                    row = {"run": run, **json.loads(done.stdout.strip().splitlines()[-1])}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    summary = []
    for backend in args.backends:
        for layers in args.layers:
            cell: dict[str, Any] = {"backend": backend, "layers": layers}
            for unit in ("layer", "stage"):
                mine = [r for r in rows if (r["backend"], r["layers"], r["unit"]) == (backend, layers, unit)]
                for key in ("first_step_s", "step_s"):
                    values = [r[key] for r in mine]
                    cell[f"{unit}_{key}"] = [min(values), statistics.median(values), max(values)]
            summary.append(cell)
            print(f"{backend:9s} {layers:2d} layers: first step a layer at a time "
                  f"{cell['layer_first_step_s'][1]:.1f} s ({cell['layer_first_step_s'][0]:.1f}-"
                  f"{cell['layer_first_step_s'][2]:.1f}), the whole stage {cell['stage_first_step_s'][1]:.1f} s "
                  f"({cell['stage_first_step_s'][0]:.1f}-{cell['stage_first_step_s'][2]:.1f}); step "
                  f"{cell['layer_step_s'][1] * 1e3:.1f} ms vs {cell['stage_step_s'][1] * 1e3:.1f} ms")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"runs": rows, "summary": summary}, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
