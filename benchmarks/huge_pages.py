"""FSDP's CPU gathers with and without huge pages (``THP_MEM_ALLOC_ENABLE=1``), and a training step.

torch backs a CPU tensor of 2 MiB or more with the kernel's 2 MiB transparent
huge pages only when ``THP_MEM_ALLOC_ENABLE=1`` is in the environment before
it starts (with the kernel in ``madvise`` mode, most distributions' default).
FSDP2 gathers each unit into memory allocated afresh, so on the CPU much of a
gather is the kernel handing out pages. With the setting on and off,
alternating, ``--runs`` times, each in fresh interpreters:

* ``gather_s``: 2 gloo ranks, ``fully_shard`` over one unit of ``--megabytes``
  MB (seven linear weights, a decoder layer's shapes), the median of 10 of its
  ``unshard()`` and ``reshard()``;
* ``fresh_s``: the median of 20 allocations and fills of a tensor of the
  unit's size, on rank 0;
* ``--step``: one training step of ``benchmarks/step_memory.py`` (the 0.5B
  LLaMA at pp 2 x dp_shard 2, ZeRO-3 a layer at a time; pipe and torch's
  pipelining, one run each per setting): its time and peak per engine.

The kernel's mode is read from ``/sys/kernel/mm/transparent_hugepage/enabled``
and saved with the results; in ``always`` mode the setting changes little, in
``never`` nothing.

Run:
    python benchmarks/huge_pages.py            # the gathers: about a minute
    python benchmarks/huge_pages.py --step     # and the step: about half an hour
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SETTINGS = {"on": "1", "off": "0"}


def _gather(rank: int, world: int, megabytes: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    # A LLaMA decoder layer's linear weights (q, k, v, o: h x h; gate, up: 4h x h; down: h x 4h) = 16 h^2.
    hidden = int((megabytes * 1e6 / 4 / 16) ** 0.5) // 64 * 64
    unit = nn.Sequential(*[nn.Linear(hidden, hidden, bias=False) for _ in range(4)],
                         *[nn.Linear(hidden, 4 * hidden, bias=False) for _ in range(2)],
                         nn.Linear(4 * hidden, hidden, bias=False))
    fully_shard(unit, mesh=init_device_mesh("cpu", (world,)))
    gathers = []
    for _ in range(12):
        dist.barrier()
        started = time.perf_counter()
        unit.unshard()
        unit.reshard()
        gathers.append(time.perf_counter() - started)
    numel = sum(p.numel() for p in unit.parameters())
    fresh = []
    for _ in range(20):
        started = time.perf_counter()
        torch.empty(numel).fill_(1.0)
        fresh.append(time.perf_counter() - started)
    return {"gather_s": statistics.median(gathers[2:]), "fresh_s": statistics.median(fresh),
            "unit_bytes": numel * 4}


def _step(setting: str) -> dict[str, Any]:
    name = f"huge-pages-{setting}"
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": SETTINGS[setting]}
    subprocess.run([sys.executable, str(HERE / "step_memory.py"), "--runs", "1", "--engines", "pipe", "torch",
                    "--name", name], env=env, check=True)
    path = RESULTS / f"step_memory-{name}.json"
    summary = json.loads(path.read_text())["summary"]
    path.unlink()  # this run's figures are kept below
    return {engine: {key: summary[engine][key]["median"] for key in ("step_s", "peak_over_share")}
            for engine in ("pipe", "torch")}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs of each setting, alternating (default 3)")
    parser.add_argument("--megabytes", type=int, default=96, help="the gathered unit's size (default 96 MB)")
    parser.add_argument("--step", action="store_true", help="also one training step per setting and run")
    args = parser.parse_args()
    import huge_pages  # the ranks' function, importable by the fresh interpreters
    from pipe.distributed.local_ranks import run_local_ranks

    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        mode = "unknown"
    runs: dict[str, list[dict[str, Any]]] = {setting: [] for setting in SETTINGS}
    for run in range(args.runs):
        for setting, value in SETTINGS.items():
            ranks = run_local_ranks(huge_pages._gather, 2, args.megabytes, timeout=300, deadline=600,
                                    env={"THP_MEM_ALLOC_ENABLE": value}, start_method="interpreter")
            result = {"gather_s": max(r["gather_s"] for r in ranks), "fresh_s": ranks[0]["fresh_s"],
                      "unit_bytes": ranks[0]["unit_bytes"]}
            if args.step:
                result["step"] = _step(setting)
            runs[setting].append(result)
            print(f"run {run + 1} THP_MEM_ALLOC_ENABLE={value}: gather of {result['unit_bytes'] / 1e6:.0f} MB "
                  f"{result['gather_s'] * 1e3:.1f} ms, fresh tensor {result['fresh_s'] * 1e3:.1f} ms"
                  + (f", step pipe {result['step']['pipe']['step_s']:.1f} s, torch "
                     f"{result['step']['torch']['step_s']:.1f} s" if args.step else ""), flush=True)
    on, off = runs["on"], runs["off"]
    summary: dict[str, Any] = {
        "gather_on_over_off": _spread([a["gather_s"] / b["gather_s"] for a, b in zip(on, off)]),
        "fresh_on_over_off": _spread([a["fresh_s"] / b["fresh_s"] for a, b in zip(on, off)]),
        "gather_s": {s: _spread([r["gather_s"] for r in runs[s]]) for s in SETTINGS}}
    if args.step:
        for engine in ("pipe", "torch"):
            summary[f"{engine}_step_on_over_off"] = _spread(
                [a["step"][engine]["step_s"] / b["step"][engine]["step_s"] for a, b in zip(on, off)])
            summary[f"{engine}_peak_on_over_off"] = _spread(
                [a["step"][engine]["peak_over_share"] / b["step"][engine]["peak_over_share"] for a, b in zip(on, off)])
        for setting in SETTINGS:
            summary[f"pipe_over_torch_step_{setting}"] = _spread(
                [r["step"]["pipe"]["step_s"] / r["step"]["torch"]["step_s"] for r in runs[setting]])
    for key, value in summary.items():
        print(key, json.dumps(value))
    import torch

    result = {"config": {"megabytes": args.megabytes, "runs": args.runs, "step": args.step, "kernel_thp": mode},
              "summary": summary, "runs": runs, "load_average": os.getloadavg(), "cpus": os.cpu_count(),
              "torch": torch.__version__,
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=HERE).stdout.strip()}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / ("huge_pages" + ("-step" if args.step else "") + ".json")
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
