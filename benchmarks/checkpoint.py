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
(the issue's target: async at most 1.1x on the 0.5B model at pp 4); each
saving step's parts (``median_parts_s``: training, waiting for the save before
to finish writing, the save call itself: for ``async`` the copy to host memory);
the bytes of one checkpoint and the disk's write throughput, measured first by
writing and fsync'ing ``--disk-probe-mb`` into the same directory. With a save
every step the disk must write one checkpoint per step, so an asynchronous step
takes at least the disk's time for one checkpoint: ``disk_floor_over_none`` is
that floor over a step without saves, the best any engine can do on this disk.
The CPU time of every rank's threads is counted too (``cpu_s_per_step``): a
step takes at least its CPU time over the cores, so ``cpu_floor_over_none``
(a saving step's CPU time over the cores, over a step without saves) is the
least its ratio can be where the cores are busy with training already.
The figures depend on the disk and on what else the machine runs: say where
they were taken (``--note``).

Run:
    python benchmarks/checkpoint.py --quick        # 6M parameters, seconds
    python benchmarks/checkpoint.py                # 0.5B parameters: minutes, 6 GB of checkpoint per save
    python benchmarks/checkpoint.py --modes none async   # without the synchronous saves
Results: benchmarks/results/checkpoint.json (checkpoint-quick.json).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
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
        for part in ("train", "wait", "save", "cpu"):
            times[f"{mode} {part}"] = []
        for step in range(args.steps + 1):  # the first is a warm-up
            dist.barrier()
            tick, cpu = time.perf_counter(), time.process_time()
            piped.step(ids, ids)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            trained = time.perf_counter()
            if mode != "none":
                state.wait()  # the save before (asynchronous): blocks while its files are still being written
            waited = time.perf_counter()
            if mode != "none":
                state.save(state.step_path(directory, step), piped, optimizer, asynchronous=mode == "async", step=step)
            saved = time.perf_counter()
            dist.barrier()
            if step:
                times[f"{mode} cpu"].append(time.process_time() - cpu)  # every thread of the rank: the writer's too
                times[mode].append(time.perf_counter() - tick)
                times[f"{mode} train"].append(trained - tick)
                times[f"{mode} wait"].append(waited - trained)
                times[f"{mode} save"].append(saved - waited)
        state.wait()  # the last asynchronous save, written and published before the next mode
        state.prune(directory, keep=1)
        newest = state.latest(directory)
        if mode != "none" and newest is not None and dist.get_rank() == 0:
            times[f"{mode} bytes"] = [float(sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()))]
    return times


