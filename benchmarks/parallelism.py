"""Pipeline x sharded data parallelism: per-rank state bytes, step time and collectives, against replicas and torch.

Four gloo ranks on this machine, one intra-op thread each, train the same
decoder (token embedding, ``nn.TransformerEncoderLayer`` blocks, a head; AdamW,
whose two moments make the optimizer state twice the parameters) as a
2-stage pipeline with two data-parallel ranks per stage, 1F1B, no activation
checkpointing. Configurations, each in fresh processes, alternating
``--repeats`` times:

    replicate    DistributedPipe, mesh (pp 2, dp_replicate 2)
    zero3        DistributedPipe, mesh (pp 2, dp_shard 2), reshard after forward, a stage gathered whole (unit="stage")
    zero2        DistributedPipe, mesh (pp 2, dp_shard 2), no reshard after forward
    torch-zero3  torch.distributed.pipelining: PipelineStage + Schedule1F1B over fully_shard stages
    torch-zero2  the same, reshard_after_forward=False

Per rank it records the bytes of parameters, gradients and optimizer state
after a step (before ``zero_grad``), their in-step peak (sampled every 0.2 ms
by a thread during one extra step, FSDP's unsharded parameters and gradients
included), the step time, the peak resident memory the rank gained, and the
all-gathers and reduce-scatters per step. A last launch counts the
all-gathers per step of each schedule (gpipe, 1f1b, interleaved, looped-bfs)
under ZeRO-3. Every ratio compares configurations of the same run.

Run:
    python benchmarks/parallelism.py            # d=384, 6 blocks, 13.8M parameters; 12 minutes at load 30
    python benchmarks/parallelism.py --quick    # d=128, 2 blocks, 0.7M parameters; 2 minutes at load 12
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import multiprocessing
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from forked_ranks import run_forked_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from parallelism import Embed  # noqa: E402  (the example's embedding layer)

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
CONFIGS = ("replicate", "zero3", "zero2", "torch-zero3", "torch-zero2")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped-bfs")


def decoder(args: argparse.Namespace) -> nn.Sequential:
    """Embedding, ``args.blocks`` pre-norm transformer blocks (torch's own ``TransformerEncoderLayer``), a head."""
    torch.manual_seed(0)
    blocks = [nn.TransformerEncoderLayer(args.width, args.heads, 4 * args.width, dropout=0.0, batch_first=True,
                                         norm_first=True) for _ in range(args.blocks)]
    head = nn.Sequential(nn.LayerNorm(args.width), nn.Linear(args.width, args.vocab))
    return nn.Sequential(Embed(args.vocab, args.width), *blocks, head)


def loss_fn(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


# -- what a rank measures ----------------------------------------------------------------------------


def _storages(modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the distinct storages of parameters, gradients and optimizer state, FSDP's unsharded ones too."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    kinds: dict[str, dict[int, int]] = {"params": {}, "grads": {}, "optimizer": {}}

    def add(kind: str, tensor: Any) -> None:
        if not isinstance(tensor, Tensor):
            return
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        storage = tensor.untyped_storage()
        if storage.nbytes():
            kinds[kind][storage.data_ptr()] = storage.nbytes()

    for module in modules:
        for p in module.parameters():
            add("params", p)
            add("grads", p.grad)
        for sub in module.modules():
            if not isinstance(sub, FSDPModule):
                continue
            group = sub._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else ():
                for output in getattr(fsdp_param, "all_gather_outputs", ()):
                    add("params", output)
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    add("params", unsharded)
                    add("grads", unsharded.grad)
    for state in optimizer.state.values():
        for value in state.values():
            add("optimizer", value)
    sizes = {kind: sum(by_ptr.values()) for kind, by_ptr in kinds.items()}
    sizes["total"] = sum(sizes.values())
    return sizes


class PeakSampler:
    """Samples :func:`_storages` from a thread while a step runs; keeps the largest total."""

    def __init__(self, sample: Callable[[], dict[str, int]]) -> None:
        self.sample, self.peak, self._stop = sample, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.sample()["total"])
            except RuntimeError:  # a storage freed while read: take the next sample
                pass
            time.sleep(0.0002)

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class Collectives:
    """Counts FSDP2's all-gathers and reduce-scatters (``dist.all_gather_single``/``reduce_scatter_single``)."""

    def __init__(self) -> None:
        self.all_gathers = self.reduce_scatters = 0
        for name, attr in (("all_gather_single", "all_gathers"), ("reduce_scatter_single", "reduce_scatters")):
            original = getattr(dist, name)

            def counted(*a: Any, _original: Any = original, _attr: str = attr, **k: Any) -> Any:
                setattr(self, _attr, getattr(self, _attr) + 1)
                return _original(*a, **k)

            setattr(dist, name, counted)

    def reset(self) -> None:
        self.all_gathers = self.reduce_scatters = 0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _batch(args: argparse.Namespace, step: int, replica: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + replica)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


# -- the engines -------------------------------------------------------------------------------------


def _pipe_engine(args: argparse.Namespace, config: str, schedule: str = "1f1b") -> tuple[Any, list[nn.Module]]:
    """A DistributedPipe on the mesh of ``config``; returns (step function, modules)."""
    from pipe.distributed import DistributedPipe, Shard, make_mesh

    replicas = {"dp_replicate": 2} if config == "replicate" else {"dp_shard": 2}
    mesh = make_mesh(pp=2, **replicas)
    virtual = 2 if schedule in ("interleaved", "looped-bfs") else 1
    # A stage gathered whole (once per run of its actions), the unit these figures were taken with.
    shard = None if config == "replicate" else Shard(reshard_after_forward=config == "zero3", unit="stage")
    pipe = DistributedPipe(decoder(args), chunks=args.microbatches, checkpoint="never", schedule=schedule,
                           virtual_stages=virtual, mesh=mesh, shard=shard)
    replica = dist.get_rank() % 2

    def step(k: int) -> None:
        x, y = _batch(args, k, replica)
        pipe.step(x, y, loss_fn)

    return step, [pipe]


def _torch_engine(args: argparse.Namespace, config: str) -> tuple[Any, list[nn.Module]]:
    """torch.distributed.pipelining over fully_shard stages on the same mesh (ranks {0,1} stage 0, {2,3} stage 1)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    pp = mesh.get_local_rank("pp")
    model = decoder(args)
    half = (len(model) + 1) // 2
    stage_module = model[:half] if pp == 0 else model[half:]
    del model
    reshard = config == "torch-zero3"
    for block in stage_module:
        fully_shard(block, mesh=mesh["dp_shard"], reshard_after_forward=reshard)
    fully_shard(stage_module, mesh=mesh["dp_shard"], reshard_after_forward=reshard)
    stage = PipelineStage(stage_module, stage_index=pp, num_stages=2, device=torch.device("cpu"),
                          group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    replica = mesh.get_local_rank("dp_shard")

    def step(k: int) -> None:
        x, y = _batch(args, k, replica)
        if pp == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])

    return step, [stage_module]


def _rank(rank: int, port: int, args: argparse.Namespace, results: "multiprocessing.Queue[Any]") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="4")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=datetime.timedelta(seconds=600))
    counter = Collectives()
    for engine in ("pipe.distributed", "torch.distributed.pipelining"):  # loaded before the baseline, so
        importlib.import_module(engine)  # that the peak counts training, not either engine's import
    before = _rss_bytes()
    if args.config == "schedules":
        counts = {}
        for schedule in SCHEDULES:
            try:
                step, _ = _pipe_engine(args, "zero3", schedule)
            except ValueError as error:  # a schedule this checkout does not have (every rank alike)
                counts[schedule] = {"error": str(error).split(";")[0]}
                continue
            step(0)
            counter.reset()
            step(1)
            counts[schedule] = {"all_gathers": counter.all_gathers, "reduce_scatters": counter.reduce_scatters}
        results.put({"rank": rank, "collectives": counts})
        dist.destroy_process_group()
        return
    build = _torch_engine if args.config.startswith("torch") else _pipe_engine
    step, modules = build(args, args.config)
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    def train(k: int) -> None:
        step(k)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for k in range(args.warmup):
        train(k)
    dist.barrier()
    counter.reset()
    start = time.perf_counter()
    for k in range(args.steps):
        train(args.warmup + k)
    dist.barrier()
    elapsed = time.perf_counter() - start
    collectives = {"all_gathers": counter.all_gathers / args.steps,
                   "reduce_scatters": counter.reduce_scatters / args.steps}
    with PeakSampler(lambda: _storages(modules, optimizer)) as sampler:  # one more step, sampled
        step(args.warmup + args.steps)
        optimizer.step()
    after = _storages(modules, optimizer)  # parameters, gradients and optimizer state after the step
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    results.put({"rank": rank, "step_s": elapsed / args.steps, "state_bytes": after,
                 "peak_state_bytes": max(sampler.peak, after["total"]), "peak_rss_gain": peak_rss - before,
                 **collectives})
    dist.destroy_process_group()


def worker(args: argparse.Namespace) -> None:
    """One configuration, 4 ranks forked from this process; prints one JSON line."""
    print(json.dumps(run_forked_ranks(_rank, args, ranks=4)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="d=128, 2 blocks, 2 steps: under a minute quiet")
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="samples per data-parallel rank and step")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="runs per configuration, alternating")
    parser.add_argument("--config", choices=CONFIGS + ("schedules",), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.width, args.blocks, args.heads, args.vocab, args.steps, args.repeats = 128, 2, 4, 1024, 2, 1
    if args.config:
        worker(args)
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    flags = [f"--{name}={getattr(args, name)}" for name in
             ("width", "blocks", "heads", "vocab", "seq", "batch", "microbatches", "steps", "warmup")]

    def launch(config: str) -> list[dict[str, Any]]:
        out = subprocess.run([sys.executable, __file__, "--config", config, *flags], env=env, check=True,
                             capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    runs: dict[str, list[list[dict[str, Any]]]] = {config: [] for config in CONFIGS}
    load = os.getloadavg()
    for _ in range(args.repeats):
        for config in CONFIGS:
            runs[config].append(launch(config))
    schedules = launch("schedules")

    def per_rank(config: str, value: Callable[[dict[str, Any]], float]) -> float:
        """The largest over ranks (the rank that limits), median over repeats."""
        return statistics.median(max(value(r) for r in run) for run in runs[config])

    state = {c: per_rank(c, lambda r: r["state_bytes"]["total"]) for c in CONFIGS}
    peak = {c: per_rank(c, lambda r: r["peak_state_bytes"]) for c in CONFIGS}
    step = {c: per_rank(c, lambda r: r["step_s"]) for c in CONFIGS}
    rss = {c: per_rank(c, lambda r: r["peak_rss_gain"]) for c in CONFIGS}
    result = {
        "config": {k: getattr(args, k) for k in ("width", "blocks", "heads", "vocab", "seq", "batch",
                                                 "microbatches", "steps", "warmup", "repeats", "quick")},
        "parameters": sum(p.numel() for p in decoder(args).parameters()),
        "mesh": "(pp 2, dp 2), 4 gloo ranks x 1 thread, 1F1B, AdamW, checkpoint='never'",
        "load_average_at_start": load, "load_average_at_end": os.getloadavg(),
        "state_bytes_ratio_zero3": state["zero3"] / state["replicate"],
        "state_bytes_ratio_zero2": state["zero2"] / state["replicate"],
        "peak_state_bytes_ratio_zero3": peak["zero3"] / peak["replicate"],
        "peak_state_bytes_ratio_zero2": peak["zero2"] / peak["replicate"],
        "torch_peak_state_bytes_ratio_zero3": peak["torch-zero3"] / peak["replicate"],
        "torch_peak_state_bytes_ratio_zero2": peak["torch-zero2"] / peak["replicate"],
        "step_ratio_zero3": step["zero3"] / step["replicate"],
        "step_ratio_zero2": step["zero2"] / step["replicate"],
        "torch_step_ratio_zero3": step["torch-zero3"] / step["replicate"],
        "torch_step_ratio_zero2": step["torch-zero2"] / step["replicate"],
        "vs_torch_throughput": step["torch-zero3"] / step["zero3"],
        "vs_torch_peak": rss["zero3"] / rss["torch-zero3"],
        "vs_torch_throughput_zero2": step["torch-zero2"] / step["zero2"],
        "vs_torch_peak_zero2": rss["zero2"] / rss["torch-zero2"],
        "step_ratios_per_repeat": {f"{c} / replicate": [max(r["step_s"] for r in run) / max(r["step_s"] for r in base)
                                                        for run, base in zip(runs[c], runs["replicate"])]
                                   for c in CONFIGS[1:]},
        "all_gathers_per_step": {c: per_rank(c, lambda r: r["all_gathers"]) for c in CONFIGS},
        "reduce_scatters_per_step": {c: per_rank(c, lambda r: r["reduce_scatters"]) for c in CONFIGS},
        "schedules_zero3": {s: max(r["collectives"][s].get("all_gathers", -1) for r in schedules) for s in SCHEDULES},
        "state_bytes": state, "peak_state_bytes": peak, "step_s": step, "peak_rss_gain_bytes": rss,
        "runs": runs,
        "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
    }
    print(f"parallelism ({result['parameters'] / 1e6:.1f}M parameters, {result['mesh']}; "
          f"load {load[0]:.1f} at start):")
    for key in ("state_bytes_ratio_zero3", "state_bytes_ratio_zero2", "peak_state_bytes_ratio_zero3",
                "peak_state_bytes_ratio_zero2", "torch_peak_state_bytes_ratio_zero3",
                "torch_peak_state_bytes_ratio_zero2", "step_ratio_zero3", "step_ratio_zero2",
                "torch_step_ratio_zero3", "torch_step_ratio_zero2", "vs_torch_throughput", "vs_torch_peak",
                "vs_torch_throughput_zero2", "vs_torch_peak_zero2"):
        print(f"  {key}: {result[key]:.3f}")
    print(f"  all-gathers per step (ZeRO-3, per rank): {result['schedules_zero3']}")
    for name, ratios in result["step_ratios_per_repeat"].items():
        print(f"  step time {name}, each repeat: " + ", ".join(f"{ratio:.2f}" for ratio in ratios))
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"parallelism{'-quick' if args.quick else ''}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"  saved {path.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
