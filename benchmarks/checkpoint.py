"""Step time with a checkpoint every step against none: ``state.save`` synchronous and ``asynchronous=True``.

The LLaMA-style model of ``benchmarks/loading.py`` (0.5B parameters, fp32;
``--quick``: 6M) is cut into ``--pp`` stages (default 4, gloo ranks on this
machine's CPU) and trained with AdamW, in these modes:

* ``none``: step, optimizer step;
* ``sync``: the same and ``state.save`` of the model and optimizer every step;
* ``async``: the same with ``state.save(..., asynchronous=True)``: the state is
  copied to host memory and the files are written in the background while the
  next step runs; each save first finishes (publishes) the one before, so a
  step costs the copy plus whatever of the previous write the step did not hide.

The modes alternate in one launch, so that a drift of the machine's speed
(steps slow down and speed up by 10-20% on a shared 2-core machine) falls on
every mode alike: after one warm-up step of each, ``--rounds`` rounds each run
a block of ``--steps`` steps of every mode, in the order of ``--modes`` and
then reversed (A B, B A, ...). A block's first step has no save before it to
wait for, and its last save is drained after it (``drain``), so the steps after
the first are the steady state of a run that saves every step: those are timed,
in every mode. A step's time is the slowest rank's (each step ends with a
barrier). Reported: the step time of each block, each saving block over the
block without saves of its round, and their median per run (``over_none``; the
issue's target: async at most 1.1x on the 0.5B model at pp 4); with
``--runs N``, N launches one after another and the median and range of their
ratios. Also each saving step's parts (``median_parts_s``: training, waiting
for the save before to finish writing, the save call itself: for ``async`` the
copy to host memory); the bytes of one checkpoint and the disk's write
throughput, measured first by writing and fsync'ing ``--disk-probe-mb`` into
the same directory. With a save every step the disk must write one checkpoint
per step, so an asynchronous step takes at least the disk's time for one
checkpoint: ``disk_floor_over_none`` is that floor over a step without saves,
the best any engine can do on this disk.
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
    python benchmarks/checkpoint.py --modes none async --runs 3   # the figure of docs/distributed_training.md
    python benchmarks/checkpoint.py --modes none sync async --output checkpoint-sync.json   # sync against async
Results: benchmarks/results/checkpoint.json (checkpoint-quick.json; --output another name).
"""
from __future__ import annotations

import argparse
import itertools
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
    counter = itertools.count()  # the saves' step numbers, across blocks

    def block(mode: str, steps: int) -> None:
        """``steps`` steps of ``mode``, then the last save drained, so that the next block starts clean.

        The block's first step has no save before it to wait for, and its last save is drained after it: the
        steps after the first are the steady state of a run that saves every step, and are what is timed (in
        every mode, so that the modes are timed at the same positions).
        """
        dist.barrier()
        cpu = time.process_time()
        steady = []
        for index in range(steps):
            started = time.perf_counter()
            piped.step(ids, ids)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            trained = time.perf_counter()
            if mode != "none":
                state.wait()  # the save before (asynchronous): blocks while its files are still being written
            waited = time.perf_counter()
            if mode != "none":
                step = next(counter)
                state.save(state.step_path(directory, step), piped, optimizer, asynchronous=mode == "async", step=step)
            saved = time.perf_counter()
            dist.barrier()
            if index or steps == 1:
                steady.append(time.perf_counter() - started)
                for part, seconds in (("train", trained - started), ("wait", waited - trained), ("save", saved - waited)):
                    times.setdefault(f"{mode} {part}", []).append(seconds)
        drained = time.perf_counter()
        state.wait()  # the block's last asynchronous save, written and published
        dist.barrier()
        cpu = time.process_time() - cpu  # every thread of the rank, the writer's too: `steps` steps and saves
        times.setdefault(f"{mode} drain", []).append(time.perf_counter() - drained)
        times.setdefault(mode, []).append(statistics.mean(steady))
        times.setdefault(f"{mode} cpu", []).append(cpu / steps)
        state.prune(directory, keep=1)  # outside the timed steps: deleting is not part of saving

    for mode in args.modes:  # warm-up, not timed: the first steps and the first save allocate
        block(mode, 1)
    times.clear()
    for round_ in range(args.rounds):  # alternating (A B, B A, ...), so that a drift of the machine's speed cancels
        for mode in args.modes if round_ % 2 == 0 else args.modes[::-1]:
            block(mode, args.steps)
    newest = state.latest(directory)
    if newest is not None and dist.get_rank() == 0:
        times["bytes"] = [float(sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()))]
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


