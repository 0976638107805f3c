"""The ``pipe-plan`` command: measure a model, print the plans that fit a memory budget.

Usage::

    pipe-plan --model mypkg.models:build --input-shape 64,512 --budget 2GiB --stages 4
              [--runner processes] [--chunks 1 2 4 8 16] [--param-scale 4] [--explain] [--verify]
              [--calibrate] [--dp-shard auto | S [S ...]] [--dp-replicate auto | R [R ...]] [--zero 3 2]
              [--unit stage block] [--reduce step micro-batch] [--select [REGEX ...]] [--threads N]

``--model`` names a function (``module:function``, importable from the
current directory) that returns the ``nn.Sequential``; the sample is a random
float mini-batch of ``--input-shape`` or what ``--input module:function``
returns. The table lists the chosen plan with its predicted step and peak per
rank, the next best plans and how much slower each is, and the faster plans
that were rejected with the rank (and its stages) over the budget;
``--explain`` adds where the chosen plan's idle time goes. ``--verify`` then
runs the chosen plan (``--runner processes``: one local gloo process per rank;
``threads``: ``Pipe`` on the CPU) and prints the measured step and peaks
beside the predicted ones; its loss is the mean of the output. ``--dp-shard``
(with ``--runner processes``) plans the ``--stages`` ranks as ``pp x dp_shard``
FSDP splits (``auto``: every divisor; :mod:`pipe.plan.sharding`), in the ZeRO
stages of ``--zero``, under ZeRO-3 gathering a stage whole and/or a layer at a time (``--unit``), a layer's
gradients reduced once a step and/or after each backward (``--reduce``), and ``--dp-replicate`` adds full replicas (``pp x
dp_replicate``, or HSDP with ``--dp-shard``); the table then says, per split, whether it was chosen or
why it lost, and the command prints the ``make_mesh`` arguments. Bad arguments
exit with status 2; a budget that nothing fits exits with status 1 and names
the smallest peak found and the rank holding it. ``--select`` gives the name
regexes of the selective recompute the planner weighs per stage against full
recompute (default: ``pipe.recompute.DEFAULT_SELECT``; none given: full only).
``--calibrate`` (with ``--runner processes``) first runs a few plans of the
model on local processes, records them and calibrates the time model to them
(:func:`pipe.plan.calibrate`), then plans with it; the table's "time model"
line says what was fitted and on which plans.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
from typing import Any, Callable, Optional, Sequence

from pipe.core.options import REDUCES, UNITS
from pipe.plan.candidates import RUNNERS
from pipe.plan.measure import mean_output_loss, pipeline_steps
from pipe.recompute.scope import compile_pattern
from pipe.recompute.defaults import DEFAULT_SELECT
from pipe.plan.search import PlanError
from pipe.core.units import parse_bytes

__all__: list[str] = []

VERIFY_STEPS = 5
"""Steps ``--verify`` times after its warm-up: the fastest is compared, the others show the machine's spread."""


