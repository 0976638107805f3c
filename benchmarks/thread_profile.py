"""Why `Pipe`'s worker threads do or do not overlap on the CPU: a profile of the thread runner.

Used by ``python benchmarks/real_models.py --only r1 --profile`` (saved in
``real_models.json`` under ``r1_profile``). For each configuration (a step
function and, for a ``Pipe``, the pipeline) it measures:

* **cores busy**: CPU time of the whole process / wall time over untraced
  steps (1.0: one core's worth of work at a time; 2.0: both cores compute),
  with the CPU time of each thread (main, each ``pipe-worker``, the rest:
  OpenMP pools, autograd) and the time each waited for a core in the kernel's
  run queue, both from ``/proc/self/task/<tid>/schedstat``;
* **overlap**: from ``pipe.trace.record``, the fraction of a step in which
  both partitions compute at once (forward spans, and one backward span per
  cell's ``torch.autograd.backward`` on its worker: :func:`backward_spans`,
  lighter than the trace's per-node hooks; ``trace_overhead`` is traced /
  untraced step time);
* **stretch**: each partition's compute inside the pipeline (its spans) vs
  the same partition's forward and backward run alone in the main thread on
  the same micro-batches, timed the same way, and the worker thread's
  time split into CPU, run-queue wait and the rest (blocked: waiting for the
  interpreter lock, or for another thread);
* **GIL**: with ``py-spy`` (when installed and ptrace is allowed), the share
  of samples in which each thread holds the interpreter lock (``--gil``) and
  in which it is on a CPU at all (``active``).
"""
from __future__ import annotations

import contextlib
import os
import re
import resource
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

import pipe

COMPUTE = ("forward", "backward", "recompute")


# -- per-thread CPU and run-queue time ------------------------------------------------------


