"""A ZeRO-3 training step of a HF LLaMA: pipe's peak against its bound and against torch's pipelining.

Both engines train the 0.5B LLaMA-style model of ``benchmarks/loading.py``
(fp32, untied head; ``--quick``: 6M parameters), loaded from the same
``save_pretrained`` directory, on 4 gloo ranks at (pp 2, dp_shard 2), each
pipeline a 1F1B step of 4 micro-batches of 1 x ``--tokens`` tokens, FSDP2
gathering one decoder layer at a time and resharding after each forward
(ZeRO-3), gradients reduce-scattered once, at the step's last backward:

* ``pipe``: ``pipe.split`` of the model on ``meta`` at the middle layer,
  ``DistributedPipe(..., checkpoint="never", shard=Shard(unit="block"))``
  (no recomputation, as torch's schedule), ``hf.load``;
* ``pipe-keep``: the same with ``Shard(unit="block", reshard_after_backward=False)``:
  each layer stays gathered from its first backward to the stage's reduce, as
  torch's ``PipelineStage`` keeps FSDP2 blocks (fewer gathers, more memory);
* ``pipe-lean``: the same as ``pipe`` with ``Shard(unit="block", prefetch=False)``:
  each layer gathered only when it runs, none beside it;
* ``torch``: torchtitan's layout with torch's own pieces: each rank keeps its
  stage's HF modules (the embedding on the first, the norm and head on the
  last), ``fully_shard`` on each decoder layer, the embedding, the head and
  the stage (``reshard_after_forward=True``: ZeRO-3; torchtitan keeps
  gathered weights through a pipelined step by default, which is ZeRO-2),
  ``to_empty``, ``dcp.load`` through DCP's ``HuggingFaceStorageReader``, and
  ``torch.distributed.pipelining``'s ``PipelineStage`` and ``Schedule1F1B``.

Per rank and step (two steps; the gradients set to None between them, as
an optimizer's ``zero_grad`` does), over the bytes of the shards the rank
holds (its share):

* ``peak``: the resident memory gained (VmHWM) over the rank's memory before
  it built the model. Every rank has glibc map each block of 1 MiB or more on
  its own (``mallopt(M_MMAP_THRESHOLD)``), so a freed tensor leaves the
  resident set at once and the peak is close to what was live;
* ``activations``: the most bytes autograd held for backward at once (saved
  tensors other than parameters, each storage once), counted by
  ``torch.autograd.graph.saved_tensors_hooks``;
* ``bound``: what a per-layer ZeRO-3 step needs: the share, the stage's
  gradients unsharded until the step's one reduce-scatter, the two largest
  units gathered, and the activations held;
* ``held before``: the resident memory gained before the step: the share,
  and memory the process holds that is no tensor (the libraries the build
  imported, the split's graphs, glibc's heap);
* ``step's own peak``: the share plus what the step added to what the rank
  held before it (VmHWM over VmRSS at the step's start), against the bound;
  the peak above counts the memory held before as well;
* ``after``: what stays resident after the step and ``zero_grad``;
* the step's time, and the loss (the engines must agree: same weights, same
  tokens).

The engines run in fresh processes, alternating, ``--runs`` times; the script
prints each run and the spread, and saves ``benchmarks/results/step_memory.json``.

Run:
    python benchmarks/step_memory.py             # 0.5B, 3 runs of the 4 engines: about an hour
    python benchmarks/step_memory.py --runs 2 --engines pipe pipe-lean --name lean   # step_memory-lean.json
    python benchmarks/step_memory.py --quick --runs 1   # 6M: about a minute
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SIZES = {"pp": 2, "dp_shard": 2}
CHUNKS = 4
ENGINES = ["pipe", "pipe-keep", "pipe-lean", "torch"]


class SavedBytes:
    """The bytes autograd holds for backward, live and at most, each storage counted once; parameters (and
    views of them, such as a transposed weight) are the share or a gathered unit, counted apart."""

    def __init__(self) -> None:
        self.users: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        base = tensor._base if tensor._base is not None else tensor
        if isinstance(base, nn.Parameter) or tensor.device.type == "meta":
            return tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.users:
            self.users[key] = 0
            self.sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.users[key] += 1
        holder = _Held(tensor)
        weakref.finalize(holder, self._release, key)
        return holder

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed

    def _release(self, key: int) -> None:
        self.users[key] -= 1
        if not self.users[key]:
            del self.users[key]
            self.live -= self.sizes.pop(key)


class _Held:
    """A saved tensor as autograd keeps it: freed with the graph that holds it."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _loading() -> Any:
    sys.path.insert(0, str(HERE))
    import loading
    return loading