def _function(text: str) -> Callable[[], Any]:
    module_name, _, name = text.partition(":")
    if not module_name or not name:
        raise argparse.ArgumentTypeError(f"expected module:function, got {text!r} (e.g. mypkg.models:build)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise argparse.ArgumentTypeError(f"cannot import {module_name!r}: {error}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise argparse.ArgumentTypeError(f"{module_name!r} has no function {name!r}")
    return function


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes separated by commas, such as 64,512; got {text!r}") from None
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return shape


def _budget(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _regex(text: str) -> str:
    try:
        compile_pattern(text, "--select")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipe-plan", description="Measure a model and print the fastest pipeline plans that fit a memory budget.")
    parser.add_argument("--model", required=True, metavar="MODULE:FUNCTION",
                        help="a function returning the nn.Sequential, importable from the current directory "
                             "(e.g. examples.cli_models:build in pipe's source tree)")
    sample = parser.add_mutually_exclusive_group(required=True)
    sample.add_argument("--input-shape", type=_shape, metavar="B,...", help="a random float mini-batch of this shape")
    sample.add_argument("--input", metavar="MODULE:FUNCTION", help="a function returning a mini-batch")
    parser.add_argument("--budget", type=_budget, required=True, help="memory per device, e.g. 2GiB or 512MB")
    parser.add_argument("--stages", type=int, required=True, help="devices (Pipe partitions or pipeline ranks; with --dp-shard, all the ranks to split)")
    parser.add_argument("--runner", choices=sorted(RUNNERS), default="threads",
                        help="threads: Pipe (GPipe); processes: DistributedPipe (default: threads)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                        help="micro-batch counts to consider (default: 1 2 4 8 16 32)")
    parser.add_argument("--schedules", nargs="+", metavar="NAME", default=None,
                        help="only these schedules (processes: gpipe 1f1b interleaved zb-h1 zbv auto auto-v, the last "
                             "two orders built from each plan's costs; threads: gpipe); default: the fixed schedules "
                             "the runner runs, and for processes the built orders where they may win")
    parser.add_argument("--checkpoints", nargs="+", choices=["never", "except_last", "always"],
                        default=["never", "except_last", "always"],
                        help="only these checkpoint modes (default: all three)")
    parser.add_argument("--param-scale", type=float, default=2.0,
                        help="copies of the parameters training keeps: 2 SGD, 3 momentum, 4 Adam (default 2)")
    parser.add_argument("--explain", action="store_true", help="also explain the chosen plan's idle time")
    parser.add_argument("--verify", action="store_true",
                        help="run the chosen plan and print the measured step and peaks beside the predicted")
    parser.add_argument("--calibrate", action="store_true",
                        help="(--runner processes) first run and record a few plans of the model on local "
                             "processes, read each phase's compute off them and fit the time model's overhead per "
                             "action and message and its contention to their steps, then plan with it "
                             "(pipe.plan.calibrate; a few seconds per plan)")
    parser.add_argument("--dp-shard", nargs="+", metavar="S", default=None,
                        help="plan --stages ranks as pp x dp_shard (FSDP): 'auto' for every divisor, or the "
                             "dp_shard sizes to try (needs --runner processes)")
    parser.add_argument("--dp-replicate", nargs="+", metavar="R", default=None,
                        help="plan --stages ranks with full replicas too, as pp x dp_replicate (or with --dp-shard "
                             "pp x dp_replicate x dp_shard, HSDP): 'auto' for every divisor, or the sizes to try "
                             "(needs --runner processes)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="intra-op threads each stage computes with, as the layers are timed and as ranks share "
                             "this machine's cores (default: 1 with --runner processes, as torchrun gives several "
                             "local ranks; this process's with threads)")
    parser.add_argument("--zero", type=int, nargs="+", choices=[2, 3], default=[3, 2],
                        help="with --dp-shard: the ZeRO stages to compare (3: reshard after forward; default 3 2)")
    parser.add_argument("--unit", nargs="+", choices=list(UNITS), default=list(UNITS),
                        help="with --dp-shard under ZeRO-3: what FSDP gathers at a time, Shard(unit=...), to compare "
                             "(default: stage block)")
    parser.add_argument("--reduce", nargs="+", choices=list(REDUCES), default=list(REDUCES),
                        help="with --unit block: when a layer's gradients are reduce-scattered, Shard(reduce=...), to "
                             "compare (default: step micro-batch)")
    parser.add_argument("--link", choices=["auto", "cached", "none"], default="auto",
                        help="transport cost between ranks (processes), or the thread runner's overhead per "
                             "action (threads, on the CPU): auto measures it once per machine and caches it; "
                             "cached uses the cache only; none: free (default auto)")
    parser.add_argument("--select", nargs="*", type=_regex, metavar="REGEX", default=None,
                        help="name regexes of selective recompute to plan per stage, as select_recompute(names=...) "
                             "takes them (default: pipe.recompute.DEFAULT_SELECT, the activations and softmax; "
                             "--select alone: plan full recompute only)")
    return parser


def _verify(args: argparse.Namespace, chosen: Any, sample: Any) -> str:
    """Runs the plan; the measured figures beside the predicted ones."""
    import time

    from pipe.plan.measure import verify_plan
    from pipe.core.units import format_bytes

    predicted = chosen.best
    lines = ["verified (measured beside predicted):"]
    if args.runner == "processes":
        measured = verify_plan(args.model, chosen, sample, sample, mean_output_loss, repeat=VERIFY_STEPS)
        lines.append(_step_line(predicted.step_time, pipeline_steps(measured)))
        for rank, m in enumerate(measured):
            peak = predicted.peaks[m.pipeline_rank]
            where = f" (pipeline rank {m.pipeline_rank})" if chosen.candidate.parts > 1 else ""
            lines.append(f"  rank {rank}{where} peak  predicted {format_bytes(peak):>12}  measured "
                         f"{format_bytes(m.activation_peak):>12} ({peak / m.activation_peak - 1:+.1%})")
        return "\n".join(lines)
    from pipe.pipe import Pipe

    model = Pipe(args.model(), devices=["cpu"] * chosen.candidate.ranks, **chosen.pipe_kwargs())
    times = []
    for _ in range(1 + VERIFY_STEPS):  # the first warms up
        begun = time.perf_counter()
        mean_output_loss(model(sample), None).backward()
        times.append(time.perf_counter() - begun)
    model.close()
    lines.append(_step_line(predicted.step_time, times[1:]))
    lines.append("  per-stage peaks are not measured in one process (plan with --runner processes to check them)")
    return "\n".join(lines)


def _step_line(predicted: float, steps: Sequence[float]) -> str:
    """The predicted step beside the fastest of the measured ``steps`` (seconds), and how far those spread: a
    prediction between the fastest and the slowest cannot be told wrong by this measurement."""
    fastest, slowest = min(steps), max(steps)
    within = ": the prediction lies within them" if fastest <= predicted <= slowest else ""
    return (f"  step  predicted {predicted * 1e3:9.2f} ms  measured {fastest * 1e3:9.2f} ms "
            f"({predicted / fastest - 1:+.1%})\n"
            f"        the fastest of {len(steps)} steps; median {statistics.median(steps) * 1e3:.2f} ms, "
            f"slowest {slowest * 1e3:.2f} ms{within}")


class _Name(str):
    """A name printed as is in the suggested call (``mesh=mesh``)."""

    def __repr__(self) -> str:
        return str(self)


def _sizes(parser: argparse.ArgumentParser, args: argparse.Namespace, name: str, what: str) -> Any:
    """``--dp-shard`` or ``--dp-replicate``: None, ``"auto"`` or a list of sizes."""
    given = getattr(args, name)
    flag = "--" + name.replace("_", "-")
    if given is None:
        return None
    if args.runner != "processes":
        parser.error(f"{flag} plans {what}, which only DistributedPipe runs: add --runner processes")
    if given == ["auto"]:
        return "auto"
    try:
        return [int(size) for size in given]
    except ValueError:
        parser.error(f"{flag} takes 'auto' or sizes such as 2 4, got {' '.join(given)}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command; returns the exit status."""
    import torch

    from pipe.plan.explain import explain_prediction
    from pipe.plan.planning import plan

    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # resolved here, not as argparse types: a wrong name gets one line, not the whole usage before it
        args.model = _function(args.model)
        args.input = _function(args.input) if args.input else None
    except argparse.ArgumentTypeError as error:
        sys.stderr.write(f"pipe-plan: {error}\n")
        return 2
    model = args.model()
    sample = torch.randn(*args.input_shape) if args.input_shape else args.input()
    with_loss = args.verify and args.runner == "processes"
    dp_shard = _sizes(parser, args, "dp_shard", "FSDP sharding")
    dp_replicate = _sizes(parser, args, "dp_replicate", "data-parallel replicas")
    if args.calibrate and args.runner != "processes":
        parser.error("--calibrate runs plans on local processes, which is DistributedPipe's runner: add "
                     "--runner processes")
    try:
        chosen = plan(model, sample, memory_budget=args.budget, stages=args.stages, runner=args.runner,
                      chunks=args.chunks, schedules=args.schedules, checkpoints=args.checkpoints,
                      param_scale=args.param_scale,
                      link=None if args.link == "none" else args.link, loss_fn=mean_output_loss if with_loss else None,
                      target=sample if with_loss else None, dp_shard=dp_shard, zero=args.zero, dp_replicate=dp_replicate,
                      select=DEFAULT_SELECT if args.select is None else args.select, calibrate=args.calibrate,
                      threads=args.threads, units=args.unit, reduces=args.reduce)
    except PlanError as error:
        sys.stderr.write(f"pipe-plan: {error}\n")
        return 1
    except RuntimeError as error:  # a layer that cannot be measured
        sys.stderr.write(f"pipe-plan: {error}\n")
        return 1
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    sys.stdout.write(chosen.table() + "\n")
    kwargs = chosen.pipe_kwargs() if args.runner == "threads" else chosen.distributed_kwargs()
    front = "Pipe" if args.runner == "threads" else "DistributedPipe"
    if dp_shard is not None or dp_replicate is not None:
        front = f"mesh = make_mesh({', '.join(f'{k}={v}' for k, v in chosen.mesh_kwargs().items())})\n{front}"
        kwargs = {**kwargs, "mesh": _Name("mesh")}
    table = kwargs.get("schedule")
    if table is not None and not isinstance(table, str):  # an order built from the costs: its CSV, to read back
        front = f"table = TableSchedule.from_csv(io.StringIO({table.to_csv()!r}))\n{front}"
        kwargs = {**kwargs, "schedule": _Name("table")}
    sys.stdout.write(f"\n{front}(model, " + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")\n")
    if args.explain:
        sys.stdout.write("\n" + explain_prediction(chosen.best).table() + "\n")
    if args.verify:
        sys.stdout.write("\n" + _verify(args, chosen, sample) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
