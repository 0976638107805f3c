"""Where receives are posted, measured: one order, each rank posting 0, 1 (the default), 2 or 3 actions ahead,
and where the search (``pipe.core.cost_order.choose_posts``) puts them from measured costs.

A message's bytes move only once its receive is posted. This benchmark makes messages matter: 2 gloo ranks on
127.0.0.1, one cheap layer per stage (``x * weight`` on rows of ``--width`` floats), so that sending a
micro-batch's activation takes about as long as computing it. Every configuration is the same 1F1B order
(``--chunks`` micro-batches); only ``TableSchedule.with_posts`` differs.

The search's costs: rank 0 records ``--record`` steps posting one ahead (``pipe.trace.record``), takes each
stage's median F, I, W and the runner's time per action from them (``pipe.balance.traced_step``), and prices a
message by this machine's link (``pipe.plan.link.cached_link``: latency + bytes x per_byte, measured once and
cached). Each configuration's lowered step is simulated under the same costs (``lowered_step``), so the JSON
holds prediction and measurement side by side.

The configurations alternate within each of ``--repeats`` rounds; a round times ``--steps`` steps of each
(after 2 warm-up steps of every configuration). A step's time is the slower rank's. Run on a quiet machine::

    python benchmarks/posts.py --repeats 3 --output benchmarks/results/posts.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from forked_ranks import run_forked_ranks

FIXED = (0, 1, 2, 3)  # posts ahead on both ranks


class Wide(nn.Module):
    """``x * weight``: a layer whose compute is cheap beside its activation's bytes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


def _rank(rank: int, port: int, args: argparse.Namespace, link: tuple[float, float], results: Any) -> None:
    from pipe import trace
    from pipe.balance import traced_step
    from pipe.core.cost_order import choose_posts
    from pipe.core.stage_costs import lowered_step
    from pipe.core.message import HEADER_BYTES
    from pipe.core.schedule import Schedule
    from pipe.core.schedule_table import TableSchedule
    from pipe.distributed import DistributedPipe

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300))
    order = Schedule("1f1b", 2, args.chunks)
    base = TableSchedule.from_table([order.actions(r) for r in range(2)], name="1f1b")
    torch.manual_seed(0)
    model = nn.Sequential(Wide(args.width), Wide(args.width))
    x, y = torch.randn(args.rows * args.chunks, args.width), torch.randn(args.rows * args.chunks, args.width)

    def build(posts: tuple[int, int]) -> DistributedPipe:
        return DistributedPipe(model, chunks=args.chunks, schedule=base.with_posts(list(posts)), loss_fn=F.mse_loss)

    recorded = build((1, 1))
    for _ in range(2):
        recorded.step(x, y)
    with trace.record(None, rank=rank) as recorder:
        for _ in range(args.record):
            recorded.step(x, y)
    traces: list[Any] = [None, None]
    dist.all_gather_object(traces, recorder.trace())
    message = link[0] + (HEADER_BYTES + args.rows * args.width * 4) * link[1]
    costs = traced_step(traces, balance=[1, 1]).costs(transfer=message)
    chosen = [choose_posts(base, costs)[0].posts]
    dist.broadcast_object_list(chosen, src=0)  # timings differ between ranks; the choice must not
    configs: dict[str, tuple[int, int]] = {f"posts {n}": (n, n) for n in FIXED}
    configs["chosen"] = tuple(chosen[0])  # type: ignore[assignment]
    pipes = {name: build(posts) for name, posts in configs.items()}
    for piped in pipes.values():
        for _ in range(2):
            piped.step(x, y)
    rounds: dict[str, list[float]] = {name: [] for name in pipes}
    for _ in range(args.repeats):
        for name, piped in pipes.items():
            steps = []
            for _ in range(args.steps):
                dist.barrier()
                started = time.perf_counter()
                piped.step(x, y)
                steps.append(time.perf_counter() - started)
            rounds[name].append(statistics.median(steps))
    results.put({"rank": rank, "rounds": rounds, "configs": configs,
                 "predicted": {name: lowered_step(base.with_posts(list(posts)), costs)
                               for name, posts in configs.items()},
                 "costs": {"forward": costs.forward, "input_grad": costs.input_grad,
                           "weight_grad": costs.weight_grad, "transfer": costs.transfer,
                           "overhead": costs.overhead}})
    dist.destroy_process_group()


def main() -> None:
    from pipe.plan.link import cached_link

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1 << 20, help="floats per row (default 1 Mi: 4 MiB a row)")
    parser.add_argument("--rows", type=int, default=2, help="rows per micro-batch")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, every configuration in each")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration and round")
    parser.add_argument("--record", type=int, default=3, help="steps recorded for the search's costs")
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    found = cached_link()
    if found is None:
        raise SystemExit("could not measure this machine's link (pipe.plan.link.cached_link returned None)")
    per_rank = run_forked_ranks(_rank, args, (found.latency, found.per_byte), ranks=2, timeout=1800)
    rounds = {name: [max(a, b) for a, b in zip(per_rank[0]["rounds"][name], per_rank[1]["rounds"][name])]
              for name in per_rank[0]["rounds"]}
    default = rounds["posts 1"]
    table = {}
    print(f"{'configuration':<14}{'posts':>8}{'step ms (median, range)':>28}{'/ posts 1':>12}{'predicted ms':>14}")
    for name, steps in rounds.items():
        ratios = [d / s for d, s in zip(default, steps)]  # speed over posting one ahead, round by round
        predicted = per_rank[0]["predicted"][name]
        table[name] = {"posts": per_rank[0]["configs"][name], "step_s": steps, "median_s": statistics.median(steps),
                       "speed_vs_posts_1": statistics.median(ratios), "speed_vs_posts_1_range": [min(ratios),
                                                                                                  max(ratios)],
                       "predicted_s": predicted, "prediction_error": predicted / statistics.median(steps) - 1}
        print(f"{name:<14}{str(tuple(per_rank[0]['configs'][name])):>8}"
              f"{statistics.median(steps) * 1e3:>10.1f} ({min(steps) * 1e3:.1f}-{max(steps) * 1e3:.1f})"
              f"{statistics.median(ratios):>12.3f}{predicted * 1e3:>14.1f}")
    report = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
              "args": {k: str(v) for k, v in vars(args).items()},
              "link": {"latency_s": found.latency, "per_byte_s": found.per_byte},
              "costs": per_rank[0]["costs"], "configurations": table,
              "chosen_vs_posts_1": table["chosen"]["speed_vs_posts_1"],
              "posts_0_vs_posts_1": table["posts 0"]["speed_vs_posts_1"]}
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
