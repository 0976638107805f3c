"""Loading a HuggingFace checkpoint into a pipeline (``pipe.distributed.hf``) against ``from_pretrained``.

A LLaMA-style model (default 0.5B parameters, untied head, fp32) is written
by ``save_pretrained`` as sharded safetensors into a temporary directory, then
loaded on 4 gloo ranks at (pp 4), (pp 2, dp_shard 2), (pp 1, dp_shard 4) and (pp 2, tp 2), and on 8 at
(pp 2, tp 2, dp_shard 2), the 3-D layout (``--layouts "pp 2 x tp 2 x dp_shard 2"``, not in the default run):
each rank builds the model on ``meta``, cuts it with ``pipe.split``, gives it
to ``DistributedPipe(..., init_weights=False)`` (which shards the stages on
``meta`` and allocates only that rank's shards; ``--init-weights``: whole
stages allocated and initialised, then sharded, as before, for comparison) and
calls ``hf.load``; then ``hf.save`` exports it. For reference
``from_pretrained`` loads the whole model in one process. Per rank:

* ``load_peak_over_share``: the peak resident memory the rank gained from
  before the model was built to the end of the load (VmHWM, reset at the
  start), over the bytes of the tensors it holds (target <= 1.25); with
  ``--device cuda`` the peak of ``torch.cuda.max_memory_allocated`` instead (and for ``--step``);
* ``load_only_peak_over_share``: the same, from just before ``hf.load`` (what the load itself adds);
* ``bytes_read_over_share``: bytes read from the files over the bytes held (1.0: only its own);
* the load's time, and the slowest rank's over ``from_pretrained``'s
  (``load_time_vs_from_pretrained``, target <= 1.0). ``from_pretrained``'s is
  until its weights are in memory: transformers 5 returns tensors that may
  still be pages of the mmapped files (``returned_s``), read when first used,
  so one element of every page of every tensor is read after it returns
  (``load_s``). It includes building the model on ``meta``; ours excludes the
  build (``DistributedPipe`` allocating and initialising the stages), reported
  apart as ``build_s``;
* ``ready_vs_from_pretrained``: (build + load) of the slowest rank over
  ``from_pretrained``'s time (target <= 1.0); the build includes ``pipe.split``
  (``split_s``: ``torch.export`` of the whole model on ``meta``);
* ``first_touch_s``: the time each rank takes to write its share once into
  memory it allocates, every rank at once (slowest rank; CPU only): the least
  any build and load that gives each rank memory of its own costs, since the
  kernel hands out and zeroes each page at its first write, where
  ``from_pretrained``'s tensors are pages of the mapped files;
* ``torch_reference``: the same model built and loaded at (pp 2, dp_shard 2)
  the way torchtitan does with torch's own pieces, no tracing (each rank's HF
  modules on ``meta``, ``fully_shard`` per decoder layer, ``to_empty``,
  ``dcp.load`` through DCP's ``HuggingFaceStorageReader``): its ready time over
  ``from_pretrained``'s, and its peak over the share, beside ours;
* the export's time, and ``export_roundtrip_exact``: every rank's tensors read
  back from the export equal its own bit for bit, and ``from_pretrained`` of the
  export equals ``from_pretrained`` of the source, bit for bit.

Run:
    python benchmarks/loading.py                 # 0.5B parameters: several minutes, ~10 GB of RAM at peak
    python benchmarks/loading.py --quick         # 6M parameters: about a minute
    python benchmarks/loading.py --device cuda   # each rank's stages on the (shared) GPU, over gloo
    python benchmarks/loading.py --static        # pipe.split(..., dynamic=False): the step's one shape
    python benchmarks/loading.py --step          # and one training step's peak per rank after the load
    python benchmarks/loading.py --step --unit block   # the step with each decoder layer gathered on its own
    python benchmarks/loading.py --step --unit block --reduce micro-batch   # and reduced after each backward
    python benchmarks/loading.py --step --return-freed   # peaks with freed tensors returned to the system
Results: benchmarks/results/loading.json (loading-quick.json, loading-cuda.json; some layouts only:
loading-pp2xtp2.json).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
LAYOUTS = {"pp 4": {"pp": 4}, "pp 2 x dp_shard 2": {"pp": 2, "dp_shard": 2}, "pp 1 x dp_shard 4": {"pp": 1, "dp_shard": 4},
           "pp 2 x tp 2": {"pp": 2, "tp": 2}, "pp 2 x tp 2 x dp_shard 2": {"pp": 2, "tp": 2, "dp_shard": 2}}
DEFAULT_LAYOUTS = ["pp 4", "pp 2 x dp_shard 2", "pp 1 x dp_shard 4", "pp 2 x tp 2"]
TORCH_LAYOUT = "pp 2 x dp_shard 2"  # where torchtitan's own build is measured for reference


def _world(layout: str) -> int:
    return math.prod(LAYOUTS[layout].values())


def _config(quick: bool) -> Any:
    from transformers import LlamaConfig

    if quick:
        sizes = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=4000)
    else:  # 501M parameters
        sizes = dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=12,
                     num_key_value_heads=4, vocab_size=32000)
    return LlamaConfig(**sizes, max_position_embeddings=256, tie_word_embeddings=False, use_cache=False)


def _status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def _write_checkpoint(directory: str, quick: bool) -> None:
    """Random weights (normal 0.02, norms at 1) saved in 200 MB files; run in a child, so its memory goes."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(_config(quick))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.fill_(1.0) if name.endswith("norm.weight") else parameter.normal_(0, 0.02)
    model.save_pretrained(directory, max_shard_size="20MB" if quick else "200MB")


