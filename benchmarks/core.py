"""P1-P4: Pipe's overhead, CPU concurrency, recomputation cost and activation memory.

Every figure is a ratio of two measurements taken in this one run, printed and
saved to benchmarks/results/core.json. Peak memory is measured in a fresh
process per configuration (peak RSS with glibc's MALLOC_MMAP_THRESHOLD_=65536 so
that freed activations leave RSS; on CUDA, torch.cuda.max_memory_allocated).

Run:
    python benchmarks/core.py            # full sizes, a few minutes on 2 cores
    python benchmarks/core.py --quick    # small sizes, under a minute
    python benchmarks/core.py --only P2  # one figure

P2 includes torchgpipe 0.0.7 (PyPI) as a peer when it can be installed into a
folder beside this file (benchmarks/.peer-torchgpipe, put on the child's
PYTHONPATH, so the peer runs on this interpreter's torch also inside a
virtual environment); --no-peer skips it.
"""
from __future__ import annotations

import argparse
import gc
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

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PEER_DIR = HERE / ".peer-torchgpipe"


def mlp(width: int, layers: int, seed: int = 0) -> nn.Sequential:
    """A stack of Linear+Tanh blocks: uniform cost per layer, easy to balance."""
    torch.manual_seed(seed)
    modules: list[nn.Module] = []
    for _ in range(layers):
        modules += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*modules)


def wrap(model: nn.Sequential, engine: str, **kwargs: Any) -> nn.Module:
    if engine == "plain":
        return model
    if engine == "pipe":
        from pipe import Pipe

        return Pipe(model, **kwargs)
    if engine == "torchgpipe":
        import torchgpipe  # only in the peer's child process (PYTHONPATH has its folder)

        kwargs.pop("cpu_threads", None)
        return torchgpipe.GPipe(model, **kwargs)
    raise ValueError(f"unknown engine {engine!r}")


