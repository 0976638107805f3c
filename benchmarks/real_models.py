"""R1: step time of a real model through pipe.split + Pipe vs the plain model (GPT-2-style, HuggingFace).

A random-init ``GPT2LMHeadModel`` (tied embeddings, padded batches with an
attention mask) is cut in the middle with ``pipe.split`` and run by ``Pipe`` on
2 CPU partitions, with

* the default settings: ``Pipe(stages, balance=[1, 1], devices=["cpu", "cpu"])``
  (chunks=1, checkpoint="except_last", cpu_threads = threads / 2), and
* the fastest settings found among chunks 2/4/8 with checkpoint "never",
  one intra-op thread per worker,

against the plain model on one and on two intra-op threads. A step is forward,
next-token loss and backward. Configurations alternate step by step, so the
drift of a shared machine hits them alike; each figure is a median, and every
ratio is taken from this one run. Printed, and saved to
benchmarks/results/real_models.json.

Run:
    python benchmarks/real_models.py            # ~1 minute on 2 quiet cores
    python benchmarks/real_models.py --quick    # tiny sizes, a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import pipe
from pipe import Pipe

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
VOCAB = 512


def build(size: dict[str, int]) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=size["seq"], n_embd=size["width"], n_layer=size["layers"],
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def batch(size: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (size["batch"], size["seq"]), generator=generator)
    lengths = torch.randint(size["seq"] // 2, size["seq"] + 1, (size["batch"],), generator=generator)
    mask = (torch.arange(size["seq"]).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return ids * mask, mask, (ids * mask).masked_fill(mask == 0, -100)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100)


def stepper(model: nn.Module, plain: bool, data: tuple[torch.Tensor, ...], threads: int) -> Callable[[], float]:
    ids, mask, labels = data

    def step() -> float:
        torch.set_num_threads(threads)
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        logits = model(ids, attention_mask=mask).logits if plain else model(ids, mask)
        lm_loss(logits, labels).backward()
        return time.perf_counter() - start

    return step


def measure(steps: dict[str, Callable[[], float]], warmup: int, repeat: int) -> dict[str, float]:
    """Median seconds per step of each configuration, steps alternating between them."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeat):
        for name, step in steps.items():
            times[name].append(step())
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    args = parser.parse_args()
    if args.quick:
        size = {"layers": 2, "width": 64, "seq": 32, "batch": 8}
        warmup, repeat, grid = 1, 3, [2]
    else:
        size = {"layers": 4, "width": 256, "seq": 64, "batch": 16}
        warmup, repeat, grid = 2, 9, [2, 4, 8]
    load_before = os.getloadavg()[0]
    data = batch(size)
    plain = build(size)
    model = build(size)
    stages = pipe.split(model, (data[0],), {"attention_mask": data[1], "use_cache": False},
                        at=[f"transformer.h.{size['layers'] // 2}"])

    torch.set_num_threads(2)
    default = Pipe(stages, balance=[1, 1], devices=["cpu", "cpu"])  # chunks=1, except_last, cpu_threads 2 // 2
    candidates = {chunks: Pipe(stages, chunks=chunks, checkpoint="never", balance=[1, 1], devices=["cpu", "cpu"],
                               cpu_threads=1) for chunks in grid}
    # Pick the fastest candidate first (a short alternating run), then measure it against the rest.
    tried = measure({f"chunks={c}": stepper(p, False, data, 1) for c, p in candidates.items()}, 1, 3)
    best = min(candidates, key=lambda c: tried[f"chunks={c}"])
    steps = {
        "plain_1thread": stepper(plain, True, data, 1),
        "plain_2threads": stepper(plain, True, data, 2),
        "pipe_default": stepper(default, False, data, 2),
        "pipe_fastest": stepper(candidates[best], False, data, 1),
    }
    seconds = measure(steps, warmup, repeat)
    for piped in [default, *candidates.values()]:
        piped.close()
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine()},
        "quick": args.quick,
        # Runnable threads on the machine (1-minute load average) before and after: above the core count,
        # other processes took cores from the configurations that need two at once.
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "model": f"GPT2LMHeadModel(n_layer={size['layers']}, n_embd={size['width']}, n_head=4, vocab={VOCAB}), "
                 f"batch {size['batch']} x {size['seq']} tokens, padded, tied embeddings",
        "size": size,
        "fastest_settings": {"chunks": best, "checkpoint": "never", "cpu_threads": 1, "grid": grid, "tried_s": tried},
        "default_settings": {"chunks": 1, "checkpoint": "except_last", "cpu_threads": 1},
        "seconds": seconds,
        "speedup": {
            f"{p}_vs_{q}": seconds[q] / seconds[p]
            for p in ("pipe_default", "pipe_fastest") for q in ("plain_1thread", "plain_2threads")
        },
    }
    print(json.dumps(result, indent=2))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("real_models-quick.json" if args.quick else "real_models.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
