"""How steady this machine's speed is: the planner benchmark's reference computation, timed back to back.

`benchmarks/planner.py` times a fixed computation (`reference()`) around each
plan, since the machine switches between two speeds (docs/planner.md, *The
machine's two speeds*). This script times the same computation for 20 s in
one process, then for 20 s in two processes at once, as the benchmark's two
ranks run, twice over. It reports the fastest and the median, and how often
each run came within 10% of the fastest that one process saw (the
benchmark's `QUIET`): the share of time the machine spends in its fast state.

Run:
    python benchmarks/machine_speed.py               # about 80 s; nothing else should run
Results: printed, and saved to benchmarks/results/machine_speed.json.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from planner import QUIET, is_quiet, reference  # noqa: E402


def series(seconds: float, results: "multiprocessing.Queue[list[float]] | None" = None) -> list[float]:
    """Back-to-back references (50 ms apart) for ``seconds``."""
    torch.set_num_threads(1)
    times: list[float] = []
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        times.append(reference())
        time.sleep(0.05)
    if results is not None:
        results.put(times)
    return times


def summary(times: list[float], fastest: float) -> dict[str, Any]:
    return {"count": len(times), "fastest_ms": min(times) * 1e3, "median_ms": statistics.median(times) * 1e3,
            "fast_share": sum(is_quiet(t, fastest) for t in times) / len(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each series (default 20)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of one, then two processes (default 2)")
    args = parser.parse_args()
    context = multiprocessing.get_context("fork")
    rounds = []
    for number in range(args.rounds):
        alone = series(args.seconds)
        queue: "multiprocessing.Queue[list[float]]" = context.Queue()
        processes = [context.Process(target=series, args=(args.seconds, queue)) for _ in range(2)]
        for process in processes:
            process.start()
        both = [queue.get(timeout=args.seconds + 60) for _ in processes]
        for process in processes:
            process.join()
        fastest = min(alone)
        row: dict[str, Any] = {"one_process": summary(alone, fastest), "two_processes": [summary(b, fastest) for b in both]}
        rounds.append(row)
        print(f"round {number + 1}: one process: fastest {row['one_process']['fastest_ms']:.2f} ms, median "
              f"{row['one_process']['median_ms']:.2f} ms, fast {row['one_process']['fast_share']:.0%}; two at once: "
              + "; ".join(f"median {r['median_ms']:.2f} ms, fast {r['fast_share']:.0%}" for r in row["two_processes"]),
              flush=True)
    out = HERE / "results" / "machine_speed.json"
    out.write_text(json.dumps({"quiet": QUIET, "seconds": args.seconds, "rounds": rounds,
                               "torch": torch.__version__}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