def _rank(rank: int, port: int, layout: str, directory: str, export: str, args: argparse.Namespace,
          results: "multiprocessing.Queue[Any]") -> None:
    try:
        results.put(_measure(rank, port, layout, directory, export, args))
    except BaseException as error:  # report instead of leaving the parent waiting
        results.put({"rank": rank, "error": f"{type(error).__name__}: {error}"})
        raise


def _measure(rank: int, port: int, layout: str, directory: str, export: str,
             args: argparse.Namespace) -> dict[str, Any]:
    if args.return_freed:  # blocks of 1 MiB and more mmapped, so a freed tensor leaves VmRSS (glibc's mallopt)
        import ctypes
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD; also stops glibc raising it itself
    _join(rank, port, _world(layout))
    import pipe
    from pipe.distributed import DistributedPipe, Shard, hf
    from pipe.distributed import safetensors_files
    from pipe.distributed import local_pieces
    from transformers import LlamaForCausalLM

    cuda = args.device == "cuda"
    baseline = _start(cuda)
    started = time.perf_counter()
    config = _config(args.quick)
    if args.init_weights:
        torch.manual_seed(0)  # shard partners must start alike (DistributedPipe checks), though the load replaces it
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    pp = LAYOUTS[layout]["pp"]
    # --static: captured at the one shape the step's micro-batches have (1 x 64 tokens)
    ids = torch.zeros(*((1, 64) if args.static else (2, 8)), dtype=torch.long, device="meta")
    pieces = max(pp, 2)  # (pp 1): two pieces, one stage of both
    at = [f"model.layers.{config.num_hidden_layers * (i + 1) // pieces}" for i in range(pieces - 1)]
    stages = pipe.split(model, (ids,), {"use_cache": False}, at=at, dynamic=not args.static)
    split_s = time.perf_counter() - started
    shard = Shard(unit=args.unit, reduce=args.reduce) if "dp_shard" in LAYOUTS[layout] else None
    plan = hf.tensor_parallel_plan(model) if "tp" in LAYOUTS[layout] else None
    piped = DistributedPipe(stages, mesh=_mesh(LAYOUTS[layout], args.device), device=torch.device(args.device),
                            init_weights=args.init_weights, chunks=4, loss_reduction="count", shard=shard,
                            tensor_parallel=plan)
    del model, stages
    build_s = time.perf_counter() - started
    before_load = _status("VmRSS")
    dist.barrier()
    hf.load(directory, piped)
    stats = hf.last_load()
    assert stats is not None
    peak = (torch.cuda.max_memory_allocated() if cuda else _status("VmHWM") - baseline)
    load_only = _status("VmHWM") - before_load
    first_touch_s = _first_touch(stats.bytes_held) if not cuda else None
    dist.barrier()
    started = time.perf_counter()
    hf.save(export, piped, config=config, max_shard_size="20MB" if args.quick else "200MB")
    export_s = time.perf_counter() - started
    exported = safetensors_files.directory(export)
    exact = True
    with torch.no_grad():
        for name, tensor in piped.state_dict().items():
            for local, offset in local_pieces.pieces(tensor):  # each block of the whole this rank holds
                again = torch.empty(local.shape, dtype=local.dtype)
                safetensors_files.read_into(exported[name], offset, again)
                exact = exact and torch.equal(again, local.cpu())
    step = _training_step(piped, config, stats.bytes_held, baseline, args) if args.step else {}
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "share_bytes": stats.bytes_held, "bytes_read": stats.bytes_read, "keys": stats.keys,
            "load_s": stats.seconds, "build_s": build_s, "split_s": split_s, "export_s": export_s,
            "first_touch_s": first_touch_s,
            "load_peak_over_share": peak / stats.bytes_held, "load_only_peak_over_share": load_only / stats.bytes_held,
            "bytes_read_over_share": stats.bytes_read / stats.bytes_held, "exact": exact, **step}


