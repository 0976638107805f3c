"""pipe's figures on one CUDA GPU: P1, P3, P4, P6, offload, copy streams, compiled stages, a split GPT-2.

Every ratio is taken in one run, the configurations alternating round by
round (each round: ``repeat`` steps of each, the median kept); the JSON keeps
every round's ratio, and the figure is their median with the spread.

* P1: ``Pipe`` with one partition, ``chunks=1``, ``checkpoint="never"`` against
  the plain module's training step.
* P3: ``checkpoint="always"`` against ``"never"``, two partitions on the GPU, 8
  micro-batches.
* P4: the activation peak (``torch.cuda.max_memory_allocated`` above the level
  before the step) of ``"always"`` against ``"never"`` on a deep stack, K=2, M=8.
* P6: the recompute policies of ``benchmarks/recompute.py`` on its transformer
  blocks: step time, kept activation bytes (counted) and the GPU peak.
* offload: activations to pinned host memory with prefetch (``swap_config``):
  the GPU peak saved, the step time, and the share of the copies' time that
  ran while a kernel ran, read from the profiler's trace (device time of each
  memcpy intersected with the union of kernel intervals).
* offload sweep: ``Pipe`` on the transformer blocks with their first 0-8 layers
  offloading (``swap_config``'s ``layer_swap``), 1, 4 and 8 micro-batches:
  step time, the allocator's peak, the seconds until the step returns to the
  host (before the final synchronisation: when it returns as late as the
  GPU ends, the host was the bottleneck), the copies per step, and the
  kernels' and the copies' busy time from the profiler's trace.
* copy streams: a GPU partition feeding a CPU partition; from the profiler's
  trace, which streams the copies ran on and the share of their time hidden
  behind the GPU partition's kernels.
* compiled stages: ``Pipe(compile=True)`` (inductor) against eager on
  transformer blocks, for ``"never"`` and ``"except_last"``; the seconds the
  first step took, and frames compiled after it (0 expected).
* split GPT-2 (HuggingFace, ``pipe.split``): plain model, ``Pipe`` over two
  partitions on the GPU, eager and compiled.
* plan: ``pipe.plan`` on the GPU. The costs of ``benchmarks/recompute.py``'s
  transformer blocks are profiled on the GPU (``profile_costs(device=...)``);
  every one-partition candidate (chunks x checkpoint mode, and the selective
  recompute and offload plans the search derives for three budgets) is predicted, then run
  as ``Pipe`` on the GPU: its step time (the median of ``repeat`` steps) and
  its peak (``torch.cuda.max_memory_allocated`` less the batch's bytes, the
  parameters and gradients included, as ``param_scale=2`` predicts) beside the
  prediction.

Run (needs a CUDA GPU; a few minutes on an H100)::

    python benchmarks/gpu.py            # saves benchmarks/results/gpu-<device>.json
    python benchmarks/gpu.py --quick    # small sizes, a smoke run
"""
from __future__ import annotations

import argparse
import copy
import functools
import gzip
import json
import platform
import re
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

import pipe
from pipe import Pipe
from pipe.recompute import apply_recompute_config

import core
import real_models
import recompute
from thread_profile import _intersection, _length, _union

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DEVICE = torch.device("cuda", 0)


def sync() -> None:
    torch.cuda.synchronize(DEVICE)


def alternate(steps: dict[str, Callable[[], None]], rounds: int, repeat: int, warmup: int = 2
              ) -> dict[str, list[float]]:
    """Seconds per step of each configuration, per round (the median of ``repeat`` steps), in turn."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    per_round: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            per_round[name].append(median_step(step, repeat))
    return per_round


def median_step(step: Callable[[], None], repeat: int) -> float:
    """Seconds of ``step`` on the GPU, the median of ``repeat`` runs, synchronised around each."""
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ratio(rounds: dict[str, list[float]], num: str, den: str) -> dict[str, Any]:
    """``num``'s time over ``den``'s, per round: the median, min and max."""
    values = [a / b for a, b in zip(rounds[num], rounds[den])]
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def ms(rounds: dict[str, list[float]]) -> dict[str, float]:
    return {name: 1000 * statistics.median(values) for name, values in rounds.items()}


def trainer(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """One training step of ``model`` on ``x``, as the CPU figures take it (``recompute.train_step``)."""
    return functools.partial(recompute.train_step, model, x)


def peak_bytes(step: Callable[[], None]) -> int:
    """Bytes allocated above the level before a step, at the step's peak (a step runs first to warm up)."""
    step()
    sync()
    torch.cuda.reset_peak_memory_stats(DEVICE)
    base = torch.cuda.memory_allocated(DEVICE)
    step()
    sync()
    return torch.cuda.max_memory_allocated(DEVICE) - base


