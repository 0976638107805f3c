"""One action of a pipeline program: a phase of one micro-batch on one stage, the only form schedules use inside.

Every schedule (the fixed kinds of :mod:`pipe.core.schedule`, the zero-bubble
orders of :mod:`pipe.core.zero_bubble`, the cost-shaped orders of
:mod:`pipe.core.greedy_order` and :mod:`pipe.core.cost_order`, tables of
:mod:`pipe.core.schedule_table`) is a program of :class:`Action` per rank.
Their text, ``"F0@1"`` (``str(action)``), is for input and output: tables
and CSV files (parsed by :func:`pipe.core.schedule_table.parse_action`),
drawings and messages. The module imports no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__: list[str] = []


class Phase(str, enum.Enum):
    """What an action does to one micro-batch on one stage."""

    FORWARD = "F"
    BACKWARD = "B"
    RECOMPUTE = "R"  # only in simulated timelines, when checkpointing
    INPUT = "I"  # the input-gradient half of a backward (zero-bubble schedules)
    WEIGHT = "W"  # the weight-gradient half, run later on the same rank


@dataclass(frozen=True)
class Action:
    """One step of a rank's program: run ``phase`` of ``microbatch`` on ``stage``.

    ``stage`` is the model stage (a model chunk, or "virtual stage" in the
    interleaved schedule), not the rank that runs it; see ``Schedule.rank_of``.
    """

    phase: Phase
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.phase.value}{self.microbatch}@{self.stage}"


@dataclass(frozen=True)
class TimedAction:
    """An action placed on the simulated timeline of ``rank``, from ``start`` to ``end``."""

    action: Action
    rank: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start