def _torch_rank(rank: int, port: int, directory: str, args: argparse.Namespace,
                results: "multiprocessing.Queue[Any]") -> None:
    try:
        results.put(_measure_torch(rank, port, directory, args))
    except BaseException as error:  # report instead of leaving the parent waiting
        results.put({"rank": rank, "error": f"{type(error).__name__}: {error}"})
        raise


def _measure_torch(rank: int, port: int, directory: str, args: argparse.Namespace) -> dict[str, Any]:
    """torchtitan's build and load (``step_memory.torch_stage``) at (pp 2, dp_shard 2), measured as ours."""
    from step_memory import torch_stage
    from torch.distributed.tensor import DTensor

    _join(rank, port, _world(TORCH_LAYOUT))
    mesh = _mesh(LAYOUTS[TORCH_LAYOUT], args.device)
    from transformers import LlamaForCausalLM  # noqa: F401 (imported before the clock, as ours)

    cuda = args.device == "cuda"
    baseline = _start(cuda)
    started = time.perf_counter()
    module, load_s = torch_stage(_config(args.quick), directory, mesh, args.device)
    ready_s = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if cuda else _status("VmHWM") - baseline
    share = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                for p in module.parameters())
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "share_bytes": share, "build_s": ready_s - load_s, "load_s": load_s, "ready_s": ready_s,
            "load_peak_over_share": peak / share}


def _join(rank: int, port: int, world: int) -> None:
    """This rank joins the gloo group of ``world`` ranks on 127.0.0.1 with one intra-op thread."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=1800))


def _start(cuda: bool) -> int:
    """Every rank at once: the peaks reset; returns the resident memory the build's gain counts from."""
    dist.barrier()
    _reset_peak()
    baseline = _status("VmRSS")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    return baseline


def _first_touch(share: int) -> float:
    """Seconds to write ``share`` bytes once into memory the rank allocates, every rank at once: the least any
    build and load that gives each rank memory of its own can take (the kernel hands out and zeroes each page
    at its first write), which ``from_pretrained`` does not pay because its tensors are pages of the mapped
    files."""
    dist.barrier()
    started = time.perf_counter()
    fresh = torch.empty(share, dtype=torch.uint8)  # one block this large is a fresh mapping (glibc's mmap)
    fresh.fill_(1)
    seconds = time.perf_counter() - started
    del fresh
    return seconds


