"""pipe.viz: pictures of pipeline schedules, planned and measured.

Plans come from :mod:`pipe.core.schedule` (the tables the engines execute),
measurements from :mod:`pipe.trace` recordings; both become a
:class:`~pipe.viz.timeline.Timeline` drawn as text, SVG, HTML or Chrome
trace-event JSON. The ``pipe-viz`` command (``python -m pipe.viz``) wraps it::

    pipe-viz plan --schedule 1f1b --stages 4 --microbatches 8 -o 1f1b.svg
    pipe-viz trace run.json --plan -o run.html
"""
from pipe.trace import record
from pipe.viz.measured import from_trace, plan_like
from pipe.viz.planned import plan
from pipe.viz.timeline import Cell, Timeline

__all__ = ["Cell", "Timeline", "from_trace", "plan", "plan_like", "record"]
