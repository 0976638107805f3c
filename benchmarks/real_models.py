"""R1: step time of a real model through pipe.split + Pipe vs the plain model (GPT-2-style, HuggingFace).

A random-init ``GPT2LMHeadModel`` (tied embeddings, padded batches with an
attention mask) is cut in the middle with ``pipe.split`` and run by ``Pipe`` on
2 CPU partitions, with

* the default settings: ``Pipe(stages, balance=[1, 1], devices=["cpu", "cpu"])``
  (chunks=1, checkpoint="except_last", cpu_threads = threads / 2), and
* the fastest settings found among chunks 2/4/8 with checkpoint "never",
  one intra-op thread per worker,

against the plain model on one and on two intra-op threads. A step is forward,
next-token loss and backward. Configurations alternate step by step, so the
drift of a shared machine hits them alike; each figure is a median, and every
ratio is taken from this one run. Printed, and saved to
benchmarks/results/real_models.json.

R1 also runs ``Pipe`` with ``compile=True`` at the fastest settings.

R2: the same split GPT-2 over 2 gloo ranks (forked from this process), one
intra-op thread each, ``DistributedPipe`` for 1F1B, ZB-H1 (2 stages) and
ZB-V (4 stages, 2 per rank), eager and ``compile=True``, chunks 4, no
checkpointing, configurations alternating step by step on the ranks; against
the plain model on one thread, eager and compiled (``model.compile()``),
measured in this process after the ranks run (two alternating rounds). Keys
``r2_best_vs_plain`` (the fastest pipeline / plain eager on 1 thread) and
``r2_compiled_vs_eager`` (compiled / eager pipeline on the schedule that is
fastest compiled; per schedule in ``r2_compiled_vs_eager_per_schedule``).
R2 also measures the two bounds of those ratios: the ranks, in the same
alternation, each run the plain model on half the batch (no bubble, no
message: ``r2_bound_halves_vs_plain``, and ``r2_best_of_bound``, the best
pipeline's share of it), and this process runs the split stages in turn,
micro-batch by micro-batch on one thread, eager and compiled
(``compiled_vs_eager_stages_alone``: what compiling gains a pipeline's own
compute). R2's ``auto`` runs GPT-2 split at every block, cut into stages and
ordered by ``pipe.plan.calibrated_schedule``: from the pieces' F, I and W
timed on rank 0, then from a step of that order recorded on both ranks
(``r2_auto_vs_plain``; ``auto_prediction_error``, its simulated step against
the measured one).
Compiled configurations use inductor (a C++ compiler is needed); ``--quick``
uses ``aot_eager`` (graphs without code generation) so that it runs in seconds,
which makes its compiled figures a smoke test only.

Run:
    python benchmarks/real_models.py            # ~5 minutes on 2 quiet cores (inductor compiles on every rank)
    python benchmarks/real_models.py --quick    # tiny sizes, a smoke run
    python benchmarks/real_models.py --only r2  # R2 alone
    python benchmarks/real_models.py --only r1 --profile  # R1's thread profile (benchmarks/thread_profile.py)

``--profile`` (with ``--only r1``) profiles the thread runner instead of timing
R1: cores busy, the overlap of the two partitions' compute, each partition's
stretch against running alone and, with py-spy, each thread's share of the
interpreter lock, for the plain model, ``Pipe`` eager, compiled and with
``cpu_threads=2``, and for contrast P2's Linear(1024)+Tanh stack through
``Pipe``, and routes (chunks 2 and 8, eager and compiled; the plain model compiled;
the plain model on two threads with half the batch each, which needs no pipeline). Saved under
``r1_profile``; about 3 minutes on 2 cores
(``--quick``: under a minute, without py-spy).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import pipe
from pipe import Pipe
from pipe.compile import compile_stages, verify_compile
from forked_ranks import run_forked_ranks
from thread_profile import profile, table

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
VOCAB = 512


def build(size: dict[str, int]) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=size["seq"], n_embd=size["width"], n_layer=size["layers"],
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def batch(size: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (size["batch"], size["seq"]), generator=generator)
    lengths = torch.randint(size["seq"] // 2, size["seq"] + 1, (size["batch"],), generator=generator)
    mask = (torch.arange(size["seq"]).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return ids * mask, mask, (ids * mask).masked_fill(mask == 0, -100)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100)


def stepper(model: nn.Module, plain: bool, data: tuple[torch.Tensor, ...], threads: int) -> Callable[[], float]:
    ids, mask, labels = data

    def step() -> float:
        torch.set_num_threads(threads)
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        logits = model(ids, attention_mask=mask).logits if plain else model(ids, mask)
        lm_loss(logits, labels).backward()
        return time.perf_counter() - start

    return step


def measure(steps: dict[str, Callable[[], float]], warmup: int, repeat: int) -> dict[str, float]:
    """Median seconds per step of each configuration, steps alternating between them."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeat):
        for name, step in steps.items():
            times[name].append(step())
    return {name: statistics.median(values) for name, values in times.items()}