def _training_step(piped: Any, config: Any, share: int, baseline: int, args: argparse.Namespace) -> dict[str, Any]:
    """One training step after the load (1F1B, 4 micro-batches of 1 x 64 tokens per pipeline; ZeRO-3 where the
    mesh shards): the peak the rank gains over its share, and what it holds after; beside them the parts of the
    bound a per-layer ZeRO-3 step would reach, without the activations: the share, the stage's gradients
    unsharded until the step's one reduce-scatter, and the two largest units gathered (decoder layers, or the
    embedding or head where larger)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> Any:
        flat = labels[:, 1:].reshape(-1)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), flat, reduction="sum"), flat.numel()

    cuda = args.device == "cuda"
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (4, 64), generator=generator).to(args.device)
    stage_bytes = sum(p.numel() * p.element_size() for p in piped.parameters())  # full sizes, DTensors too
    largest = unit_bytes(piped.named_parameters())[:2]
    gc_collect()
    dist.barrier()
    _reset_peak()
    before = torch.cuda.memory_allocated() if cuda else _status("VmRSS")
    if cuda:  # the GPU's allocations count from nothing: no baseline to take off
        torch.cuda.reset_peak_memory_stats()
        baseline = 0
    started = time.perf_counter()
    piped.step(ids, ids, loss_fn)
    if cuda:
        torch.cuda.synchronize()
    step_s = time.perf_counter() - started
    peak = _peak(cuda) - baseline
    after = (torch.cuda.memory_allocated() if cuda else _status("VmRSS")) - baseline
    sharded = any(isinstance(p, DTensor) for p in piped.parameters())
    bound = share + stage_bytes + (sum(largest) if sharded else 0)
    return {"step_s": step_s, "step_peak_over_share": peak / share, "after_step_over_share": after / share,
            "step_added_over_share": (_peak(cuda) - before) / share,
            "step_bound_without_activations_over_share": bound / share}


def _peak(cuda: bool) -> int:
    """The GPU's allocated peak with ``--device cuda``, else the process's resident peak (VmHWM)."""
    return torch.cuda.max_memory_allocated() if cuda else _status("VmHWM")


def unit_bytes(named: Any) -> list[int]:
    """The bytes of each unit FSDP gathers at a time by layer (a decoder layer, the embedding, the norm, the
    head), largest first, from ``named_parameters()`` (full sizes, DTensors too)."""
    units: dict[str, int] = {}
    for name, p in named:
        head, _, rest = name.partition(".layers.")
        unit = f"{head}.layers.{rest.split('.')[0]}" if rest else name.rpartition(".")[0]
        units[unit] = units.get(unit, 0) + p.numel() * p.element_size()
    return sorted(units.values(), reverse=True)


def gc_collect() -> None:
    import gc

    gc.collect()


def _mesh(sizes: dict[str, int], device: str) -> Any:
    """The layout's mesh on the ranks' device type: make_mesh follows the backend (gloo: "cpu"), and the
    ranks' stages on a GPU over gloo need a "cuda" mesh."""
    from pipe.distributed import make_mesh

    if device != "cuda":
        return make_mesh(**sizes)
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(name for name in ("pp", "dp_replicate", "dp_shard", "tp") if sizes.get(name, 1) > 1 or name == "pp")
    return init_device_mesh("cuda", tuple(sizes.get(name, 1) for name in names), mesh_dim_names=names)


