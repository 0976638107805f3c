"""How close the layer profile comes to a stage's own times: profiled sums over a stage's layers / the stage timed whole.

The planner and the time balancer add up per-layer times measured by
pipe.balance.time_layers; a stage runs those layers as one module. For two
stages of the planner benchmark's models (benchmarks/planner.py budget), on one
thread:

- the MLP's layers 8-15 (four 512-wide Linear layers and their Tanh) on 8
  rows, a micro-batch of 8 chunks, where layers are small and per-call costs
  and cold caches weigh most;
- the transformer's blocks 1-3 on 4 sequences of 64 tokens;

each repeat profiles the layers (time_layers with the I/W split and the
recompute marks, as pipe.plan.profile_costs does) and then times the stage
whole: forward and backward (the fastest of 15), the stage with every layer
marked for recompute (replay = marked less plain), and its backward split
into I and W (pipe.core.iw_backward.IWBackward). Reported per phase: the
profiled sum over the stage's own time, the median over repeats and its
range. 1.0 is a profile that adds up to the stage.

Each repeat runs in a fresh process; ``--baseline DIR`` profiles with pipe
from another checkout too (``PYTHONPATH=DIR``), in turn with this one, so
that both profiles meet the same machine. Every ratio is taken within one
run; printed and saved to benchmarks/results/profile_fidelity.json
(profile_fidelity-quick.json with --quick).

Run:
    python benchmarks/planner.py fidelity                        # about 30 s on 2 cores
    python benchmarks/planner.py fidelity --baseline ../old-pipe  # and another checkout, in turn
    python benchmarks/planner.py fidelity --quick                 # 2 repeats
"""
from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

HERE = Path(__file__).resolve().parent.parent  # benchmarks/
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

import planner_bench.budget as models  # noqa: E402  (the planner benchmark's models)
from pipe.balance import time_layers  # noqa: E402
from pipe.core.iw_backward import IWBackward  # noqa: E402
from pipe.recompute.module import recompute as mark  # noqa: E402

PHASES = ("forward", "backward", "input", "weight", "replay")
#: name: (model, rows, first layer, end layer) of the stage compared
STAGES = {"mlp": ("mlp", 8, 8, 16), "transformer": ("transformer", 4, 1, 4)}


def fastest(run: Callable[[], tuple[float, ...]], times: int = 15) -> tuple[float, ...]:
    found = [run() for _ in range(times)]
    return tuple(min(f[k] for f in found) for k in range(len(found[0])))


def stage_times(stage: nn.Sequential, marked: nn.Sequential, given: torch.Tensor) -> dict[str, float]:
    """Seconds of the stage run whole: forward, backward, I, W, and the replay its marks add."""
    def fresh() -> torch.Tensor:
        x = given.clone()
        return x.requires_grad_() if x.is_floating_point() else x

    def plain(module: nn.Module) -> tuple[float, float]:
        x = fresh()
        begun = time.perf_counter()
        out = module(x)
        middle = time.perf_counter()
        out.backward(torch.ones_like(out))
        return middle - begun, time.perf_counter() - middle

    def split() -> tuple[float, float]:
        x = fresh()
        out = stage(x)
        halves = IWBackward([out], [torch.ones_like(out)], [x] if x.requires_grad else [], list(stage.parameters()))
        begun = time.perf_counter()
        halves.backward_input()
        middle = time.perf_counter()
        halves.backward_weight()
        return middle - begun, time.perf_counter() - middle

    for warm in (lambda: plain(stage), lambda: plain(marked), split):
        fastest(warm, 3)
    forward, backward = fastest(lambda: plain(stage))
    marked_forward, marked_backward = fastest(lambda: plain(marked))
    input_grad, weight_grad = fastest(split)
    return {"forward": forward, "backward": backward, "input": input_grad, "weight": weight_grad,
            "replay": marked_forward + marked_backward - forward - backward}


def ratios_once(name: str) -> dict[str, float]:
    """One repeat: the profiled sum over the stage's own time, per phase."""
    which, rows, first, end = STAGES[name]
    build, data, _ = models.MODELS[which]
    size = models.SIZES["full"][which]
    model = build(size)
    x, _ = data(size)
    with torch.no_grad():
        given = nn.Sequential(*list(model)[:first])(x[:rows]) if first else x[:rows]
    stage = nn.Sequential(*list(model)[first:end])
    marked = copy.deepcopy(stage)
    for layer in marked:
        mark(layer)
    # In windows of half the model, as plan(stages=2) profiles (a checkout before windows: one chain).
    window = {"window": -(-len(model) // 2)} if "window" in inspect.signature(time_layers).parameters else {}
    profile = time_layers(model, {rows: x[:rows]}, torch.device("cpu"), rounds=5, split=True, recompute=True,
                          **window)
    profiled = {"forward": profile.forward[rows], "backward": profile.backward[rows],
                "input": profile.input_grad[rows], "weight": profile.weight_grad[rows], "replay": profile.replay[rows]}
    whole = stage_times(stage, marked, given)
    return {phase: sum(profiled[phase][first:end]) / whole[phase] for phase in PHASES}


def child(path: str) -> dict[str, dict[str, float]]:
    """One repeat of every stage in a fresh process importing ``pipe`` from ``path``."""
    env = dict(os.environ, PYTHONPATH=path)
    done = subprocess.run([sys.executable, str(HERE / "planner.py"), "fidelity", "--child"], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(found: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    return {name: {"stage": "{} layers {}-{} on {} rows".format(STAGES[name][0], STAGES[name][2], STAGES[name][3] - 1,
                                                               STAGES[name][1]),
                   "profiled_over_stage": {phase: {"median": statistics.median(f[name][phase] for f in found),
                                                   "min": min(f[name][phase] for f in found),
                                                   "max": max(f[name][phase] for f in found)}
                                           for phase in PHASES}}
            for name in STAGES}


def main(argv: list[str], prog: str) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats instead of 5")
    parser.add_argument("--baseline", metavar="DIR", help="also profile with pipe from another checkout, in turn")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as each rank of the process runner computes
    if args.child:
        print(json.dumps({name: ratios_once(name) for name in STAGES}))
        return
    repeats = 2 if args.quick else 5
    load_before = " ".join(f"{v:.2f}" for v in os.getloadavg())
    checkouts = {"pipe": str(HERE.parent), **({"baseline": args.baseline} if args.baseline else {})}
    found: dict[str, list[dict[str, dict[str, float]]]] = {label: [] for label in checkouts}
    for _ in range(repeats):  # each checkout in a fresh process, in turn
        for label, path in checkouts.items():
            found[label].append(child(path))
    results = {label: summary(runs) for label, runs in found.items()}
    for label, by_stage in results.items():
        for found_stage in by_stage.values():
            print(f"[{label}] {found_stage['stage']}: profiled sum / stage, median over {repeats} repeats (range)")
            for phase, r in found_stage["profiled_over_stage"].items():
                print(f"  {phase:>8}: {r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})")
    out = {"machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                       "load_before": load_before, "load_after": " ".join(f"{v:.2f}" for v in os.getloadavg())},
           "repeats": repeats, "baseline": args.baseline, **results}
    path = HERE / "results" / ("profile_fidelity-quick.json" if args.quick else "profile_fidelity.json")
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")

