"""pipe.viz: pictures of pipeline schedules, planned and measured.

Plans come from :mod:`pipe.core.schedule` (the tables the engines execute),
measurements from :mod:`pipe.trace` recordings; both become a
:class:`~pipe.viz.timeline.Timeline` drawn as text, SVG, HTML or Chrome
trace-event JSON. The ``pipe-viz`` command (``python -m pipe.viz``) wraps it::

    pipe-viz plan --schedule 1f1b --ranks 4 --microbatches 8 -o 1f1b.svg
    pipe-viz trace run.json --plan -o run.html
"""
from pipe.core.deprecation import moved
from pipe.trace import record
from pipe.viz.measured import from_trace, schedule_like
from pipe.viz.planned import schedule_timeline
from pipe.viz.timeline import Span, Timeline

__all__ = ["Span", "Timeline", "from_trace", "schedule_like", "schedule_timeline", "record"]

# Old names, one release.
__getattr__ = moved(__name__, __name__, {"Cell": "Span", "plan_like": "schedule_like"})
