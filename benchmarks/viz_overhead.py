"""The cost of pipe.trace: a training step with recording on over one with it off.

A small Pipe (two CPU partitions of Linear+Tanh blocks, 4 micro-batches,
checkpoint="except_last") runs training steps alternately with recording off
and on; the median step times give the on/off ratio. Because that ratio is at
the mercy of machine noise, the hooks are also timed directly: the calls one
recorded step makes (spans, and two calls per hooked autograd node, counted
in a real step), and the no-op calls a step makes when recording is off, each
over the step time.

Every figure is a ratio of measurements taken in this run, printed and saved
to benchmarks/results/viz_overhead.json (viz_overhead-quick.json with --quick).

Run:
    python benchmarks/viz_overhead.py            # about a minute on 2 cores
    python benchmarks/viz_overhead.py --quick    # a few seconds
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipe import Pipe, trace
from pipe.trace.recorder import _Backward

RESULTS = Path(__file__).resolve().parent / "results"


def mlp(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    modules: list[nn.Module] = []
    for _ in range(layers):
        modules += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*modules)


def step(model: Pipe, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()


def time_steps(model: Pipe, x: torch.Tensor, record: bool) -> float:
    start = time.perf_counter()
    if record:
        with trace.record():
            step(model, x)
    else:
        step(model, x)
    return time.perf_counter() - start


def off_path_cost(cells: int, repeats: int) -> float:
    """Seconds the no-op hooks of one step take: a span and a watch_backward per cell, twice over."""
    assert trace.active() is None
    inputs: list[torch.Tensor] = []
    start = time.perf_counter()
    for _ in range(repeats):
        for _ in range(cells):
            with trace.span("forward", (0, 0)):
                pass
            with trace.span("recompute", (0, 0)):
                pass
            with trace.span("backward", (0, 0)):
                pass
            trace.watch_backward(inputs, inputs, (0, 0))
    return (time.perf_counter() - start) / repeats


def on_path_cost(spans: int, nodes: int, repeats: int) -> float:
    """Seconds the recording hooks of one step take: ``spans`` spans and ``nodes`` node hook pairs."""
    with trace.record() as recorder:
        backward = _Backward((0, 0), recorder._ticks)
        start = time.perf_counter()
        for _ in range(repeats):
            for _ in range(spans):
                with trace.span("forward", (0, 0)):
                    pass
            for _ in range(nodes):
                backward.begin(None)
                backward.finish(None, None)
            recorder._events.clear()
            backward.segments.clear()
        return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few steps")
    args = parser.parse_args()
    width, layers, batch, steps = (64, 8, 32, 10) if args.quick else (256, 16, 128, 40)
    chunks = 4
    model = Pipe(mlp(width, layers), chunks=chunks, checkpoint="except_last",
                 balance=[layers, layers], devices=["cpu", "cpu"])
    x = torch.randn(batch, width)
    for _ in range(3):  # warm up both paths
        time_steps(model, x, False)
        time_steps(model, x, True)
    off, on = [], []
    for _ in range(steps):  # alternate so that machine noise hits both alike
        off.append(time_steps(model, x, False))
        on.append(time_steps(model, x, True))
    with trace.record() as recorder:
        step(model, x)
    spans = len(recorder._events)
    nodes = recorder.hooked_nodes
    model.close()
    off_median, on_median = statistics.median(off), statistics.median(on)
    cells = chunks * 2
    hooks = off_path_cost(cells, 2000)
    recording = on_path_cost(spans, nodes, 200)
    result: dict[str, Any] = {
        "config": {"width": width, "layers_per_partition": layers, "batch": batch, "chunks": chunks,
                   "partitions": 2, "checkpoint": "except_last", "steps": steps, "quick": args.quick},
        "step_ms_off": off_median * 1e3,
        "step_ms_on": on_median * 1e3,
        "on_over_off": on_median / off_median,
        "off_hooks_us_per_step": hooks * 1e6,
        "off_hooks_share_of_step": hooks / off_median,
        "on_spans_per_step": spans,
        "on_hooked_nodes_per_step": nodes,
        "on_hooks_us_per_step": recording * 1e6,
        "on_hooks_share_of_step": recording / off_median,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }
    print(f"step with recording off: {result['step_ms_off']:.2f} ms, on: {result['step_ms_on']:.2f} ms "
          f"-> on/off = {result['on_over_off']:.3f}")
    print(f"recording hooks when on ({spans} spans, {nodes} autograd nodes): "
          f"{result['on_hooks_us_per_step']:.1f} us per step = {result['on_hooks_share_of_step']:.3%} of a step")
    print(f"no-op hooks when off: {result['off_hooks_us_per_step']:.1f} us per step = "
          f"{result['off_hooks_share_of_step']:.4%} of a step")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("viz_overhead-quick.json" if args.quick else "viz_overhead.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