def _tokens(config: Any, tokens: int) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (CHUNKS, tokens), generator=torch.Generator().manual_seed(1))


def _pipe_engine(config: Any, directory: str, mesh: Any, tokens: int,
                 keep: bool = False, prefetch: bool = True) -> tuple[Any, Callable[[], Any]]:
    import pipe
    from pipe.distributed import DistributedPipe, Shard, hf
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    stages = pipe.split(model, (ids,), {"use_cache": False}, at=[f"model.layers.{config.num_hidden_layers // 2}"])
    piped = DistributedPipe(stages, mesh=mesh, init_weights=False, chunks=CHUNKS, loss_reduction="count",
                            checkpoint="never",  # as torch's schedule: no micro-batch recomputed
                            shard=Shard(unit="block", reshard_after_backward=not keep, prefetch=prefetch))
    hf.load(directory, piped)
    batch = _tokens(config, tokens)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> Any:
        flat = labels[:, 1:].reshape(-1)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), flat, reduction="sum"), flat.numel()

    def step() -> Any:
        return piped.step(batch, batch, loss_fn)
    return piped, step


class _HFStage(nn.Module):
    """torchtitan's pipeline layout on a HF LLaMA: the stage's own decoder layers under their HF names, the
    embedding on the first stage, the final norm and the head on the last."""

    def __init__(self, model: Any, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.model = nn.Module()
        self.model.embed_tokens = model.model.embed_tokens if first else None
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
        self.model.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rotary = LlamaRotaryEmbedding(model.config)  # built on the CPU: its buffer is not in the checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.model.embed_tokens is not None else x
        positions = torch.arange(h.shape[1]).unsqueeze(0)
        rotary = self.rotary(h, positions)
        for layer in self.model.layers.values():  # no mask: the attention is causal by itself
            h = layer(h, position_ids=positions, position_embeddings=rotary)
        return self.lm_head(self.model.norm(h)) if self.lm_head is not None else h


def torch_stage(config: Any, directory: str, mesh: Any, device: str = "cpu") -> tuple[nn.Module, float]:
    """torchtitan's build and load with torch's own pieces: each rank's stage on ``meta`` (its HF modules),
    ``fully_shard`` on each decoder layer, the embedding, the head and the stage (ZeRO-3), ``to_empty``, and
    ``dcp.load`` through DCP's ``HuggingFaceStorageReader``. Returns the stage and the seconds the load took."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    index, stages = mesh["pp"].get_local_rank(), mesh["pp"].size()
    layers = config.num_hidden_layers
    module = _HFStage(model, range(layers * index // stages, layers * (index + 1) // stages), index == 0,
                      index == stages - 1)
    shards = mesh["dp_shard"]
    for unit in [module.model.embed_tokens, *module.model.layers.values(), module.lm_head]:
        if unit is not None:
            fully_shard(unit, mesh=shards, reshard_after_forward=True)
    fully_shard(module, mesh=shards, reshard_after_forward=True)
    rotary = {name: b.clone() for name, b in module.rotary.named_buffers()}
    module.to_empty(device=device)
    with torch.no_grad():
        for name, b in module.rotary.named_buffers():
            b.copy_(rotary[name])
    started = time.perf_counter()
    dcp.load(module.state_dict(), storage_reader=HuggingFaceStorageReader(directory))
    return module, time.perf_counter() - started


def _torch_engine(config: Any, directory: str, mesh: Any, tokens: int) -> tuple[Any, Callable[[], Any]]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    module, _ = torch_stage(config, directory, mesh)
    index, stages = mesh["pp"].get_local_rank(), mesh["pp"].size()
    stage = PipelineStage(module, index, stages, torch.device("cpu"), group=mesh["pp"].get_group())
    count = CHUNKS * (tokens - 1)  # each micro-batch's sum over the pipeline's tokens: the mean, as pipe's

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        flat = labels[:, 1:].reshape(-1)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), flat, reduction="sum") / count

    schedule = Schedule1F1B(stage, n_microbatches=CHUNKS, loss_fn=loss_fn, scale_grads=False)
    batch = _tokens(config, tokens)

    def step() -> Any:
        if index == 0:
            schedule.step(batch)
            return None
        losses: list[torch.Tensor] = []
        schedule.step(target=batch, losses=losses)
        return sum(losses)
    return module, step


def _rank(rank: int, port: int, engine: str, directory: str, args: argparse.Namespace,
          results: "multiprocessing.Queue[Any]") -> None:
    try:
        results.put(_measure(rank, port, engine, directory, args))
    except BaseException as error:  # report instead of leaving the parent waiting
        results.put({"rank": rank, "error": f"{type(error).__name__}: {error}"})
        raise


def _measure(rank: int, port: int, engine: str, directory: str, args: argparse.Namespace) -> dict[str, Any]:
    import ctypes
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: a freed block of 1 MiB or more leaves VmRSS
    loading = _loading()
    world = SIZES["pp"] * SIZES["dp_shard"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=1800))
    from pipe.distributed import make_mesh
    from torch.distributed.tensor import DTensor

    mesh = make_mesh(**SIZES)
    config = loading._config(args.quick)
    baseline = loading._status("VmRSS")
    if engine == "torch":
        module, step = _torch_engine(config, directory, mesh, args.tokens)
    else:
        module, step = _pipe_engine(config, directory, mesh, args.tokens, keep=engine == "pipe-keep",
                                    prefetch=engine != "pipe-lean")
    share = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                for p in module.parameters())
    stage_bytes = sum(p.numel() * p.element_size() for p in module.parameters())  # full sizes
    largest = loading.unit_bytes(module.named_parameters())[:2]
    steps = []
    for _ in range(2):
        import gc
        gc.collect()
        dist.barrier()
        held = loading._status("VmRSS")
        loading._reset_peak()
        saved = SavedBytes()
        started = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            loss = step()
        seconds = time.perf_counter() - started
        highest = loading._status("VmHWM")
        peak = highest - baseline
        for p in module.parameters():
            p.grad = None
        gc.collect()
        after = loading._status("VmRSS") - baseline
        bound = share + stage_bytes + sum(largest) + saved.peak
        steps.append({"step_s": seconds, "loss": None if loss is None else float(loss.detach()),
                      "peak_over_share": peak / share, "activations_over_share": saved.peak / share,
                      "bound_over_share": bound / share, "peak_over_bound": peak / bound,
                      "held_before_over_share": (held - baseline) / share,
                      "step_peak_over_bound": (share + highest - held) / bound,
                      "after_over_share": after / share})
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "share_bytes": share, "stage_bytes": stage_bytes, "largest_units": largest, "steps": steps}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the 6M-parameter model")
    parser.add_argument("--runs", type=int, default=3, help="runs of each engine, alternating (default 3)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per micro-batch of one row (default 256)")
    parser.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES)
    parser.add_argument("--name", default="", help="saved as step_memory-NAME.json (default: step_memory.json)")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    args = parser.parse_args()
    if not 2 <= args.tokens <= 256:
        raise SystemExit(f"--tokens {args.tokens}: give 2 to 256 (the model's max_position_embeddings)")
    loading = _loading()
    from forked_ranks import run_forked_ranks

    root = tempfile.mkdtemp(prefix="pipe-step-memory-", dir=args.dir)
    runs: dict[str, list[Any]] = {engine: [] for engine in args.engines}
    try:
        source = os.path.join(root, "source")
        writer = multiprocessing.get_context("fork").Process(target=loading._write_checkpoint,
                                                             args=(source, args.quick))
        writer.start()
        writer.join()
        if writer.exitcode != 0:
            raise SystemExit("writing the checkpoint failed")
        for run in range(args.runs):
            for engine in args.engines:
                ranks = run_forked_ranks(_rank, engine, source, args, ranks=4, timeout=3600)
                errors = [r["error"] for r in ranks if "error" in r]
                if errors:
                    raise SystemExit(f"{engine}: {errors}")
                runs[engine].append(ranks)
                for i, name in enumerate(["first", "second"]):
                    per_rank = [r["steps"][i] for r in ranks]
                    losses = [s["loss"] for s in per_rank if s["loss"] is not None]
                    print(f"run {run + 1} {engine:5s} {name} step {max(s['step_s'] for s in per_rank):6.2f} s, "
                          f"loss {losses}, peak/share {[round(s['peak_over_share'], 2) for s in per_rank]}, "
                          f"bound/share {[round(s['bound_over_share'], 2) for s in per_rank]} (activations "
                          f"{[round(s['activations_over_share'], 2) for s in per_rank]}), held before "
                          f"{[round(s['held_before_over_share'], 2) for s in per_rank]}, step's own peak/bound "
                          f"{[round(s['step_peak_over_bound'], 3) for s in per_rank]}, after "
                          f"{[round(s['after_over_share'], 2) for s in per_rank]}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary: dict[str, Any] = {}
    per_stage = ("peak_over_share", "peak_over_bound", "step_peak_over_bound", "held_before_over_share")
    keys = ("step_s", *per_stage, "activations_over_share", "bound_over_share", "after_over_share")
    half = len(runs[args.engines[0]][0]) // 2  # ranks 0, 1 hold the first stage; 2, 3 the last
    for engine, results in runs.items():  # each run: the largest over ranks, then the spread over runs
        second = [[r["steps"][1] for r in ranks] for ranks in results]
        summary[engine] = {key: _spread([max(s[key] for s in steps) for steps in second]) for key in keys}
        for stage, part in (("first_stage", slice(0, half)), ("last_stage", slice(half, None))):
            summary[engine][stage] = {key: _spread([max(s[key] for s in steps[part]) for steps in second])
                                      for key in per_stage}
    for engine in ("pipe", "pipe-keep", "pipe-lean"):  # each run against torch's in the same round
        if engine in summary and "torch" in summary:
            pairs = list(zip(runs[engine], runs["torch"]))
            summary[f"{engine}_over_torch"] = {
                key: _spread([max(r["steps"][1][key] for r in ours) / max(r["steps"][1][key] for r in theirs)
                              for ours, theirs in pairs]) for key in ("peak_over_share", "step_s")}
    for key, value in summary.items():
        print(key, json.dumps(value))
    result = {"config": {"model": "6M" if args.quick else "0.5B", "layout": SIZES, "micro_batches": CHUNKS,
                         "tokens_per_micro_batch": args.tokens, "schedule": "1F1B", "zero": 3, "backend": "gloo",
                         "runs": args.runs, "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE")},
              "summary": summary, "runs": runs,
              "targets": {"peak_over_bound": 1.1, "over_torch": {"peak_over_share": 1.0, "step_s": 1.0}},
              "load_average": os.getloadavg(), "cpus": os.cpu_count(), "torch": torch.__version__,
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=HERE).stdout.strip()}
    RESULTS.mkdir(exist_ok=True)
    name = "step_memory" + ("-quick" if args.quick else "") + (f"-{args.name}" if args.name else "") + ".json"
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {RESULTS / name}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
