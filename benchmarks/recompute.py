"""P6: selective recompute vs none vs full on transformer blocks; full-by-config vs checkpoint="always".

Every figure is a ratio of two measurements taken in this one run, printed and
saved to benchmarks/results/recompute.json (recompute-quick.json with --quick).

- Activation memory is counted, not sampled: pipe.recompute.ActivationMemory
  adds the bytes of every storage an op creates and subtracts them when freed,
  so "kept" (after forward, what backward will use) and "peak" (forward and
  backward) are exact and independent of timing and of the allocator. The
  GPU figures, offload to host memory among them, are benchmarks/gpu.py's.
- Step time is the median of interleaved repeats (none, selective, full, ...
  in turn) to cancel drift on a shared machine.

The blocks are pre-LN transformer blocks with explicit softmax attention
(q @ k^T, softmax, @ v) and a GELU MLP: what Megatron's "selective" recompute
targets. Selective = the config's default selection (select_recompute: True:
GELU, SiLU, softmax of every layer); selective_softmax and selective_gelu choose
one op kind each, so the trade-off of each is its own row.

Where the extra time goes: "fixed_overhead" times the same policies on blocks so
small (d=32, T=8) that their arithmetic is negligible, so each policy's step
time minus no recompute's is the per-step cost of the machinery itself (Python
dispatch of every op through selective checkpointing's modes, the checkpoint's
hooks), which does not shrink with the layer's FLOPs; "share_of_none_step" puts
it against the full-size step of no recompute.

Run:
    python benchmarks/recompute.py            # full sizes, a few minutes on 2 cores
    python benchmarks/recompute.py --quick    # small sizes, well under a minute

Target (P6): selective costs at most 1.10x the step time of no recompute for at
least 30% less activation memory.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from pipe import Pipe
from pipe.recompute import ActivationMemory, apply_recompute_config

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=-1)  # 3 x [B, T, D]
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D/H]
        probs = ((q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5).softmax(-1)  # [B, H, T, T]
        return self.proj((probs @ v).transpose(1, 2).reshape(B, T, D))  # [B, T, D]


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def model(size: dict[str, int], seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(size["width"], size["heads"]) for _ in range(size["layers"])])


def batch(size: dict[str, int], device: str = "cpu") -> torch.Tensor:
    return torch.randn(size["batch"], size["seq"], size["width"], device=device,
                       generator=torch.Generator(device).manual_seed(1))


def train_step(m: nn.Module, x: torch.Tensor) -> None:
    m.zero_grad(set_to_none=True)
    m(x).square().mean().backward()


def memory(m: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """Counted activation bytes: kept after forward (output excluded) and peak over the step."""
    m.zero_grad(set_to_none=True)
    with ActivationMemory() as counter:
        y = m(x)
        kept = counter.live_bytes - y.untyped_storage().nbytes()
        y.square().mean().backward()
        del y
    return {"kept_MiB": kept / 2**20, "peak_MiB": counter.peak_bytes / 2**20}


def interleaved_times(models: dict[str, nn.Module], x: torch.Tensor, rounds: int, repeat: int,
                      sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Median step seconds per model, measured in turn to cancel drift."""
    samples: dict[str, list[float]] = {name: [] for name in models}
    for name, m in models.items():  # warm-up, and the selective layers' plans
        train_step(m, x)
        train_step(m, x)
    for _ in range(rounds):
        for name, m in models.items():
            for _ in range(repeat):
                sync()
                start = time.perf_counter()
                train_step(m, x)
                sync()
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def max_grad_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p.grad - q.grad).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


# -- P6 ---------------------------------------------------------------------------------------

POLICIES: dict[str, Optional[dict[str, Any]]] = {
    "none": None,
    "selective": {"select_recompute": True},                        # softmax and GELU
    "selective_softmax": {"select_recompute": [r"(.*\.)?softmax"]},
    "selective_gelu": {"select_recompute": [r"(.*\.)?gelu"]},
    "full": {"recompute": True},
}


def policies(plain: nn.Module) -> dict[str, nn.Module]:
    """A copy of ``plain`` per policy, marked by its config."""
    models: dict[str, nn.Module] = {}
    for name, config in POLICIES.items():
        models[name] = copy.deepcopy(plain)
        if config is not None:
            apply_recompute_config(models[name], config)
    return models