def _disk_write_mb_s(directory: str, megabytes: int) -> float:
    """The disk's write throughput where the checkpoints go: ``megabytes`` written and fsync'ed, as DCP does."""
    block = os.urandom(1 << 20)
    path = os.path.join(directory, "disk-probe")
    tick = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(megabytes):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - tick
    os.remove(path)
    return megabytes / seconds


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
    parser.add_argument("--disk-probe-mb", type=int, default=2048,
                        help="MB written and fsync'ed before the run to measure the disk (default: %(default)s; 0: skip)")
    parser.add_argument("--note", default="", help="where the figures were taken (a busy machine, the disk)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from pipe.distributed.local_ranks import run_local_ranks

    directory = tempfile.mkdtemp(prefix="pipe-checkpoint-bench-", dir=args.dir)
    try:
        disk = _disk_write_mb_s(directory, args.disk_probe_mb) if args.disk_probe_mb else None
        per_rank = run_local_ranks(_rank, args.pp, args, directory, timeout=1800.0, deadline=7200.0)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    slowest = {mode: [max(rank[mode][k] for rank in per_rank) for k in range(args.steps)] for mode in args.modes}
    median = {mode: statistics.median(values) for mode, values in slowest.items()}
    # Each part's median over steps of the slowest rank's (the parts of one step need not add up across ranks).
    parts = {mode: {part: statistics.median(max(rank[f"{mode} {part}"][k] for rank in per_rank)
                                            for k in range(args.steps)) for part in ("train", "wait", "save")}
             for mode in args.modes if mode != "none"}
    saved_bytes = {mode: per_rank[0][f"{mode} bytes"][0] for mode in args.modes if f"{mode} bytes" in per_rank[0]}
    result: dict[str, Any] = {
        "model": "loading.py --quick (6M)" if args.quick else "loading.py (0.5B)", "pp": args.pp,
        "batch_size": args.batch_size, "seq_len": args.seq_len, "chunks": args.chunks, "steps": args.steps,
        "step_s": slowest, "median_step_s": median, "median_parts_s": parts,
        **{f"{mode}_over_none": median[mode] / median["none"] for mode in ("sync", "async")
           if mode in median and "none" in median},
        "checkpoint_bytes": saved_bytes, "disk_write_mb_s": disk,
        "torch": torch.__version__, "note": args.note,
    }
    if disk and saved_bytes and "none" in median:
        # With a save every step the disk must write one checkpoint per step: an asynchronous step cannot be shorter
        # than the disk's time for one checkpoint, whatever the engine does.
        write_s = max(saved_bytes.values()) / 1e6 / disk
        result["disk_write_s_per_checkpoint"] = write_s
        result["disk_floor_over_none"] = max(1.0, write_s / median["none"])
    cores = len(os.sched_getaffinity(0))
    cpu = {mode: statistics.median(sum(rank[f"{mode} cpu"][k] for rank in per_rank) for k in range(args.steps))
           for mode in args.modes}
    result["cores"] = cores
    result["cpu_s_per_step"] = cpu  # the CPU time of all ranks in a step (median over steps)
    if "none" in median:
        # A step cannot take less wall time than its CPU time over the cores. So cpu[mode] / (cores x a step without
        # saves) is a floor for mode's ratio: the save's own CPU work (the copy to host memory, the writes) that the
        # cores, already busy with training, have no room to hide.
        result["cores_busy_without_saves"] = cpu["none"] / (median["none"] * cores)
        result["cpu_floor_over_none"] = {mode: max(1.0, cpu[mode] / (median["none"] * cores))
                                         for mode in args.modes if mode != "none"}
    RESULTS.mkdir(exist_ok=True)
    name = "checkpoint-quick.json" if args.quick else "checkpoint.json"
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
    ratios = {mode: f" ({result[f'{mode}_over_none']:.2f}x)" if f"{mode}_over_none" in result else ""
              for mode in median}
    print("median step: " + ", ".join(f"{mode} {median[mode]:.3f} s{ratios[mode]}" for mode in median)
          + f"; written to {RESULTS / name}")

    for mode, part in parts.items():
        print(f"{mode}: train {part['train']:.3f} s, waiting for the save before {part['wait']:.3f} s, "
              f"save call {part['save']:.3f} s (medians of the slowest rank)")
    if "disk_write_s_per_checkpoint" in result:
        print(f"one checkpoint is {max(saved_bytes.values()) / 1e9:.2f} GB; the disk writes {disk:.0f} MB/s, so "
              f"{result['disk_write_s_per_checkpoint']:.2f} s a checkpoint: a step with a save every step is at least "
              f"{result['disk_floor_over_none']:.2f}x a step without")
    if "cpu_floor_over_none" in result:
        print("CPU time of a step, all ranks: " + ", ".join(f"{mode} {cpu[mode]:.1f} s" for mode in cpu)
              + f"; without saves the {cores} cores are {result['cores_busy_without_saves']:.0%} busy, so a step can "
              "be no shorter than " + ", ".join(f"{mode} {ratio:.2f}x" for mode, ratio
                                                 in result["cpu_floor_over_none"].items()) + " a step without saves")


if __name__ == "__main__":
    main()
