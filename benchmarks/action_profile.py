"""Where a step's time goes, per engine: compute per action, posting and waiting for messages, headers.

``instrument(engine)`` wraps, in this rank's process, the functions each
engine runs per action with wall-clock accumulators (a ``perf_counter`` pair
per call, well under a percent of an action on the benchmarks' sizes) and
returns the dict they fill; ``report(profile, steps)`` turns it into seconds
per step (and calls per step). Used by ``distributed_vs_torch_pipelining.py``
and ``zero_bubble.py`` with ``--profile``:

* pipe: ``forward`` and ``backward``/``input``/``weight`` compute (the
  runtime's per-action methods, sends they start excluded), ``send`` (the
  transport's Python and the posting of its isends), ``wait`` (blocked on
  receives), and the header messages: whole (pickled) or repeated (8 bytes),
  and the values that travelled behind their header (inline);
* torch: ``forward_one_chunk``, ``backward_one_chunk`` and
  ``backward_weight_one_chunk`` of its ``PipelineStage`` (which include the
  stage's own bookkeeping), ``post`` (``batch_isend_irecv``) and ``wait``.
"""
from __future__ import annotations

import collections
import functools
import time
from typing import Any, Callable

Profile = dict[str, list[float]]  # name -> [seconds, calls]


def _timed(profile: Profile, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            entry = profile[name]
            entry[0] += time.perf_counter() - start
            entry[1] += 1
    return wrapper


#: Per engine, the profiled names that are compute: a forward, a backward (pipe: B or I), a weight gradient.
COMPUTE: dict[str, tuple[str, str, str]] = {
    "pipe": ("forward", "backward", "weight"),  # a lowered program's sends are steps of their own
    "torch": ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"),
}


def instrument(engine: str) -> Profile:
    """Wraps ``engine``'s per-action functions in this process; the returned dict fills as steps run."""
    profile: Profile = collections.defaultdict(lambda: [0.0, 0])
    if engine == "pipe":
        from pipe.distributed import runtime, transport

        transport.Transport.send = _timed(profile, "send", transport.Transport.send)  # type: ignore[method-assign]
        transport.Incoming.wait = _timed(profile, "wait", transport.Incoming.wait)  # type: ignore[method-assign]
        runtime.Runtime._forward = _timed(profile, "forward", runtime.Runtime._forward)  # type: ignore
        runtime.Runtime._backward = _timed(profile, "backward", runtime.Runtime._backward)  # type: ignore
        from pipe.core import iw_backward

        iw_backward.IWBackward.backward_weight = _timed(  # type: ignore[method-assign]
            profile, "weight", iw_backward.IWBackward.backward_weight)
    else:
        from torch.distributed.pipelining import schedules, stage

        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage._PipelineStageBase, name, _timed(profile, name, getattr(stage._PipelineStageBase, name)))
        schedules._batch_p2p = _timed(profile, "post", schedules._batch_p2p)
        schedules._wait_batch_p2p = _timed(profile, "wait", schedules._wait_batch_p2p)
    return profile


def report(profile: Profile, steps: int, transport_stats: dict[str, float] | None = None) -> dict[str, Any]:
    """Milliseconds and calls per step of each profiled function (pipe: compute without the sends, and headers)."""
    out = {name: {"ms_per_step": 1e3 * seconds / steps, "calls_per_step": calls / steps}
           for name, (seconds, calls) in sorted(profile.items())}
    if "forward" in profile and transport_stats is not None:
        send = 1e3 * transport_stats.get("send_s", 0.0) / steps
        out["transport"] = {"messages_per_step": transport_stats.get("messages", 0) / steps,
                            "whole_headers_per_step": transport_stats.get("headers", 0) / steps,
                            "repeated_headers_per_step": transport_stats.get("repeated_headers", 0) / steps,
                            "inline_values_per_step": transport_stats.get("inline", 0) / steps,
                            "send_ms_per_step": send,
                            "wait_ms_per_step": 1e3 * transport_stats.get("wait_s", 0.0) / steps}
        # Before the lowered programs (results of 2026-11-27 and earlier) these were "forward+send" and
        # "backward+send", the sends inside them, and the send time was subtracted here.
        out["compute_ms_per_step_without_sends"] = (out["forward"]["ms_per_step"]
                                                    + out.get("backward", {}).get("ms_per_step", 0.0))
    return out