# -- P1, P3, P4 ------------------------------------------------------------------------------------

def p1_p3(size: dict[str, int], rounds: int, repeat: int) -> dict[str, Any]:
    x = torch.randn(size["batch"], size["width"], device=DEVICE)
    plain = core.mlp(size["width"], size["layers"]).to(DEVICE)
    layers = len(plain)
    one = Pipe(copy.deepcopy(plain), chunks=1, checkpoint="never", balance=[layers], devices=[str(DEVICE)])
    two = {mode: Pipe(copy.deepcopy(plain), chunks=8, checkpoint=mode, balance=[layers // 2, layers // 2],
                      devices=[str(DEVICE)] * 2) for mode in ("never", "always")}
    steps = {"plain": trainer(plain, x), "pipe_1_partition": trainer(one, x),
             "never_2x8": trainer(two["never"], x), "always_2x8": trainer(two["always"], x)}
    per_round = alternate(steps, rounds, repeat)
    return {"size": size, "step_ms": ms(per_round),
            "P1": {**ratio(per_round, "pipe_1_partition", "plain"), "target": "<= 1.05"},
            "P3": {**ratio(per_round, "always_2x8", "never_2x8"), "target": "<= 1.4"}}


def p4(size: dict[str, int]) -> dict[str, Any]:
    x = torch.randn(size["batch"], size["width"], device=DEVICE)
    out: dict[str, Any] = {"size": size}
    for mode in ("never", "always"):
        model = core.mlp(size["width"], size["layers"])
        half = len(model) // 2
        piped = Pipe(model, chunks=8, checkpoint=mode, balance=[half, half], devices=[str(DEVICE)] * 2)
        out[f"{mode}_peak_MiB"] = peak_bytes(trainer(piped, x)) / 2**20
        del piped, model
        torch.cuda.empty_cache()
    out["ratio"] = out["always_peak_MiB"] / out["never_peak_MiB"]
    out["target"] = "<= 0.35"
    return out


# -- P6 --------------------------------------------------------------------------------------------

def p6(size: dict[str, int], rounds: int, repeat: int) -> dict[str, Any]:
    plain = recompute.model(size).to(DEVICE)
    x = recompute.batch(size, DEVICE.type)
    models = recompute.policies(plain)
    for m in models.values():  # selective layers plan on their first two calls
        recompute.train_step(m, x)
        recompute.train_step(m, x)
    out: dict[str, Any] = {"size": size}
    for name, m in models.items():  # kept: counted, as the CPU figure (benchmarks/recompute.py) counts it
        out[name] = {"kept_MiB": recompute.memory(m, x)["kept_MiB"],
                     "gpu_peak_MiB": peak_bytes(trainer(m, x)) / 2**20, "max_grad_diff_vs_none": None}
    for m in models.values():
        recompute.train_step(m, x)
    for name, m in models.items():
        out[name]["max_grad_diff_vs_none"] = recompute.max_grad_diff(m, models["none"])
    per_round = alternate({name: trainer(m, x) for name, m in models.items()}, rounds, repeat)
    times = ms(per_round)
    for name in models:
        out[name]["step_ms"] = times[name]
        if name != "none":
            out[name]["time_ratio"] = ratio(per_round, name, "none")
            out[name]["kept_ratio"] = out[name]["kept_MiB"] / out["none"]["kept_MiB"]
            out[name]["gpu_peak_ratio"] = out[name]["gpu_peak_MiB"] / out["none"]["gpu_peak_MiB"]
            out[name]["meets_target"] = bool(out[name]["time_ratio"]["median"] <= 1.10
                                             and out[name]["kept_ratio"] <= 0.70)
    out["target"] = "time_ratio <= 1.10 and kept_ratio <= 0.70"
    out["met_by"] = [name for name in models if name != "none" and out[name]["meets_target"]]
    return out


# -- the profiler's trace: copies against kernels ---------------------------------------------------

def traced_copies(step: Callable[[], None], keep: Optional[Path] = None) -> dict[str, Any]:
    """Runs ``step`` under the profiler; the copies' device time and the share of it under a kernel."""
    from torch.profiler import ProfilerActivity, profile

    step()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
        if keep is not None:  # gzipped: a step's trace is tens of MB
            keep.write_bytes(gzip.compress(path.read_bytes()))
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    union = _union(kernels)
    out: dict[str, Any] = {"kernels": len(kernels), "kernel_ms": _length(union) / 1000}
    by_kind: dict[str, dict[str, Any]] = {}
    for e in copies:
        kind = re.sub(r"\s*\(.*", "", e["name"]).replace("Memcpy ", "")  # DtoH, HtoD, DtoD
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        entry = by_kind.setdefault(kind, {"count": 0, "ms": 0.0, "under_kernel_ms": 0.0, "streams": set()})
        entry["count"] += 1
        entry["ms"] += (end - start) / 1000
        entry["under_kernel_ms"] += _intersection([(start, end)], union) / 1000
        entry["streams"].add(e.get("args", {}).get("stream"))
    kernel_streams = sorted({e.get("args", {}).get("stream") for e in events if e.get("cat") == "kernel"},
                            key=str)
    for entry in by_kind.values():
        entry["hidden_share"] = entry["under_kernel_ms"] / entry["ms"] if entry["ms"] else None
        entry["streams"] = sorted(entry["streams"], key=str)
    total = sum(e["ms"] for e in by_kind.values())
    out.update(copies=by_kind, kernel_streams=kernel_streams, copy_ms=total,
               hidden_share=sum(e["under_kernel_ms"] for e in by_kind.values()) / total if total else None)
    return out


def offload(size: dict[str, int], rounds: int, repeat: int, trace: Path) -> dict[str, Any]:
    plain = recompute.model(size).to(DEVICE)
    x = recompute.batch(size, DEVICE.type)
    swapped = copy.deepcopy(plain)
    strategy = apply_recompute_config(swapped, {"swap_config": {"swap": True, "default_prefetch": 1}})
    offloader = strategy.offloaders[0]
    if offloader is None:
        raise RuntimeError("swap_config made no offloader")
    peaks = {"none": peak_bytes(trainer(plain, x)) / 2**20, "offload": peak_bytes(trainer(swapped, x)) / 2**20}
    before = offloader.offloaded_bytes
    trainer(swapped, x)()
    per_step = offloader.offloaded_bytes - before
    recompute.train_step(plain, x)
    diff = recompute.max_grad_diff(swapped, plain)
    per_round = alternate({"none": trainer(plain, x), "offload": trainer(swapped, x)}, rounds, repeat)
    return {"size": size, "gpu_peak_MiB": peaks, "peak_ratio": peaks["offload"] / peaks["none"],
            "offloaded_MiB_per_step": per_step / 2**20, "max_grad_diff_vs_none": diff,
            "step_ms": ms(per_round), "time_ratio": ratio(per_round, "offload", "none"),
            "trace": traced_copies(trainer(swapped, x), trace)}


def _mse_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> None:
    import torch.nn.functional as F

    model.zero_grad(set_to_none=True)
    F.mse_loss(model(x), target).backward()


def _warm_peak(step: Callable[[], None], base: int) -> int:
    """The allocator's peak bytes above ``base`` during the third of three steps (two warm up)."""
    step()
    step()
    sync()
    torch.cuda.reset_peak_memory_stats(DEVICE)
    step()
    sync()
    return torch.cuda.max_memory_allocated(DEVICE) - base


def offload_sweep(size: dict[str, int], repeat: int) -> dict[str, Any]:
    """Offloading the first layers of one partition: what it costs in time and host work, and saves."""
    model = recompute.model(size)
    x = recompute.batch(size, DEVICE.type)
    target = torch.zeros_like(x)
    rows: list[dict[str, Any]] = []
    for chunks in (1, 4, 8):
        for layers in (0, 2, 4, 6, 8):
            config = {"swap_config": {"swap": True, "layer_swap": [{"backward_prefetch": 1,
                                                                    "layers": list(range(layers))}]}}
            sync()
            base = torch.cuda.memory_allocated(DEVICE)
            piped = Pipe(copy.deepcopy(model).to(DEVICE), devices=[str(DEVICE)], chunks=chunks, checkpoint="never",
                         balance=[size["layers"]], **({"recompute": config} if layers else {}))
            step = functools.partial(_mse_step, piped, x, target)
            peak = _warm_peak(step, base)
            strategy = piped.recompute_strategy
            offloaders = [o for o in (strategy.offloaders if strategy else []) if o is not None]
            copies = sum(o.offloaded_copies for o in offloaders)
            walls, returns = [], []
            for _ in range(repeat):
                sync()
                start = time.perf_counter()
                step()
                returns.append(time.perf_counter() - start)
                sync()
                walls.append(time.perf_counter() - start)
            traced = traced_copies(step)
            rows.append({"chunks": chunks, "offloaded_layers": layers, "step_ms": 1000 * statistics.median(walls),
                         "returned_ms": 1000 * statistics.median(returns), "peak_MiB": peak / 2**20,
                         "copies_per_step": (sum(o.offloaded_copies for o in offloaders) - copies) / repeat,
                         "kernel_ms": traced["kernel_ms"], "copy_ms": traced["copy_ms"],
                         "copies_hidden_share": traced["hidden_share"]})
            print(rows[-1], flush=True)
            del step, piped
            torch.cuda.empty_cache()
    return {"size": size, "rows": rows}


def copy_streams(size: dict[str, int], trace: Path) -> dict[str, Any]:
    """A GPU partition then a CPU one: micro-batch i's copy to the host against micro-batch i+1's kernels."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(size["layers"]):
        layers += [nn.Linear(size["width"], size["width"]), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Tanh())
    piped = Pipe(model, chunks=size["chunks"], checkpoint="never", balance=[len(layers), 1],
                 devices=[str(DEVICE), "cpu"])
    x = torch.randn(size["batch"], size["width"], device=DEVICE)
    return {"size": size, **traced_copies(trainer(piped, x), trace)}


# -- compiled stages, and a real model -------------------------------------------------------------

def _frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# compile= needs torch >= 2.13 (pipe/compile.py says why); below it the figures are taken eager only.
COMPILES = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"
NO_COMPILE = f"compile= needs torch >= 2.13; this is torch {torch.__version__}"


def compiled(size: dict[str, int], rounds: int, repeat: int) -> dict[str, Any]:
    if not COMPILES:
        return {"size": size, "skipped": NO_COMPILE}
    plain = recompute.model(size)
    x = recompute.batch(size, DEVICE.type)
    half = size["layers"] // 2
    out: dict[str, Any] = {"size": size}
    for mode in ("never", "except_last"):
        eager = Pipe(copy.deepcopy(plain), chunks=4, checkpoint=mode, balance=[half, half],
                     devices=[str(DEVICE)] * 2)
        fast = Pipe(copy.deepcopy(plain), chunks=4, checkpoint=mode, balance=[half, half],
                    devices=[str(DEVICE)] * 2, compile=True)
        start = time.perf_counter()
        trainer(fast, x)()
        sync()
        first = time.perf_counter() - start
        trainer(fast, x)()
        frames = _frames()
        per_round = alternate({"eager": trainer(eager, x), "compiled": trainer(fast, x)}, rounds, repeat)
        out[mode] = {"step_ms": ms(per_round), "compiled_vs_eager": ratio(per_round, "eager", "compiled"),
                     "first_step_s": first, "frames_compiled_after_step_2": _frames() - frames}
    return out


def gpt2(size: dict[str, int], rounds: int, repeat: int) -> dict[str, Any]:
    ids, mask, labels = (t.to(DEVICE) for t in real_models.batch(size))
    cut = [f"transformer.h.{size['layers'] // 2}"]
    kwargs = {"attention_mask": mask, "use_cache": False}
    plain = real_models.build(size).to(DEVICE)
    piped = {name: Pipe(pipe.split(real_models.build(size).to(DEVICE), (ids,), kwargs, at=cut), chunks=4,
                        checkpoint="never", balance=[1, 1], devices=[str(DEVICE)] * 2, compile=option)
             for name, option in (("pipe_eager", False), ("pipe_compiled", True)) if option is False or COMPILES}

    def plain_step() -> None:
        plain.zero_grad(set_to_none=True)
        real_models.lm_loss(plain(ids, attention_mask=mask).logits, labels).backward()

    def piped_step(model: Pipe) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            real_models.lm_loss(model(ids, mask), labels).backward()
        return step

    plain_step()
    piped_step(piped["pipe_eager"])()
    # By name: a Pipe's parameters come partition by partition (the tied head first), not in the plain order.
    named = dict(plain.named_parameters(remove_duplicate=False))
    pairs = [(p, named[name.split(".", 1)[1]]) for name, p in piped["pipe_eager"].named_parameters()]
    same = max((p.grad - q.grad).abs().max().item() for p, q in pairs)
    relative = max(((p.grad - q.grad).norm() / q.grad.norm()).item() for p, q in pairs)
    per_round = alternate({"plain": plain_step, **{k: piped_step(v) for k, v in piped.items()}}, rounds, repeat)
    out = {"size": size, "step_ms": ms(per_round), "max_grad_diff_eager_vs_plain": same,
           "max_relative_grad_diff_eager_vs_plain": relative,
           "pipe_eager_vs_plain": ratio(per_round, "plain", "pipe_eager")}
    if not COMPILES:
        return dict(out, compiled=NO_COMPILE)
    return dict(out, pipe_compiled_vs_plain=ratio(per_round, "plain", "pipe_compiled"),
                pipe_compiled_vs_eager=ratio(per_round, "pipe_eager", "pipe_compiled"))


def _run_planned(model: nn.Module, c: Any, x: torch.Tensor, target: torch.Tensor, repeat: int
                 ) -> tuple[float, int, int]:
    """Seconds per step (median), and the allocator's peak bytes above the level before the ``Pipe`` was
    built (parameters, gradients and activations), of candidate ``c`` run on the GPU; and that level."""
    sync()
    base = torch.cuda.memory_allocated(DEVICE)
    piped = Pipe(copy.deepcopy(model).to(DEVICE), devices=[str(DEVICE)], chunks=c.chunks, checkpoint=c.checkpoint,
                 balance=list(c.balance), **({"recompute": c.recompute_config()} if c.recompute_config() else {}))
    step = functools.partial(_mse_step, piped, x, target)
    peak = _warm_peak(step, base)
    return median_step(step, repeat), peak, base


def plan_on_gpu(size: dict[str, int], repeat: int) -> dict[str, Any]:
    """The planner's predicted step and peak against the allocator's, one partition on the GPU."""
    import torch.nn.functional as F

    from pipe.plan import profile_costs
    from pipe.plan.candidates import candidates, per_stage_offload, per_stage_recompute
    from pipe.plan.predict import predict

    model = recompute.model(size)
    x = recompute.batch(size, DEVICE.type)
    target = torch.zeros_like(x)
    start = time.perf_counter()
    costs = profile_costs(model, x, (1, 2, 4, 8), device=DEVICE, loss_fn=F.mse_loss, target=target, stages=1)
    profile_s = time.perf_counter() - start
    plans = candidates(costs, 1, "threads")
    for budget in (0.4, 0.6, 0.8):  # selective recompute and offload plans between the uniform modes' peaks
        for c in list(plans):
            if c.checkpoint == "never" and not any(c.offload):
                bytes_ = int(budget * predict(costs, c, timeline=False).peak)
                offloaded = per_stage_offload(costs, c, [bytes_]) if not c.recompute and not c.offload else None
                for marked in (per_stage_recompute(costs, c, [bytes_]), offloaded):
                    if marked is not None and marked not in plans:
                        plans.append(marked)
    rows: list[dict[str, Any]] = []
    for c in plans:
        predicted = predict(costs, c, timeline=False)
        measured, peak, base = _run_planned(model, c, x, target, repeat)
        rows.append({"plan": c.describe(), "predicted_ms": 1000 * predicted.step_time, "measured_ms": 1000 * measured,
                     "step_error": predicted.step_time / measured - 1,
                     "predicted_peak_MiB": predicted.peak / 2**20, "measured_peak_MiB": peak / 2**20,
                     "peak_error": predicted.peak / peak - 1, "allocated_before_MiB": base / 2**20})
    # The plain model on this thread: the allocator's peak against the dispatch-level count the profile uses.
    from pipe.recompute import ActivationMemory

    plain = copy.deepcopy(model).to(DEVICE)
    F.mse_loss(plain(x), target).backward()
    plain.zero_grad(set_to_none=True)
    sync()
    base = torch.cuda.memory_allocated(DEVICE)
    torch.cuda.reset_peak_memory_stats(DEVICE)
    with ActivationMemory() as counter:
        F.mse_loss(plain(x), target).backward()
        sync()
    allocator = torch.cuda.max_memory_allocated(DEVICE) - base
    plain_check = {"allocator_peak_MiB": allocator / 2**20, "counted_peak_MiB": counter.peak_bytes / 2**20}
    del plain
    offloading = [r for r in rows if "offload=" in r["plan"]]
    return {"size": size, "profile_s": profile_s, "plain_step": plain_check, "plans": rows,
            "host_copy": costs.host_copy.describe() if costs.host_copy else None,
            "offload_step_error_worst": max((abs(r["step_error"]) for r in offloading), default=None),
            "offload_peak_error_worst": max((abs(r["peak_error"]) for r in offloading), default=None),
            "step_error_worst": max(abs(r["step_error"]) for r in rows),
            "step_error_median": statistics.median(abs(r["step_error"]) for r in rows),
            "peak_error_worst": max(abs(r["peak_error"]) for r in rows),
            "peak_error_median": statistics.median(abs(r["peak_error"]) for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    parser.add_argument("--only", help="comma-separated subset of P1_P3,P4,P6,offload,offload_sweep,copy_streams,"
                                       "compiled,gpt2,plan")
    parser.add_argument("--out", type=Path, help="folder for the JSON and the traces (default benchmarks/results)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    name = torch.cuda.get_device_name(DEVICE)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    folder = args.out or RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    q = args.quick
    rounds, repeat = (3, 3) if q else (5, 5)
    sizes = {
        "P1_P3": {"width": 512, "layers": 8, "batch": 1024} if q else {"width": 2048, "layers": 8, "batch": 8192},
        "P4": {"width": 512, "layers": 16, "batch": 1024} if q else {"width": 1024, "layers": 64, "batch": 8192},
        "P6": {"width": 256, "heads": 4, "seq": 256, "batch": 4, "layers": 2} if q else
              {"width": 1024, "heads": 16, "seq": 1024, "batch": 8, "layers": 8},
        "copy_streams": {"width": 512, "layers": 4, "batch": 2048, "chunks": 4} if q else
                        {"width": 2048, "layers": 8, "batch": 16384, "chunks": 8},
        "gpt2": {"width": 256, "layers": 4, "seq": 128, "batch": 8} if q else
                {"width": 768, "layers": 12, "seq": 1024, "batch": 8},
    }
    figures: dict[str, Callable[[], dict[str, Any]]] = {
        "P1_P3": lambda: p1_p3(sizes["P1_P3"], rounds, repeat),
        "P4": lambda: p4(sizes["P4"]),
        "P6": lambda: p6(sizes["P6"], rounds, repeat),
        "offload": lambda: offload(sizes["P6"], rounds, repeat, folder / f"gpu-{slug}-offload-trace.json.gz"),
        "offload_sweep": lambda: offload_sweep(sizes["P6"], repeat),
        "copy_streams": lambda: copy_streams(sizes["copy_streams"], folder / f"gpu-{slug}-copy-trace.json.gz"),
        "compiled": lambda: compiled(sizes["P6"], rounds, repeat),
        "gpt2": lambda: gpt2(sizes["gpt2"], rounds, repeat),
        "plan": lambda: plan_on_gpu(sizes["P6"], repeat),
    }
    wanted = args.only.split(",") if args.only else list(figures)
    results: dict[str, Any] = {
        "machine": {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
                    "capability": ".".join(map(str, torch.cuda.get_device_capability(DEVICE))),
                    "memory_GiB": torch.cuda.get_device_properties(DEVICE).total_memory / 2**30,
                    "python": platform.python_version(), "tf32_matmul": torch.backends.cuda.matmul.allow_tf32},
        "quick": q, "rounds": rounds, "repeat": repeat,
    }
    out = folder / f"gpu-{slug}{'-quick' if q else ''}.json"
    for key in wanted:
        start = time.perf_counter()
        try:
            results[key] = figures[key]()
        except Exception as error:  # one figure failing must not lose the others: the JSON says why
            results[key] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        results[key]["seconds"] = time.perf_counter() - start
        print(key, json.dumps(results[key], indent=1, default=str)[:4000], flush=True)
        torch.cuda.empty_cache()
        out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