def _from_pretrained(directory: str, export: str, device: str, results: "multiprocessing.Queue[Any]") -> None:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401 (imported before the clock)

    torch.set_num_threads(1)  # as each rank
    _reset_peak()
    baseline = _status("VmRSS")
    started = time.perf_counter()
    kwargs = {"device_map": "cuda"} if device == "cuda" else {}
    model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    returned = time.perf_counter() - started
    with torch.no_grad():  # its tensors may still be pages of the files, read when first used: use each once
        for tensor in model.state_dict().values():
            flat = tensor.reshape(-1)
            float(flat[::max(1, 4096 // tensor.element_size())].sum())
    seconds = time.perf_counter() - started
    peak = (torch.cuda.max_memory_allocated() if device == "cuda" else _status("VmHWM") - baseline)
    share = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    exact = None
    if export:
        again = AutoModelForCausalLM.from_pretrained(export, **kwargs)
        theirs = again.state_dict()
        exact = all(torch.equal(t, theirs[k]) for k, t in model.state_dict().items()) and len(theirs) == len(
            model.state_dict())
    results.put({"load_s": seconds, "returned_s": returned, "peak_over_model": peak / share, "model_bytes": share,
                 "parameters": sum(p.numel() for p in model.parameters()), "export_exact": exact})


def _child(target: Any, *args: Any) -> Any:
    context = multiprocessing.get_context("fork")
    results: "multiprocessing.Queue[Any]" = context.Queue()
    process = context.Process(target=target, args=(*args, results))
    process.start()
    result = results.get(timeout=3600)
    process.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory)")
    parser.add_argument("--init-weights", action="store_true",
                        help="build with init_weights=True (allocate and initialise whole stages, then shard) as "
                             "before the shard-first build, for comparison; default: init_weights=False")
    parser.add_argument("--step", action="store_true",
                        help="then one training step (1F1B, 4 micro-batches of 1 x 64 tokens): each rank's peak "
                             "over its share (step_peak_over_share) beside the bound without activations")
    parser.add_argument("--static", action="store_true",
                        help="pipe.split(..., dynamic=False): capture the one shape the step uses (micro-batches of "
                             "1 x 64 tokens), without symbolic sizes; default: every dimension dynamic")
    parser.add_argument("--unit", default="stage", choices=["stage", "block"],
                        help="with dp_shard: Shard(unit=...), what ZeRO-3 gathers at a time: a stage whole "
                             "(default) or each decoder layer around its own forward and backward")
    parser.add_argument("--reduce", default="step", choices=["step", "micro-batch"],
                        help="with --unit block: Shard(reduce=...), reduce-scatter each layer's gradients once a step "
                             "(default) or after each of its backwards")
    parser.add_argument("--return-freed", action="store_true",
                        help="each rank has glibc mmap every block of 1 MiB or more (mallopt M_MMAP_THRESHOLD), so "
                             "freed tensors go back to the system and the resident peaks (VmHWM) are closer to what "
                             "was live; by default glibc may keep freed memory for reuse, which VmHWM counts")
    parser.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS, choices=list(LAYOUTS), metavar="LAYOUT",
                        help=f"the layouts to load into (default: {DEFAULT_LAYOUTS}; of {list(LAYOUTS)})")
    args = parser.parse_args()
    from forked_ranks import run_forked_ranks

    root = tempfile.mkdtemp(prefix="pipe-loading-", dir=args.dir)
    try:
        source = os.path.join(root, "source")
        started = time.perf_counter()
        context = multiprocessing.get_context("fork")
        writer = context.Process(target=_write_checkpoint, args=(source, args.quick))
        writer.start()
        writer.join()
        if writer.exitcode != 0:
            raise SystemExit("writing the checkpoint failed")
        print(f"checkpoint written in {time.perf_counter() - started:.1f} s: {source}")
        reference = _child(_from_pretrained, source, "", args.device)
        print(f"from_pretrained: {reference['load_s']:.2f} s with its weights read ({reference['returned_s']:.2f} s "
              f"to return), {reference['parameters'] / 1e6:.0f}M parameters")
        layouts: dict[str, Any] = {}
        export = ""
        failed: dict[str, list[str]] = {}
        for layout in args.layouts:
            ranks = run_forked_ranks(_rank, layout, source, os.path.join(root, "export-" + layout.replace(" ", "")),
                                     args, ranks=_world(layout), timeout=3600)
            errors = [r["error"] for r in ranks if "error" in r]
            if errors:  # recorded, and the other layouts still measured
                failed[layout] = errors
                print(f"{layout}: failed: {errors}")
                continue
            export = os.path.join(root, "export-" + layout.replace(" ", ""))
            load_s = max(r["load_s"] for r in ranks)
            ready_s = max(r["build_s"] + r["load_s"] for r in ranks)
            layouts[layout] = {
                "ranks": ranks, "load_s": load_s, "export_s": max(r["export_s"] for r in ranks),
                "build_s": max(r["build_s"] for r in ranks), "split_s": max(r["split_s"] for r in ranks),
                "ready_s": ready_s, "ready_vs_from_pretrained": ready_s / reference["load_s"],
                "first_touch_s": None if args.device == "cuda" else max(r["first_touch_s"] for r in ranks),
                "load_time_vs_from_pretrained": load_s / reference["load_s"],
                "load_peak_over_share": max(r["load_peak_over_share"] for r in ranks),
                "export_exact_per_rank": all(r["exact"] for r in ranks)}
            if args.step:
                layouts[layout]["step_peak_over_share"] = max(r["step_peak_over_share"] for r in ranks)
                print(f"{layout:18s} step {max(r['step_s'] for r in ranks):.2f} s: peak over share per rank "
                      f"{[round(r['step_peak_over_share'], 2) for r in ranks]}, after the step "
                      f"{[round(r['after_step_over_share'], 2) for r in ranks]}, bound without activations "
                      f"{[round(r['step_bound_without_activations_over_share'], 2) for r in ranks]}")
            touch = "" if args.device == "cuda" else (
                f"writing the share once {layouts[layout]['first_touch_s']:.2f} s "
                f"({layouts[layout]['first_touch_s'] / reference['load_s']:.1f}x from_pretrained), ")
            print(f"{layout:18s} build {layouts[layout]['build_s']:6.2f} s (split {layouts[layout]['split_s']:.2f} s), "
                  f"load {load_s:6.2f} s ({layouts[layout]['load_time_vs_from_pretrained']:.2f}x "
                  f"from_pretrained), ready {ready_s:.2f} s ({layouts[layout]['ready_vs_from_pretrained']:.1f}x), "
                  f"peak over share {layouts[layout]['load_peak_over_share']:.2f}, {touch}"
                  f"export {layouts[layout]['export_s']:.2f} s, exact {layouts[layout]['export_exact_per_rank']}")
        if not layouts:
            raise SystemExit(f"every layout failed: {failed}")
        ranks = run_forked_ranks(_torch_rank, source, args, ranks=_world(TORCH_LAYOUT), timeout=3600)
        errors = [r["error"] for r in ranks if "error" in r]
        if errors:
            raise SystemExit(f"torch's own build at ({TORCH_LAYOUT}) failed: {errors}")
        ready_s = max(r["ready_s"] for r in ranks)
        reference_torch = {"layout": TORCH_LAYOUT, "ranks": ranks, "ready_s": ready_s,
                           "build_s": max(r["build_s"] for r in ranks), "load_s": max(r["load_s"] for r in ranks),
                           "ready_vs_from_pretrained": ready_s / reference["load_s"],
                           "load_peak_over_share": max(r["load_peak_over_share"] for r in ranks)}
        print(f"torch's own ({TORCH_LAYOUT}: fully_shard per layer on meta, to_empty, dcp.load): build "
              f"{reference_torch['build_s']:.2f} s, load {reference_torch['load_s']:.2f} s, ready {ready_s:.2f} s "
              f"({reference_torch['ready_vs_from_pretrained']:.1f}x from_pretrained), peak over share "
              f"{reference_torch['load_peak_over_share']:.2f}")
        roundtrip = _child(_from_pretrained, source, export, args.device)
        exact = bool(roundtrip["export_exact"]) and all(v["export_exact_per_rank"] for v in layouts.values())
        result = {
            "config": {"parameters": reference["parameters"], "model_bytes": reference["model_bytes"],
                       "dtype": "float32", "device": args.device, "quick": args.quick,
                       "ranks": sorted({_world(layout) for layout in args.layouts}), "return_freed": args.return_freed,
                       "backend": "gloo", "files": "200 MB" if not args.quick else "20 MB",
                       "unit": args.unit, "reduce": args.reduce, "static": args.static,
                       "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE")},
            "from_pretrained": {"load_s": reference["load_s"], "returned_s": reference["returned_s"],
                                "peak_over_model": reference["peak_over_model"]},
            "layouts": layouts,
            "torch_reference": reference_torch,
            "load_peak_over_share": max(v["load_peak_over_share"] for v in layouts.values()),
            "load_time_vs_from_pretrained": max(v["load_time_vs_from_pretrained"] for v in layouts.values()),
            "ready_vs_from_pretrained": max(v["ready_vs_from_pretrained"] for v in layouts.values()),
            "init_weights": args.init_weights,
            "export_s": {k: v["export_s"] for k, v in layouts.items()},
            "export_roundtrip_exact": exact,
            "failed_layouts": failed,
            "targets": {"load_peak_over_share": 1.25, "load_time_vs_from_pretrained": 1.0,
                        "ready_vs_from_pretrained": 1.0},
            "load_average": os.getloadavg(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=HERE).stdout.strip(),
        }
        print(f"export round trip exact: {exact}; load average {result['load_average'][0]:.1f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    name = ("loading" + ("-quick" if args.quick else "") + ("-cuda" if args.device == "cuda" else "")
            + ("-init" if args.init_weights else "") + ("-static" if args.static else "")
            + ("-step" if args.step else "")
            + ("-by-block" if args.unit == "block" else "") + ("-reduce-each" if args.reduce != "step" else "")
            + ("-return-freed" if args.return_freed else "")
            + ("-thp" if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" else "")
            + ("" if args.layouts == DEFAULT_LAYOUTS else "-" + "-".join(l.replace(" ", "") for l in args.layouts))
            + ".json")
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {RESULTS / name}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
