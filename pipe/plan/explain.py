"""Explanations: where every idle millisecond of a pipeline step went.

A timeline (a recorded trace, :mod:`pipe.trace`, or a predicted plan) shows
boxes; this module names the gaps between them. On each row (a stage of the
thread pipeline, or a rank), the step's wall time is cut into busy time
(compute: forward, backward, recompute; transfer: copy, send, recv) and idle
intervals, and each idle interval gets a cause from the schedule's data
dependencies (:meth:`pipe.core.schedule.Schedule.simulate`'s rule: a forward
needs the forward of the stage before, a backward the backward of the stage
after, the last stage's backward its own forward):

* **bubble**: waiting for the named action (``F3@0``) for as long as the
  schedule itself makes this row wait there (the plan of the same schedule
  with the mean measured durations), and the drain after a row's last action;
* **wait**: waiting for the named action beyond that (a slow or late upstream
  stage, a transfer that held it);
* **overhead**: the awaited action had already ended (or there was none):
  runtime work between actions that no span covers.

A receive of the process runner (``recv`` span) blocks until the sender's
action ends: that part of it is waiting for that action (bubble or wait),
the rest is transfer.

The busy time and the idle intervals tile the step window exactly, so the
attributed share of every row is 100% by construction::

    stage 1 |  F0  ....  F1  B1 ....  B0 |
                   ^ wait for F1@0 (bubble 0.4 ms, wait 0.1 ms)
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from pipe.core.schedule import Phase
from pipe.viz.idle import CATEGORIES, Explanation, Idle, explain_timeline
from pipe.viz.timeline import Span, Timeline

__all__ = ["CATEGORIES", "Explanation", "Idle", "explain", "explain_prediction", "explain_timeline"]


def explain(trace: Mapping[str, Any], step: Optional[int] = None) -> Explanation:
    """Explains a recorded trace (:func:`pipe.trace.load` or :func:`pipe.trace.merge`), in ms.

    Args:
        step: which training step (0-based, negative from the end); None: the whole trace.

    Raises:
        pipe.trace.TraceError: the trace has no spans, or ``step`` is out of range.
    """
    from pipe.viz.measured import from_trace

    timeline = from_trace(trace, step)
    kind = str(trace.get("otherData", {}).get("config", {}).get("schedule", "gpipe"))
    return explain_timeline(timeline, kind)


def explain_prediction(prediction: Any) -> Explanation:
    """Explains a predicted plan (:class:`pipe.plan.Prediction`), in ms: all of its idle time is the schedule's."""
    names = {Phase.FORWARD: "forward", Phase.BACKWARD: "backward", Phase.RECOMPUTE: "recompute"}
    ranks = prediction.candidate.ranks
    cells = [Span(row=t.rank, kind=names[t.action.phase], start=t.start * 1e3, end=t.end * 1e3,
                  microbatch=t.action.microbatch, stage=t.action.stage, chunk=t.action.stage // ranks)
             for t in prediction.timeline]
    timeline = Timeline(title=prediction.candidate.describe(), rows=[f"rank {r}" for r in range(ranks)],
                        cells=cells, unit="ms")
    return explain_timeline(timeline, prediction.candidate.schedule, bubble_only=True)