def _schedstat() -> dict[int, tuple[int, int]]:
    """Per thread id of this process: (ns on a CPU, ns waiting in the run queue)."""
    out: dict[int, tuple[int, int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            run, wait, _ = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
        except (OSError, ValueError):
            continue
        out[int(tid)] = (int(run), int(wait))
    return out


def _role(tid: int) -> str:
    """main, pipe-worker-<j>, or other (OpenMP pool threads, autograd's, py-spy's nothing)."""
    for thread in threading.enumerate():
        if thread.native_id == tid:
            if thread is threading.main_thread():
                return "main"
            if thread.name.startswith("pipe-worker-"):
                return thread.name.rsplit("-", 1)[0]  # pipe-worker-<j>
    return "other"


class ThreadClock:
    """CPU and run-queue time per thread role, accumulated over the steps it times."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.process_cpu = 0.0
        self.system_cpu = 0.0  # in the kernel (page faults of fresh allocations, futexes of hand-offs)
        self.minor_faults = 0
        self.steps = 0
        self.cpu: dict[str, float] = {}
        self.runqueue: dict[str, float] = {}

    def time(self, step: Callable[[], Any]) -> float:
        before, times0, faults0, t0 = _schedstat(), os.times(), resource.getrusage(resource.RUSAGE_SELF), \
            time.perf_counter()
        step()
        wall, times1, faults1 = time.perf_counter() - t0, os.times(), resource.getrusage(resource.RUSAGE_SELF)
        after = _schedstat()
        self.wall += wall
        self.process_cpu += (times1.user - times0.user) + (times1.system - times0.system)
        self.system_cpu += times1.system - times0.system
        self.minor_faults += faults1.ru_minflt - faults0.ru_minflt
        self.steps += 1
        for tid, (run, wait) in after.items():
            run0, wait0 = before.get(tid, (0, 0))
            role = _role(tid)
            self.cpu[role] = self.cpu.get(role, 0.0) + (run - run0) / 1e9
            self.runqueue[role] = self.runqueue.get(role, 0.0) + (wait - wait0) / 1e9
        return wall

    def summary(self) -> dict[str, Any]:
        n = max(self.steps, 1)
        return {
            "cores_busy": self.process_cpu / self.wall if self.wall else 0.0,
            "kernel_cpu_s_per_step": self.system_cpu / n, "minor_faults_per_step": self.minor_faults / n,
            "cpu_s_per_step": {k: v / n for k, v in sorted(self.cpu.items())},
            "runqueue_wait_s_per_step": {k: v / n for k, v in sorted(self.runqueue.items())},
        }


# -- overlap and stretch from traces ---------------------------------------------------------


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, k = 0.0, 0, 0
    while i < len(a) and k < len(b):
        total += max(0.0, min(a[i][1], b[k][1]) - max(a[i][0], b[k][0]))
        if a[i][1] < b[k][1]:
            i += 1
        else:
            k += 1
    return total


def _own_schedstat() -> tuple[int, int]:
    """This thread's (ns on a CPU, ns waiting for one) so far."""
    run, wait, _ = Path(f"/proc/self/task/{threading.get_native_id()}/schedstat").read_text().split()
    return int(run), int(wait)


class SpanClock:
    """Per worker and kind (forward, backward): wall, CPU and run-queue seconds inside its compute.

    The rest of the wall time, neither on a CPU nor waiting for one, the
    thread slept inside its compute: waiting for the interpreter lock.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, dict[str, list[float]]] = {}

    @contextlib.contextmanager
    def measure(self, kind: str) -> Iterator[None]:
        name = threading.current_thread().name
        if not name.startswith("pipe-worker-"):
            yield
            return
        (run0, wait0), t0 = _own_schedstat(), time.perf_counter()
        try:
            yield
        finally:
            wall = time.perf_counter() - t0
            run, wait = _own_schedstat()
            entry = self.seconds.setdefault(name.split("-")[2], {}).setdefault(kind, [0.0, 0.0, 0.0])
            entry[0] += wall
            entry[1] += (run - run0) / 1e9
            entry[2] += (wait - wait0) / 1e9

    def hook(self, partitions: list[torch.nn.Module]) -> list[Any]:
        """Forward hooks that time each partition's forward on its worker."""
        handles, open_spans = [], threading.local()

        def pre(module: Any, args: Any) -> None:
            open_spans.span = self.measure("forward")
            open_spans.span.__enter__()

        def post(module: Any, args: Any, output: Any) -> None:
            span = getattr(open_spans, "span", None)
            if span is not None:
                open_spans.span = None
                span.__exit__(None, None, None)

        for partition in partitions:
            handles += [partition.register_forward_pre_hook(pre), partition.register_forward_hook(post)]
        return handles

    def summary(self, steps: int) -> dict[str, dict[str, dict[str, float]]]:
        """Per worker and kind, seconds per step: wall, cpu, runqueue, and blocked (the rest)."""
        return {j: {kind: {"wall": w / steps, "cpu": c / steps, "runqueue": q / steps,
                           "blocked": max(0.0, w - c - q) / steps}
                    for kind, (w, c, q) in sorted(kinds.items())}
                for j, kinds in sorted(self.seconds.items())}


@contextlib.contextmanager
def backward_spans(clock: Optional[SpanClock] = None) -> Iterator[None]:
    """One ``backward`` span per ``torch.autograd.backward`` call on a pipe worker, instead of per-node hooks.

    ``pipe.trace`` times a cell's backward with two Python hooks on every
    autograd node; each needs the interpreter lock, which is what this profile
    looks at. Here each worker's back-propagation of a cell is one span (the
    call that runs it, gradient accumulation included), and the node hooks are
    off. The main thread's ``loss.backward()`` is not timed.
    """
    original_backward, original_watch = torch.autograd.backward, pipe.trace.watch_backward
    counter = iter(range(1 << 30))

    def backward(*args: Any, **kwargs: Any) -> Any:
        name = threading.current_thread().name
        if not name.startswith("pipe-worker-"):
            return original_backward(*args, **kwargs)
        with pipe.trace.span("backward", (next(counter), int(name.split("-")[2]))), \
                clock.measure("backward") if clock is not None else contextlib.nullcontext():
            return original_backward(*args, **kwargs)

    torch.autograd.backward = backward
    pipe.trace.watch_backward = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.autograd.backward, pipe.trace.watch_backward = original_backward, original_watch


def compute_spans(trace: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per stage: the merged compute intervals (seconds) and the summed span time per kind."""
    stages: dict[int, dict[str, Any]] = {}
    for event in trace["traceEvents"]:
        if event.get("ph") != "X" or event["args"].get("phase") not in COMPUTE:
            continue
        stage = stages.setdefault(event["tid"], {"intervals": [], "seconds": {}})
        start, dur = event["ts"] / 1e6, event["dur"] / 1e6
        stage["intervals"].append((start, start + dur))
        kind = event["args"]["phase"]
        stage["seconds"][kind] = stage["seconds"].get(kind, 0.0) + dur
    for stage in stages.values():
        stage["intervals"] = _union(stage["intervals"])
    return stages


def overlap(trace: dict[str, Any], wall: float) -> dict[str, Any]:
    """Fraction of the step's wall time in which both (first two) partitions compute."""
    stages = compute_spans(trace)
    busy = {j: _length(s["intervals"]) for j, s in stages.items()}
    both = _intersection(stages[0]["intervals"], stages[1]["intervals"]) if len(stages) >= 2 else 0.0
    return {
        "both_compute_fraction": both / wall,
        "busy_fraction": {str(j): b / wall for j, b in sorted(busy.items())},
        "span_s": {str(j): dict(sorted(stages[j]["seconds"].items())) for j in sorted(stages)},
    }


def alone(model: Any, captured: list[list[tuple[Any, ...]]], threads: int) -> dict[str, dict[str, float]]:
    """Each partition's forward and backward spans run alone in this thread, on the captured micro-batches.

    Timed as inside the pipeline (a span around the forward, one around the
    ``torch.autograd.backward`` call, as :func:`backward_spans` does), one
    partition at a time; also the thread's CPU time. Median over 3 repetitions.
    """
    torch.set_num_threads(threads)
    out: dict[str, dict[str, float]] = {}
    for j, partition in enumerate(model.partitions):
        forward, backward, cpu = [], [], []
        for _ in range(3):
            with pipe.trace.record() as recorder:
                cpu0 = time.thread_time()
                for i, args in enumerate(captured[j]):
                    inputs = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                                   for a in args)
                    with pipe.trace.span("forward", (i, j)):
                        output = partition(*inputs)
                    outputs = [t for t in (output if isinstance(output, tuple) else (output,))
                               if isinstance(t, torch.Tensor) and t.requires_grad]
                    grads = [torch.ones_like(t) for t in outputs]
                    with pipe.trace.span("backward", (i, j)):
                        torch.autograd.backward(outputs, grads)
                cpu.append(time.thread_time() - cpu0)
            seconds = compute_spans(recorder.trace())[j]["seconds"]
            forward.append(seconds.get("forward", 0.0))
            backward.append(seconds.get("backward", 0.0))
        model.zero_grad(set_to_none=True)
        out[str(j)] = {"forward": statistics.median(forward), "backward": statistics.median(backward),
                       "cpu": statistics.median(cpu)}
    return out


def capture_inputs(model: Any, step: Callable[[], Any]) -> list[list[tuple[Any, ...]]]:
    """The positional inputs of every partition's forward during one step, per partition."""
    captured: list[list[tuple[Any, ...]]] = [[] for _ in model.partitions]
    handles = [p.register_forward_pre_hook(lambda _m, args, j=j: captured[j].append(args))
               for j, p in enumerate(model.partitions)]
    try:
        step()
    finally:
        for handle in handles:
            handle.remove()
    return captured


# -- py-spy: who holds the interpreter lock ----------------------------------------------------


def py_spy_available() -> Optional[str]:
    """None when py-spy can sample this process, else why not."""
    if shutil.which("py-spy") is None:
        return "py-spy is not installed (pip install py-spy)"
    probe = subprocess.run(["py-spy", "dump", "--pid", str(os.getpid())], capture_output=True, text=True,
                           timeout=60)
    if probe.returncode != 0:
        return f"py-spy cannot read this process (ptrace refused?): {probe.stderr.strip().splitlines()[0:1]}"
    return None


def _py_spy(step: Callable[[], Any], seconds: float, rate: int, gil: bool) -> dict[str, float]:
    """Share of samples per thread role over ``seconds`` of repeated steps (``--gil``: holding the lock)."""
    raw = Path(f"/tmp/pyspy-{os.getpid()}-{int(gil)}.txt")
    cmd = ["py-spy", "record", "--pid", str(os.getpid()), "--duration", str(int(seconds)), "--rate", str(rate),
           "--threads", "--nonblocking", "--format", "raw", "--output", str(raw)] + (["--gil"] if gil else [])
    spy = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(0.5)  # let it attach
    while spy.poll() is None:
        step()
    log = spy.communicate()[0]
    if spy.returncode != 0 or not raw.exists():
        raise RuntimeError(f"py-spy failed: {log[-300:]}")
    # py-spy's "Samples" counts stack traces (one per thread and tick), so the share of time is out of the ticks.
    total = rate * int(seconds)
    counts: dict[str, int] = {}
    for line in raw.read_text().splitlines():
        head, _, count = line.rpartition(" ")
        thread = re.match(r"thread \((\d+)\): ([^;]*)", head)  # py-spy names Python threads by their name
        if thread is None:
            continue
        name = thread.group(2)
        role = "main" if name == "MainThread" else name.rsplit("-", 1)[0] if name.startswith("pipe-worker-") \
            else _role(int(thread.group(1)))
        counts[role] = counts.get(role, 0) + int(count)
    raw.unlink()
    return {role: c / total for role, c in sorted(counts.items())}


def gil_profile(step: Callable[[], Any], seconds: float, rate: int = 200) -> dict[str, Any]:
    """py-spy's share of samples per thread: holding the GIL, and active (on a CPU) at all."""
    return {"gil": _py_spy(step, seconds, rate, gil=True), "active": _py_spy(step, seconds, rate, gil=False),
            "rate_hz": rate, "seconds": seconds}


# -- one configuration ----------------------------------------------------------------------


def profile(steps: dict[str, Callable[[], Any]], pipes: dict[str, Any], threads: dict[str, int], repeat: int,
            traced: int, spy_seconds: float) -> dict[str, Any]:
    """The profile of every configuration; untraced steps alternate between configurations.

    Args:
        steps: name -> one training step (forward, loss, backward).
        pipes: name -> the ``Pipe`` of that step (configurations without one get cores busy only).
        threads: name -> intra-op threads of a partition (for its run alone).
        repeat: untraced steps per configuration, for step time and cores busy.
        traced: traced steps per configuration, for overlap and stretch.
        spy_seconds: seconds of py-spy sampling per configuration and mode (0: skip py-spy).
    """
    clocks = {name: ThreadClock() for name in steps}
    walls: dict[str, list[float]] = {name: [] for name in steps}
    for name, step in steps.items():  # warm up
        step()
    for _ in range(repeat):
        for name, step in steps.items():
            walls[name].append(clocks[name].time(step))
    result: dict[str, Any] = {}
    for name in steps:
        result[name] = {"step_s": statistics.median(walls[name]), **clocks[name].summary()}
    why_no_spy = py_spy_available() if spy_seconds > 0 else "skipped (--quick)"
    for name, model in pipes.items():
        step, entry = steps[name], result[name]
        traced_clock, span_clock = ThreadClock(), SpanClock()
        overlaps, traced_walls = [], []
        handles = span_clock.hook(model.partitions)
        try:
            for _ in range(traced):
                with backward_spans(span_clock), pipe.trace.record() as recorder:
                    wall = traced_clock.time(step)
                traced_walls.append(wall)
                overlaps.append(overlap(recorder.trace(), wall))
        finally:
            for handle in handles:
                handle.remove()
        inside = span_clock.summary(traced)
        entry["trace_overhead"] = statistics.median(traced_walls) / entry["step_s"]
        entry["both_compute_fraction"] = statistics.median(o["both_compute_fraction"] for o in overlaps)
        entry["busy_fraction"] = {j: statistics.median(o["busy_fraction"][j] for o in overlaps)
                                  for j in overlaps[0]["busy_fraction"]}
        in_pipe = {j: {k: statistics.median(o["span_s"][j].get(k, 0.0) for o in overlaps)
                       for k in ("forward", "backward")} for j in overlaps[0]["span_s"]}
        by_itself = alone(model, capture_inputs(model, step), threads[name])
        traced_summary = traced_clock.summary()
        entry["partitions"] = {}
        for j in in_pipe:
            spans = in_pipe[j]["forward"] + in_pipe[j]["backward"]
            solo = by_itself[j]["forward"] + by_itself[j]["backward"]
            worker_cpu = traced_summary["cpu_s_per_step"].get(f"pipe-worker-{j}", 0.0)
            split = inside.get(j, {})
            entry["partitions"][j] = {
                "in_pipeline_s": in_pipe[j], "alone_s": by_itself[j],
                "stretch": spans / solo if solo else None,
                # The worker's compute (forward and backward) split: on a CPU, waiting for a core, blocked.
                "inside_compute_s": split,
                "blocked_s": sum(k["blocked"] for k in split.values()),
                "runqueue_s": sum(k["runqueue"] for k in split.values()),
                "worker_cpu_s": worker_cpu,
                "cpu_stretch": worker_cpu / by_itself[j]["cpu"] if by_itself[j]["cpu"] else None,
            }
        torch.set_num_threads(1)
        if why_no_spy is None:
            entry["py_spy"] = gil_profile(step, spy_seconds)
        else:
            entry["py_spy"] = why_no_spy
    return result


def table(result: dict[str, Any]) -> str:
    """The profile as a markdown table (the one docs/benchmarks.md shows)."""
    rows = ["| configuration | step | / plain 1 thread | cores busy | both partitions compute | stretch p0, p1 "
            "| blocked in compute p0, p1 | waiting for a core p0, p1 | GIL held: main, w0, w1 | on a CPU: w0, w1 |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, entry in result.items():
        speedup = entry.get("speedup_vs_plain_1thread")
        cells = [name, f"{entry['step_s']:.3f} s", "" if speedup is None else f"{speedup:.2f}x",
                 f"{entry['cores_busy']:.2f}"]
        if "partitions" in entry:
            parts = entry["partitions"]
            cells.append(f"{entry['both_compute_fraction']:.0%}")
            cells.append(", ".join(f"{parts[j]['stretch']:.2f}" for j in sorted(parts)))
            cells.append(", ".join(f"{parts[j]['blocked_s'] * 1e3:.0f} ms" for j in sorted(parts)))
            cells.append(", ".join(f"{parts[j]['runqueue_s'] * 1e3:.0f} ms" for j in sorted(parts)))
            spy = entry.get("py_spy")
            if isinstance(spy, dict):
                gil, active = spy["gil"], spy["active"]
                cells.append(", ".join(f"{gil.get(r, 0.0):.0%}" for r in ("main", "pipe-worker-0", "pipe-worker-1")))
                cells.append(", ".join(f"{active.get(r, 0.0):.0%}" for r in ("pipe-worker-0", "pipe-worker-1")))
            else:
                cells += ["", ""]
        else:
            cells += [""] * 6
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