def p6(size: dict[str, int], rounds: int, repeat: int) -> dict[str, Any]:
    plain = model(size)
    x = batch(size)
    models = policies(plain)
    for m in models.values():
        # The first call of a selective layer runs plainly to plan; the second, where the plan
        # narrows to submodules, plans those.
        train_step(m, x)
        train_step(m, x)
    mem = {name: memory(m, x) for name, m in models.items()}
    for m in models.values():
        train_step(m, x)
    same = {name: max_grad_diff(m, models["none"]) for name, m in models.items()}
    times = interleaved_times(models, x, rounds, repeat)
    out: dict[str, Any] = {}
    for name in models:
        out[name] = {"step_ms": 1000 * times[name], **mem[name], "max_grad_diff_vs_none": same[name]}
        if name != "none":
            out[name]["time_ratio"] = times[name] / times["none"]
            out[name]["kept_ratio"] = mem[name]["kept_MiB"] / mem["none"]["kept_MiB"]
            out[name]["peak_ratio"] = mem[name]["peak_MiB"] / mem["none"]["peak_MiB"]
            out[name]["meets_target"] = bool(out[name]["time_ratio"] <= 1.10 and out[name]["kept_ratio"] <= 0.70)
    out["target"] = "time_ratio <= 1.10 and kept_ratio <= 0.70"
    out["met"] = out["selective"]["meets_target"]
    out["met_by"] = [name for name in models if name != "none" and out[name]["meets_target"]]
    return out


def fixed_overhead(rounds: int, repeat: int, none_step_ms: float) -> dict[str, Any]:
    """Per-step cost of each policy's machinery, on blocks whose arithmetic is negligible."""
    tiny = {"width": 32, "heads": 2, "seq": 8, "batch": 1, "layers": 4}
    models = policies(model(tiny))
    x = batch(tiny)
    for m in models.values():
        train_step(m, x)
    times = interleaved_times(models, x, rounds * 2, repeat * 10)
    return {name: {"overhead_ms": 1000 * (times[name] - times["none"]),
                   "share_of_none_step": 1000 * (times[name] - times["none"]) / none_step_ms}
            for name in models if name != "none"}


# -- full recompute through the config vs checkpoint="always" -------------------------------------

def consistency(size: dict[str, int], rounds: int, repeat: int) -> dict[str, Any]:
    plain = model(size)
    x = batch(size)
    by_config = Pipe(copy.deepcopy(plain), chunks=1, checkpoint="never", devices=["cpu"] * 1,
                     balance=[len(plain)], recompute={"recompute": True})
    by_pipe = Pipe(copy.deepcopy(plain), chunks=1, checkpoint="always", devices=["cpu"], balance=[len(plain)])
    never = Pipe(copy.deepcopy(plain), chunks=1, checkpoint="never", devices=["cpu"], balance=[len(plain)])
    models = {"config_full": by_config, "checkpoint_always": by_pipe, "never": never}
    for m in models.values():
        train_step(m, x)
    times = interleaved_times(models, x, rounds, repeat)
    out = {
        "step_ms": {name: 1000 * t for name, t in times.items()},
        "config_full_over_checkpoint_always": times["config_full"] / times["checkpoint_always"],
        "config_full_over_never": times["config_full"] / times["never"],
        "checkpoint_always_over_never": times["checkpoint_always"] / times["never"],
        "max_grad_diff_config_full_vs_checkpoint_always": max_grad_diff(by_config, by_pipe),
        "max_grad_diff_config_full_vs_never": max_grad_diff(by_config, never),
    }
    for m in models.values():
        m.close()
    return out


# -- offload on a GPU -----------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = parser.parse_args()
    if args.quick:
        size = {"width": 128, "heads": 4, "seq": 128, "batch": 4, "layers": 2}
        rounds, repeat = 3, 2
    else:
        size = {"width": 512, "heads": 8, "seq": 256, "batch": 4, "layers": 4}
        rounds, repeat = 5, 3
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "threads": torch.get_num_threads(), "cuda": torch.cuda.is_available()},
        "quick": args.quick,
        "size": size,
    }
    results["P6"] = p6(size, rounds, repeat)
    print("P6", json.dumps(results["P6"], indent=2))
    results["fixed_overhead"] = fixed_overhead(rounds, repeat, results["P6"]["none"]["step_ms"])
    print("fixed_overhead", json.dumps(results["fixed_overhead"], indent=2))
    results["full_config_vs_checkpoint_always"] = consistency(size, rounds, repeat)
    print("full_config_vs_checkpoint_always", json.dumps(results["full_config_vs_checkpoint_always"], indent=2))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("recompute-quick.json" if args.quick else "recompute.json")
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"saved {out.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