def step_time(model: nn.Module, batch: torch.Tensor, *, warmup: int, repeat: int) -> float:
    """Median seconds of one training step (forward, loss, backward)."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(batch).square().mean().backward()

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed(engine: str, width: int, layers: int, batch_size: int, main_threads: int, warmup: int, repeat: int,
          **kwargs: Any) -> float:
    torch.set_num_threads(main_threads)
    model = wrap(mlp(width, layers), engine, **kwargs)
    batch = torch.randn(batch_size, width)
    seconds = step_time(model, batch, warmup=warmup, repeat=repeat)
    if hasattr(model, "close"):
        model.close()
    return seconds


# -- P1 ---------------------------------------------------------------------------------------

def p1(size: dict[str, int], warmup: int, repeat: int) -> dict[str, Any]:
    """Steps of the plain module and of the Pipe alternate, so drift of a shared machine hits both alike."""
    torch.set_num_threads(torch.get_num_threads())
    plain = mlp(size["width"], size["layers"])
    piped = wrap(mlp(size["width"], size["layers"]), "pipe", chunks=1, checkpoint="never")
    batch = torch.randn(size["batch"], size["width"])
    times: dict[str, list[float]] = {"plain": [], "pipe": []}
    for _ in range(warmup):
        for model in (plain, piped):
            step_time(model, batch, warmup=0, repeat=1)
    for _ in range(repeat * 4):
        times["plain"].append(step_time(plain, batch, warmup=0, repeat=1))
        times["pipe"].append(step_time(piped, batch, warmup=0, repeat=1))
    piped.close()  # type: ignore[operator]
    result: dict[str, Any] = {"plain_s": statistics.median(times["plain"]), "pipe_s": statistics.median(times["pipe"]),
                              "steps_each": len(times["plain"])}
    result["ratio"] = result["pipe_s"] / result["plain_s"]
    result["target"] = "<= 1.05"
    return result


# -- P2, P3 -----------------------------------------------------------------------------------

def p2(size: dict[str, int], warmup: int, repeat: int, peer: bool) -> dict[str, Any]:
    common = dict(width=size["width"], layers=size["layers"], batch_size=size["batch"], warmup=warmup, repeat=repeat)
    half = size["layers"]  # modules = 2 * layers
    two = dict(chunks=8, checkpoint="never", balance=[half, half], devices=["cpu", "cpu"], cpu_threads=1)
    r: dict[str, Any] = {}
    r["plain_1thread_s"] = timed("plain", main_threads=1, **common)
    r["plain_2threads_s"] = timed("plain", main_threads=2, **common)
    r["pipe_s"] = timed("pipe", main_threads=1, **two, **common)
    r["speedup_vs_plain_1thread"] = r["plain_1thread_s"] / r["pipe_s"]
    r["speedup_vs_plain_2threads"] = r["plain_2threads_s"] / r["pipe_s"]
    r["ideal"] = 2 * 8 / 9
    r["target"] = ">= 1.5 vs plain on one thread"
    if peer:
        peer_s = run_peer(size, warmup, repeat)
        if peer_s is not None:
            r["torchgpipe_0.0.7_s"] = peer_s
            r["speedup_vs_torchgpipe"] = peer_s / r["pipe_s"]
    return r


def p3(size: dict[str, int], warmup: int, repeat: int) -> dict[str, Any]:
    common = dict(width=size["width"], layers=size["layers"], batch_size=size["batch"], warmup=warmup, repeat=repeat,
                  main_threads=1)
    half = size["layers"]
    kw = dict(chunks=8, balance=[half, half], devices=["cpu", "cpu"], cpu_threads=1)
    r = {"never_s": timed("pipe", checkpoint="never", **kw, **common),
         "always_s": timed("pipe", checkpoint="always", **kw, **common)}
    r["ratio"] = r["always_s"] / r["never_s"]
    r["target"] = "<= 1.4"
    return r


def run_peer(size: dict[str, int], warmup: int, repeat: int) -> float | None:
    # torchgpipe is pure Python: install it into a folder of its own and run it with this
    # interpreter, so it sees the same torch (a venv would not see torch when this project is
    # itself installed in a virtual environment).
    if not (PEER_DIR / "torchgpipe").exists():
        try:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(PEER_DIR),
                            "torchgpipe==0.0.7"], check=True)
        except (subprocess.CalledProcessError, OSError) as error:
            print(f"torchgpipe peer unavailable ({error}); skipping it")
            return None
    cmd = [sys.executable, __file__, "--child-peer", json.dumps({"size": size, "warmup": warmup, "repeat": repeat})]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PEER_DIR), os.environ.get("PYTHONPATH")])))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        print(f"torchgpipe peer failed: {out.stderr[-500:]}")
        return None
    return float(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])


def child_peer(spec: dict[str, Any]) -> None:
    size = spec["size"]
    half = size["layers"]
    seconds = timed("torchgpipe", width=size["width"], layers=size["layers"], batch_size=size["batch"], main_threads=1,
                    warmup=spec["warmup"], repeat=spec["repeat"], chunks=8, checkpoint="never",
                    balance=[half, half], devices=["cpu", "cpu"])
    print(json.dumps({"seconds": seconds}))


# -- P4 ---------------------------------------------------------------------------------------

def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def child_memory(spec: dict[str, Any]) -> None:
    """In a fresh process: peak memory of one training step above the level before it.

    A first step runs untimed, so that one-time costs (thread start-up, the
    first reentrant backward's ~40 MiB, allocator pools) are paid before the
    measurement; then the kernel's peak-RSS mark is reset (clear_refs 5) and
    the measured step's peak is read back from VmHWM.
    """
    torch.set_num_threads(1)
    size = spec["size"]
    model = mlp(size["width"], size["layers"])
    half = size["layers"]
    model = wrap(model, "pipe", chunks=8, checkpoint=spec["checkpoint"], balance=[half, half],
                 devices=["cpu", "cpu"], cpu_threads=1)
    batch = torch.randn(size["batch"], size["width"])
    device = torch.device("cuda") if torch.cuda.is_available() else None
    model(batch).square().mean().backward()
    model.zero_grad(set_to_none=False)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    model(batch).square().mean().backward()
    peak = (_status_kib("VmHWM") - before) * 1024
    print(json.dumps({"activation_peak_bytes": peak, "device": str(device or "cpu")}))


def p4(size: dict[str, int]) -> dict[str, Any]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    r: dict[str, Any] = {}
    for mode in ("never", "always"):
        spec = json.dumps({"size": size, "checkpoint": mode})
        out = subprocess.run([sys.executable, __file__, "--child-memory", spec], capture_output=True, text=True, env=env,
                             check=True)
        r[f"{mode}_peak_MiB"] = json.loads(out.stdout.strip().splitlines()[-1])["activation_peak_bytes"] / 2**20
    r["ratio"] = r["always_peak_MiB"] / r["never_peak_MiB"]
    r["target"] = "<= 0.35"
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--only", default="P1,P2,P3,P4", help="comma-separated subset of P1,P2,P3,P4")
    parser.add_argument("--no-peer", action="store_true", help="skip torchgpipe in P2")
    parser.add_argument("--child-memory", help=argparse.SUPPRESS)
    parser.add_argument("--child-peer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_memory:
        return child_memory(json.loads(args.child_memory))
    if args.child_peer:
        return child_peer(json.loads(args.child_peer))

    if args.quick:
        speed = {"width": 256, "layers": 8, "batch": 256}
        deep = {"width": 256, "layers": 32, "batch": 1024}
        warmup, repeat = 1, 3
    else:
        speed = {"width": 1024, "layers": 8, "batch": 4096}
        deep = {"width": 512, "layers": 64, "batch": 2048}
        warmup, repeat = 2, 5
    wanted = set(args.only.upper().split(","))
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine()},
        "quick": args.quick,
        "sizes": {"speed": speed, "deep": deep},
    }
    figures: dict[str, Callable[[], dict[str, Any]]] = {
        "P1": lambda: p1(speed, warmup, repeat),
        "P2": lambda: p2(speed, warmup, repeat, peer=not args.no_peer),
        "P3": lambda: p3(speed, warmup, repeat),
        "P4": lambda: p4(deep),
    }
    for name, run in figures.items():
        if name in wanted:
            results[name] = run()
            print(name, json.dumps(results[name], indent=2))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("core-quick.json" if args.quick else "core.json")
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"saved {out.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