R2_SCHEDULES = ("1f1b", "zb-h1", "zbv")
R2_CHUNKS = 4


def _r2_rank(rank: int, port: int, size: dict[str, int], compile_option: Any, warmup: int, repeat: int,
             results: Any) -> None:
    """One rank of R2: every schedule eager and compiled, steps alternating; medians to rank 0's result."""
    import torch.distributed as dist

    from pipe.distributed import DistributedPipe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    from torch._inductor import config as inductor_config

    inductor_config.compile_threads = 1  # compile in this process: no worker pool in a forked rank
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=1800))
    ids, mask, labels = batch(size)
    layers = size["layers"]
    steps: dict[str, Callable[[], float]] = {}
    for schedule in R2_SCHEDULES:
        cuts = [f"transformer.h.{layers // 2}"] if schedule != "zbv" else \
            [f"transformer.h.{k * layers // 4}" for k in (1, 2, 3)]
        for compiled in (False, True):
            model = build(size)
            stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=cuts)
            piped = DistributedPipe(stages, chunks=R2_CHUNKS, checkpoint="never", schedule=schedule, loss_fn=lm_loss,
                                    compile=compile_option if compiled else False)
            steps[f"{schedule}_{'compiled' if compiled else 'eager'}"] = _timed_step(piped, ids, mask, labels)
    steps["auto_eager"], chosen = _r2_auto(size, ids, mask, labels)
    # The bound of any 2-rank schedule: each rank runs the plain model on its half of the batch, with no
    # message and no bubble (data parallelism without its gradient all-reduce), in the same alternation.
    half = slice(rank * size["batch"] // 2, (rank + 1) * size["batch"] // 2)
    alone = build(size)

    def halves() -> float:
        alone.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        lm_loss(alone(ids[half], attention_mask=mask[half]).logits, labels[half]).backward()
        dist.barrier()
        return time.perf_counter() - start

    steps["halves_no_pipeline"] = halves
    seconds = measure(steps, warmup, repeat)
    results.put({"rank": rank, "seconds": seconds, "auto": chosen})
    dist.destroy_process_group()


def _r2_auto(size: dict[str, int], ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor
             ) -> tuple[Callable[[], float], dict[str, Any]]:
    """R2's auto configuration: GPT-2 split at every block, the cut into stages and each rank's order chosen by
    ``pipe.plan.calibrated_schedule``: from the pieces' F, I and W timed on rank 0, then from a step of that
    order recorded on both ranks."""
    from pipe.distributed import DistributedPipe
    from pipe.plan import calibrated_schedule

    pieces = pipe.split(build(size), (ids,), {"attention_mask": mask, "use_cache": False},
                        at=[f"transformer.h.{k}" for k in range(1, size["layers"])])
    auto = calibrated_schedule(pieces, (ids, mask), labels, chunks=R2_CHUNKS, loss_fn=lm_loss, checkpoint="never",
                               timeout=2.0)
    chosen = {"name": auto.schedule.name, "balance": auto.balance, "placement": list(auto.schedule.placement),
              "simulated_step_s": auto.step, "bound_step_s": auto.bound,
              "recorded_step_s": auto.measured[-1].wall if auto.measured else None,
              "overhead_per_action_us": auto.costs.overhead * 1e6, "costs": dataclasses.asdict(auto.costs),
              "table_csv": auto.schedule.to_csv()}
    piped = DistributedPipe(pieces, chunks=R2_CHUNKS, checkpoint="never", schedule=auto.schedule,
                            balance=auto.balance, loss_fn=lm_loss)
    return _timed_step(piped, ids, mask, labels), chosen


def microbatched_stepper(model: nn.Module, data: tuple[torch.Tensor, ...], chunks: int) -> Callable[[], float]:
    """A step of split stages run in turn on one thread, micro-batch by micro-batch: a pipeline's compute alone."""
    parts = [tensor.chunk(chunks) for tensor in data]

    def step() -> float:
        torch.set_num_threads(1)
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        for ids, mask, labels in zip(*parts):
            lm_loss(model(ids, mask), labels).backward()
        return time.perf_counter() - start

    return step


def r2(size: dict[str, int], compile_option: Any, warmup: int, repeat: int) -> dict[str, Any]:
    """R2's figures: seconds per step of each pipeline and of the plain model, the ratios and their bounds."""
    # The ranks fork first: a process that compiled with inductor holds a pool of compile workers,
    # which a forked child cannot use (it waits on it forever).
    ranks = run_forked_ranks(_r2_rank, size, compile_option, warmup, repeat)
    data = batch(size)
    eager = build(size)
    compiled = build(size)
    compiled.compile(**{k: v for k, v in compile_option.items() if k in ("backend",)})
    cut = {"attention_mask": data[1], "use_cache": False}, [f"transformer.h.{size['layers'] // 2}"]
    stages_eager = pipe.split(build(size), (data[0],), cut[0], at=cut[1])
    stages_compiled = pipe.split(build(size), (data[0],), cut[0], at=cut[1])
    compile_stages([stages_compiled], verify_compile(compile_option))  # as compile= does to a pipeline's stages
    plain = {"plain_1thread_eager": stepper(eager, True, data, 1),
             "plain_1thread_compiled": stepper(compiled, True, data, 1),
             "stages_alone_eager": microbatched_stepper(stages_eager, data, R2_CHUNKS),
             "stages_alone_compiled": microbatched_stepper(stages_compiled, data, R2_CHUNKS)}
    before = measure(plain, warmup, repeat)
    after = measure(plain, 0, repeat)
    seconds = {name: statistics.median([before[name], after[name]]) for name in plain}
    seconds.update(ranks[0]["seconds"])
    bound = seconds.pop("halves_no_pipeline")
    auto = seconds.pop("auto_eager")
    chosen = ranks[0]["auto"]
    pipelines = {name: value for name, value in seconds.items() if not name.startswith(("plain", "stages"))}
    best = min(pipelines, key=pipelines.__getitem__)
    per_schedule = {s: seconds[f"{s}_eager"] / seconds[f"{s}_compiled"] for s in R2_SCHEDULES}
    fastest_compiled = min(R2_SCHEDULES, key=lambda s: seconds[f"{s}_compiled"])
    return {
        "seconds": seconds,
        "plain_before_after": {"before": before, "after": after},
        "best": best,
        "r2_best_vs_plain": seconds["plain_1thread_eager"] / pipelines[best],
        "r2_best_vs_plain_compiled": seconds["plain_1thread_compiled"] / pipelines[best],
        "r2_compiled_vs_eager": per_schedule[fastest_compiled],
        "r2_compiled_vs_eager_per_schedule": per_schedule,
        # The bounds: 2 ranks each running the plain model on half the batch (no bubble, no message), and
        # what compiling gains the split stages' own compute at the pipeline's micro-batch size, on one thread.
        "r2_bound_halves_vs_plain": seconds["plain_1thread_eager"] / bound,
        "halves_no_pipeline_s": bound,
        "r2_best_of_bound": bound / pipelines[best],
        "compiled_vs_eager_stages_alone": seconds["stages_alone_eager"] / seconds["stages_alone_compiled"],
        "speedup_vs_plain_1thread_eager": {name: seconds["plain_1thread_eager"] / value
                                           for name, value in pipelines.items()},
        # The auto order (eager): its ratio, what it chose, and its simulated step against the measured one.
        "r2_auto_vs_plain": seconds["plain_1thread_eager"] / auto,
        "auto_eager_s": auto,
        "auto_chosen": chosen,
        "auto_prediction_error": chosen["simulated_step_s"] / auto - 1,
    }


def stack_stepper(model: nn.Module, x: torch.Tensor, threads: int) -> Callable[[], float]:
    """A step of P2's Linear+Tanh stack: forward, mean-square loss, backward."""
    def step() -> float:
        torch.set_num_threads(threads)
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(x).square().mean().backward()
        return time.perf_counter() - start

    return step


def halves_stepper(model: nn.Module, data: tuple[torch.Tensor, ...]) -> Callable[[], float]:
    """The plain model on two threads of this process, half the batch each (no pipeline): what threads can overlap.

    No schedule, no hand-offs, no bubble: each thread runs forward and backward
    of its half, one intra-op thread each, and autograd accumulates both into
    the same gradients. Its speed-up over one thread is the ceiling that the
    interpreter lock and the cores leave for ``Pipe`` on this model.
    """
    halves = [tuple(t.chunk(2)[k] for t in data) for k in (0, 1)]

    def half(ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> None:
        torch.set_num_threads(1)
        (lm_loss(model(ids, attention_mask=mask).logits, labels) / 2).backward()

    def step() -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        threads = [threading.Thread(target=half, args=h, name=f"half-{k}") for k, h in enumerate(halves)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.perf_counter() - start

    return step


def r1_profile(size: dict[str, int], stack: dict[str, int], compile_option: Any, repeat: int, traced: int,
               spy_seconds: float) -> dict[str, Any]:
    """R1's thread profile (benchmarks/thread_profile.py): why Pipe's partitions do or do not overlap."""
    data = batch(size)
    cut = [f"transformer.h.{size['layers'] // 2}"]

    def split(model: nn.Module) -> nn.Sequential:
        return pipe.split(model, (data[0],), {"attention_mask": data[1], "use_cache": False}, at=cut)

    two = dict(chunks=4, checkpoint="never", balance=[1, 1], devices=["cpu", "cpu"])
    pipes = {
        "pipe_eager": Pipe(split(build(size)), **two, cpu_threads=1),
        "pipe_eager_cpu_threads2": Pipe(split(build(size)), **two, cpu_threads=2),
        "pipe_compiled": Pipe(split(build(size)), **two, cpu_threads=1, compile=compile_option),
    }
    threads = {"pipe_eager": 1, "pipe_eager_cpu_threads2": 2, "pipe_compiled": 1, "stack_pipe": 1}
    routes: dict[str, Pipe] = {}
    steps = {"plain_1thread": stepper(build(size), True, data, 1),
             "plain_2threads_half_batch_each": halves_stepper(build(size), data)}
    steps.update({name: stepper(model, False, data, 1) for name, model in pipes.items()})
    # Routes, timed (cores busy, no trace): chunks 2 and 8 eager and compiled, and the plain model compiled.
    for chunks in (2, 8):
        for compiled in (False, True):
            routed = Pipe(split(build(size)), **{**two, "chunks": chunks}, cpu_threads=1,
                          compile=compile_option if compiled else False)
            routes[f"pipe_{'compiled' if compiled else 'eager'}_chunks{chunks}"] = routed
            steps[f"pipe_{'compiled' if compiled else 'eager'}_chunks{chunks}"] = stepper(routed, False, data, 1)
    plain_compiled = build(size)
    plain_compiled.compile(**{k: v for k, v in compile_option.items() if k in ("backend",)})
    steps["plain_1thread_compiled"] = stepper(plain_compiled, True, data, 1)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(stack["layers"]):
        layers += [nn.Linear(stack["width"], stack["width"]), nn.Tanh()]
    x = torch.randn(stack["batch"], stack["width"])
    steps["stack_plain_1thread"] = stack_stepper(nn.Sequential(*copy.deepcopy(layers)), x, 1)
    pipes["stack_pipe"] = Pipe(nn.Sequential(*layers), chunks=8, checkpoint="never", balance=[stack["layers"]] * 2,
                               devices=["cpu", "cpu"], cpu_threads=1)
    steps["stack_pipe"] = stack_stepper(pipes["stack_pipe"], x, 1)
    result = profile(steps, pipes, threads, repeat, traced, spy_seconds)
    for name, entry in result.items():
        if not name.startswith("plain_1thread") and name != "stack_plain_1thread":
            plain = "stack_plain_1thread" if name.startswith("stack") else "plain_1thread"
            entry["speedup_vs_plain_1thread"] = result[plain]["step_s"] / entry["step_s"]
    for name in ("pipe_compiled", "pipe_compiled_chunks2", "pipe_compiled_chunks8"):
        result[name]["speedup_vs_plain_1thread_compiled"] = \
            result["plain_1thread_compiled"]["step_s"] / result[name]["step_s"]
    for model in [*pipes.values(), *routes.values()]:
        model.close()
    return {"configurations": result, "size": size, "stack": stack, "compile": compile_option,
            "chunks": {"gpt2": 4, "stack": 8}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    parser.add_argument("--only", choices=["r1", "r2"], help="run one figure only")
    parser.add_argument("--profile", action="store_true", help="with --only r1: profile the thread runner instead")
    args = parser.parse_args()
    if args.quick:
        size = {"layers": 4, "width": 64, "seq": 32, "batch": 8}
        warmup, repeat, grid = 1, 3, [2]
        compile_option: dict[str, Any] = {"backend": "aot_eager"}
    else:
        size = {"layers": 4, "width": 256, "seq": 64, "batch": 16}
        warmup, repeat, grid = 2, 9, [2, 4, 8]
        compile_option = {"backend": "inductor"}
    if args.profile and args.only != "r1":
        parser.error("--profile profiles R1's thread runner: pass it with --only r1")
    load_before = os.getloadavg()[0]
    out = RESULTS / ("real_models-quick.json" if args.quick else "real_models.json")
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    if args.only != "r1":
        result["r2"] = r2(size, compile_option, warmup, repeat)
        result["r2"]["load_average"] = {"before": load_before, "after": os.getloadavg()[0]}
        result["r2"]["compile"] = compile_option
        for key in ("r2_best_vs_plain", "r2_compiled_vs_eager", "r2_auto_vs_plain"):
            result[key] = result["r2"][key]
        print(json.dumps(result["r2"], indent=2))
    if args.profile:
        stack = {"width": 256, "layers": 4, "batch": 256} if args.quick else {"width": 1024, "layers": 8, "batch": 2048}
        result["r1_profile"] = r1_profile(size, stack, compile_option, repeat, 2 if args.quick else 5,
                                          0 if args.quick else 6)
        result["r1_profile"]["load_average"] = {"before": load_before, "after": os.getloadavg()[0]}
        print(json.dumps(result["r1_profile"], indent=2))
        print(table(result["r1_profile"]["configurations"]))
    if args.only == "r2" or args.profile:
        RESULTS.mkdir(exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"saved {out.relative_to(HERE.parent)}")
        return
    load_before = os.getloadavg()[0]
    data = batch(size)
    plain = build(size)
    model = build(size)
    stages = pipe.split(model, (data[0],), {"attention_mask": data[1], "use_cache": False},
                        at=[f"transformer.h.{size['layers'] // 2}"])

    torch.set_num_threads(2)
    default = Pipe(stages, balance=[1, 1], devices=["cpu", "cpu"])  # chunks=1, except_last, cpu_threads 2 // 2
    candidates = {chunks: Pipe(stages, chunks=chunks, checkpoint="never", balance=[1, 1], devices=["cpu", "cpu"],
                               cpu_threads=1) for chunks in grid}
    compiled_model = build(size)  # its own layers: compile= compiles them in place
    compiled_stages = pipe.split(compiled_model, (data[0],), {"attention_mask": data[1], "use_cache": False},
                                 at=[f"transformer.h.{size['layers'] // 2}"])
    # Pick the fastest candidate first (a short alternating run), then measure it against the rest.
    tried = measure({f"chunks={c}": stepper(p, False, data, 1) for c, p in candidates.items()}, 1, 3)
    best = min(candidates, key=lambda c: tried[f"chunks={c}"])
    steps = {
        "plain_1thread": stepper(plain, True, data, 1),
        "plain_2threads": stepper(plain, True, data, 2),
        "pipe_default": stepper(default, False, data, 2),
        "pipe_fastest": stepper(candidates[best], False, data, 1),
        "pipe_fastest_compiled": stepper(Pipe(compiled_stages, chunks=best, checkpoint="never", balance=[1, 1],
                                              devices=["cpu", "cpu"], cpu_threads=1, compile=compile_option),
                                         False, data, 1),
    }
    seconds = measure(steps, warmup, repeat)
    for piped in [default, *candidates.values()]:
        piped.close()
    result.update({
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine()},
        "quick": args.quick,
        # Runnable threads on the machine (1-minute load average) before and after: above the core count,
        # other processes took cores from the configurations that need two at once.
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "model": f"GPT2LMHeadModel(n_layer={size['layers']}, n_embd={size['width']}, n_head=4, vocab={VOCAB}), "
                 f"batch {size['batch']} x {size['seq']} tokens, padded, tied embeddings",
        "size": size,
        "fastest_settings": {"chunks": best, "checkpoint": "never", "cpu_threads": 1, "grid": grid, "tried_s": tried},
        "default_settings": {"chunks": 1, "checkpoint": "except_last", "cpu_threads": 1},
        "seconds": seconds,
        "speedup": {
            f"{p}_vs_{q}": seconds[q] / seconds[p]
            for p in ("pipe_default", "pipe_fastest", "pipe_fastest_compiled") for q in ("plain_1thread", "plain_2threads")
        },
        "r1_compiled_vs_eager": seconds["pipe_fastest"] / seconds["pipe_fastest_compiled"],
    })
    print(json.dumps({k: v for k, v in result.items() if k != "r2"}, indent=2))
    RESULTS.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out.relative_to(HERE.parent)}")



def _timed_step(piped: Any, ids: Any, mask: Any, labels: Any) -> Callable[[], float]:
    """One timed step of R2's split GPT-2 (a ``DistributedPipe``) on these ranks, between barriers (seconds)."""
    import torch.distributed as dist

    def step() -> float:
        piped.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        piped.step((ids, mask) if piped.is_first else None, labels if piped.is_last else None)
        dist.barrier()
        return time.perf_counter() - start

    return step

if __name__ == "__main__":
    main()