def _one_run(args: argparse.Namespace) -> dict[str, Any]:
    """One launch of ``--pp`` fresh ranks: the disk probed, then the alternating blocks; the run's figures."""
    from pipe.distributed.local_ranks import run_local_ranks

    directory = tempfile.mkdtemp(prefix="pipe-checkpoint-bench-", dir=args.dir)
    try:
        disk = _disk_write_mb_s(directory, args.disk_probe_mb) if args.disk_probe_mb else None
        per_rank = run_local_ranks(_rank, args.pp, args, directory, timeout=1800.0, deadline=7200.0)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    # Ranks meet at a barrier at every step and at the end of every block, so a block takes the slowest rank's time.
    blocks = {mode: [max(rank[mode][k] for rank in per_rank) for k in range(args.rounds)] for mode in args.modes}
    result: dict[str, Any] = {"step_s_per_block": blocks, "median_step_s": {m: statistics.median(v) for m, v in blocks.items()}}
    if "none" in blocks:
        # Each saving block over the block without saves of the same round: the machine's drift is shared.
        result["over_none_per_round"] = {mode: [blocks[mode][k] / blocks["none"][k] for k in range(args.rounds)]
                                         for mode in args.modes if mode != "none"}
        result["over_none"] = {mode: statistics.median(v) for mode, v in result["over_none_per_round"].items()}
    saving = [mode for mode in args.modes if mode != "none"]
    # Each part's median over the saving steps of the slowest rank's (the parts of one step need not add up).
    result["median_parts_s"] = {
        mode: {part: statistics.median(max(rank[f"{mode} {part}"][k] for rank in per_rank)
                                       for k in range(len(per_rank[0][f"{mode} {part}"])))
               for part in ("train", "wait", "save", "drain")} for mode in saving}
    if "bytes" in per_rank[0]:
        result["checkpoint_bytes"] = per_rank[0]["bytes"][0]
    result["disk_write_mb_s"] = disk
    if disk and "checkpoint_bytes" in result and "none" in blocks:
        # With a save every step the disk must write one checkpoint per step: an asynchronous step cannot be shorter
        # than the disk's time for one checkpoint, whatever the engine does.
        write_s = result["checkpoint_bytes"] / 1e6 / disk
        result["disk_write_s_per_checkpoint"] = write_s
        result["disk_floor_over_none"] = max(1.0, write_s / result["median_step_s"]["none"])
    cores = len(os.sched_getaffinity(0))
    cpu = {mode: statistics.median(sum(rank[f"{mode} cpu"][k] for rank in per_rank) for k in range(args.rounds))
           for mode in args.modes}
    result["cores"] = cores
    result["cpu_s_per_step"] = cpu  # the CPU time of all ranks per step (median over blocks)
    if "none" in blocks:
        # A step cannot take less wall time than its CPU time over the cores. So cpu[mode] / (cores x a step without
        # saves) is a floor for mode's ratio: the save's own CPU work (the copy to host memory, the writes) that the
        # cores, already busy with training, have no room to hide.
        none = result["median_step_s"]["none"]
        result["cores_busy_without_saves"] = cpu["none"] / (none * cores)
        result["cpu_floor_over_none"] = {mode: max(1.0, cpu[mode] / (none * cores)) for mode in saving}
    return result


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the 6M-parameter model of loading.py --quick")
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=3,
                        help="steps per block, the first not timed (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of one block of each mode, alternating their order (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=1, help="launches of fresh ranks, one after another (default: 1)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="the modes to run, in this order (default: all)")
    parser.add_argument("--disk-probe-mb", type=int, default=2048,
                        help="MB written and fsync'ed before each run to measure the disk (default: %(default)s; 0: skip)")
    parser.add_argument("--note", default="", help="where the figures were taken (a busy machine, the disk)")
    parser.add_argument("--output", default=None,
                        help="the results file's name in benchmarks/results (default: checkpoint.json; with --quick: "
                             "checkpoint-quick.json)")
    args = parser.parse_args()
    for flag in ("steps", "rounds", "runs", "pp"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.output is not None and (os.path.basename(args.output) != args.output or not args.output.endswith(".json")):
        parser.error(f"--output {args.output!r}: give a file name ending in .json (it is written to {RESULTS})")
    if len(set(args.modes)) != len(args.modes):
        parser.error(f"--modes names a mode twice: {args.modes}")
    logging.basicConfig(level=logging.WARNING)
    runs = []
    for index in range(args.runs):
        runs.append(_one_run(args))
        print(f"run {index + 1} of {args.runs}: step " + ", ".join(
            f"{mode} {seconds:.2f} s" for mode, seconds in runs[-1]["median_step_s"].items())
            + "".join(f"; {mode} / none {_spread(v)} over the rounds"
                      for mode, v in runs[-1].get("over_none_per_round", {}).items()), flush=True)
    result: dict[str, Any] = {
        "model": "loading.py --quick (6M)" if args.quick else "loading.py (0.5B)", "pp": args.pp,
        "batch_size": args.batch_size, "seq_len": args.seq_len, "chunks": args.chunks, "steps_per_block": args.steps,
        "rounds": args.rounds, "modes": args.modes, "torch": torch.__version__, "note": args.note,
        "command": "python benchmarks/checkpoint.py " + " ".join(sys.argv[1:]), "runs": runs,
    }
    saving = [mode for mode in args.modes if mode != "none"]
    if "none" in args.modes:
        # The headline: each run's median over its rounds; their median and range over the runs.
        result["over_none_per_run"] = {mode: [run["over_none"][mode] for run in runs] for mode in saving}
        result["over_none"] = {mode: statistics.median(v) for mode, v in result["over_none_per_run"].items()}
    RESULTS.mkdir(exist_ok=True)
    name = args.output or ("checkpoint-quick.json" if args.quick else "checkpoint.json")
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
    for mode, ratios in result.get("over_none_per_run", {}).items():
        rounds = [r for run in runs for r in run["over_none_per_round"][mode]]
        print(f"{mode} / none, a save every step: {_spread(ratios)} over {len(runs)} run(s); every round: "
              f"{min(rounds):.2f}-{max(rounds):.2f}")
    for mode in saving:
        parts = [run["median_parts_s"][mode] for run in runs]
        print(f"{mode}: " + ", ".join(f"{part} {min(p[part] for p in parts):.2f}-{max(p[part] for p in parts):.2f} s"
                                      for part in ("train", "wait", "save", "drain"))
              + " (a saving step's training, its wait for the save before, the save call; a block's last drain)")
    last = runs[-1]
    if "disk_write_s_per_checkpoint" in last:
        print(f"one checkpoint is {last['checkpoint_bytes'] / 1e9:.2f} GB; the disk writes "
              + ", ".join(f"{run['disk_write_mb_s']:.0f}" for run in runs) + " MB/s, so a step with a save every "
              "step is at least " + ", ".join(f"{run['disk_floor_over_none']:.2f}x" for run in runs) + " a step without")
    if "cpu_floor_over_none" in last:
        print("without saves the cores are " + ", ".join(f"{run['cores_busy_without_saves']:.0%}" for run in runs)
              + " busy; the CPU time of a saving step over the cores, over a step without: "
              + "; ".join(", ".join(f"{m} {r:.2f}x" for m, r in run["cpu_floor_over_none"].items()) for run in runs))
    print(f"written to {RESULTS / name}")


if __name__ == "__main__":
    main()
