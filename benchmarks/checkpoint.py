"""Step time with a checkpoint every step against none: ``state.save`` synchronous and ``asynchronous=True``.

The LLaMA-style model of ``benchmarks/loading.py`` (0.5B parameters, fp32;
``--quick``: 6M) is cut into ``--pp`` stages (default 4, gloo ranks on this
machine's CPU) and trained with AdamW. Each mode runs ``--steps`` timed steps
after a warm-up step:

* ``none``: step, optimizer step;
* ``sync``: the same and ``state.save`` of the model and optimizer every step;
* ``async``: the same with ``state.save(..., asynchronous=True)``: the state is
  copied to host memory and the files are written in the background while the
  next step runs; each save first finishes (publishes) the one before, so a
  step costs the copy plus whatever of the previous write the step did not hide.

A step's time is the slowest rank's (each step ends with a barrier). Reported:
the median step time of each mode and ``async_over_none``, ``sync_over_none``
(the issue's target: async at most 1.1x on the 0.5B model at pp 4). The
figures depend on the disk and on what else the machine runs: say where they
were taken (``--note``).

Run:
    python benchmarks/checkpoint.py --quick        # 6M parameters, seconds
    python benchmarks/checkpoint.py                # 0.5B parameters: minutes, ~4 GB of checkpoint per save
    python benchmarks/checkpoint.py --modes none async   # without the synchronous saves
Results: benchmarks/results/checkpoint.json (checkpoint-quick.json).
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
MODES = ("none", "sync", "async")


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def _rank(rank: int, world: int, args: argparse.Namespace, directory: str) -> dict[str, list[float]]:
    from transformers import AutoModelForCausalLM

    import pipe
    import pipe.distributed as pd
    from loading import _config
    from pipe.distributed import state

    config = _config(args.quick)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    example = torch.zeros(2, args.seq_len, dtype=torch.long, device="meta")
    stages = pipe.split(model, (example,), {"use_cache": False}, at="auto", stages=world)
    piped = pd.DistributedPipe(stages, chunks=args.chunks, schedule="1f1b", loss_fn=_loss)
    optimizer = torch.optim.AdamW(piped.parameters(), lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {}
    for mode in args.modes:
        times[mode] = []
        for step in range(args.steps + 1):  # the first is a warm-up
            dist.barrier()
            tick = time.perf_counter()
            piped.step(ids, ids)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if mode != "none":
                state.save(state.step_path(directory, step), piped, optimizer, asynchronous=mode == "async", step=step)
            dist.barrier()
            if step:
                times[mode].append(time.perf_counter() - tick)
        state.wait()  # the last asynchronous save, written and published before the next mode
        state.prune(directory, keep=1)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the 6M-parameter model of loading.py --quick")
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="the modes to run, in this order (default: all)")
    parser.add_argument("--note", default="", help="where the figures were taken (a busy machine, the disk)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from pipe.distributed.local_ranks import run_local_ranks

    directory = tempfile.mkdtemp(prefix="pipe-checkpoint-bench-", dir=args.dir)
    try:
        per_rank = run_local_ranks(_rank, args.pp, args, directory, timeout=1800.0, deadline=7200.0)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    slowest = {mode: [max(rank[mode][k] for rank in per_rank) for k in range(args.steps)] for mode in args.modes}
    median = {mode: statistics.median(values) for mode, values in slowest.items()}
    result: dict[str, Any] = {
        "model": "loading.py --quick (6M)" if args.quick else "loading.py (0.5B)", "pp": args.pp,
        "batch_size": args.batch_size, "seq_len": args.seq_len, "chunks": args.chunks, "steps": args.steps,
        "step_s": slowest, "median_step_s": median,
        **{f"{mode}_over_none": median[mode] / median["none"] for mode in ("sync", "async")
           if mode in median and "none" in median},
        "torch": torch.__version__, "note": args.note,
    }
    RESULTS.mkdir(exist_ok=True)
    name = "checkpoint-quick.json" if args.quick else "checkpoint.json"
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
    ratios = {mode: f" ({result[f'{mode}_over_none']:.2f}x)" if f"{mode}_over_none" in result else ""
              for mode in median}
    print("median step: " + ", ".join(f"{mode} {median[mode]:.3f} s{ratios[mode]}" for mode in median)
          + f"; written to {RESULTS / name}")


if __name__ == "__main__":
    main()
