"""Explanations: where every idle millisecond of a recorded step or a predicted plan went.

:func:`explain` reads a trace (:mod:`pipe.trace`), :func:`explain_prediction`
a plan of the planner (:class:`pipe.plan.Prediction`); both hand the
timeline to the idle-time analysis of :mod:`pipe.viz.idle`, which cuts each
row's wall time into compute, transfer and idle intervals named bubble
(the schedule's own wait), wait (beyond it) or overhead (nothing left to
wait for). ``pipe-viz trace --explain`` prints the same table.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from pipe.core.action import Phase
from pipe.viz.idle import Explanation, explain_timeline
from pipe.viz.timeline import Span, Timeline

__all__: list[str] = []


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
    names = {Phase.FORWARD: "forward", Phase.BACKWARD: "backward", Phase.RECOMPUTE: "recompute",
             Phase.INPUT: "input", Phase.WEIGHT: "weight"}
    ranks = prediction.candidate.ranks
    cells = [Span(row=t.rank, kind=names[t.action.phase], start=t.start * 1e3, end=t.end * 1e3,
                  microbatch=t.action.microbatch, stage=t.action.stage, chunk=t.action.stage // ranks)
             for t in prediction.timeline]
    timeline = Timeline(title=prediction.candidate.describe(), rows=[f"rank {r}" for r in range(ranks)],
                        cells=cells, unit="ms")
    return explain_timeline(timeline, prediction.candidate.schedule, bubble_only=True)
