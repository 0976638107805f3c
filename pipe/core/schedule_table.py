"""Schedules given as tables: your own order of F, B, I and W on every rank.

A :class:`TableSchedule` is a :class:`~pipe.core.schedule.Schedule` whose
programs are data: one list of actions per rank, in the order the rank runs
them. The stages a rank runs are those its actions name; the micro-batches
are those the table covers. It is validated when built (:meth:`Schedule.validate`,
as every schedule is), simulated and drawn like any schedule
(``pipe-viz plan --table FILE.csv``), and run by the process runner
(``DistributedPipe(schedule=table)``). A table may also say, per rank, how
many actions ahead the rank posts its receives (:meth:`TableSchedule.with_posts`,
chosen from costs by :func:`pipe.core.cost_order.choose_posts`).

The Python form: a list per rank of actions, each ``"F3@1"`` (phase,
micro-batch, ``@`` stage, as :class:`~pipe.core.action.Action` prints),
a ``(phase, micro-batch, stage)`` tuple or an ``Action``::

    TableSchedule.from_table([["F0@0", "F1@0", "B0@0", "B1@0"],
                              ["F0@1", "B0@1", "F1@1", "B1@1"]])

The CSV form is torch's ``compute_only`` pipeline order
(``torch.distributed.pipelining`` schedules' ``_dump_csv``/``_load_csv``):
one row per rank, one cell per action written ``{stage}{phase}{micro-batch}``
(``0F1`` is the forward of micro-batch 1 on stage 0); empty cells are idle
steps and are skipped. ``F0@0`` cells are read too. Posts other than one
action ahead on every rank are kept in a last row of ours, ``# post_ahead``
then one number per rank (torch's reader does not know it; the row is only
written where a rank posts otherwise).

Phases: ``F`` forward, ``B`` whole backward, ``I`` input gradient and ``W``
weight gradient (:mod:`pipe.core.iw_backward`). A table with I and W may
also hold B's (DualPipeV's order does): such a B runs as its I and its W at
once. :func:`torch_order` builds the table of one of torch's own schedules,
e.g. ``"DualPipeV"`` or ``"InterleavedZeroBubble"``, from torch's code.
"""
from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence, Union

from pipe.core.action import Action, Phase
from pipe.core.schedule import Schedule

if TYPE_CHECKING:
    from os import PathLike

__all__: list[str] = []

ActionLike = Union[str, Action, Sequence[Any]]

_OURS = re.compile(r"^([FBIW])(\d+)@(\d+)$")
_TORCHS = re.compile(r"^(\d+)([FBIW])(\d+)$")
_POSTS = "# post_ahead"  # the CSV row of each rank's posts


@dataclass(frozen=True)
class TableSchedule(Schedule):
    """A schedule given as a table of actions per rank; build it with :meth:`from_table` or :meth:`from_csv`.

    Attributes:
        programs: per rank, the actions in the order the rank runs them.
        placement: per stage, the rank that runs it.
        name: what the schedule is called in drawings and errors.
        posts: per rank, how many actions ahead it posts its receives; empty: 1 on every rank.
    """

    programs: tuple[tuple[Action, ...], ...] = ()
    placement: tuple[int, ...] = ()
    name: str = "table"
    posts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """The sizes, as every schedule's, and the fields agreeing with them: one program and one post count
        per rank, a rank per stage, as many stages on the busiest rank as ``virtual_stages``. Whether the
        programs can run is :meth:`validate`'s (``from_table`` calls it)."""
        self._check_sizes()
        if len(self.programs) != self.ranks or (self.posts and len(self.posts) != self.ranks):
            raise ValueError(f"table {self.name!r}: {len(self.programs)} programs and {len(self.posts)} post counts "
                             f"for {self.ranks} ranks; build tables with TableSchedule.from_table")
        if not self.placement or any(not 0 <= r < self.ranks for r in self.placement) or self.virtual_stages != max(
                self.placement.count(r) for r in range(self.ranks)):
            raise ValueError(f"table {self.name!r}: placement {list(self.placement)} does not put each stage on one "
                             f"of {self.ranks} ranks with at most virtual_stages={self.virtual_stages} each; build "
                             f"tables with TableSchedule.from_table")

    @classmethod
    def from_table(cls, table: Sequence[Iterable[ActionLike]], name: str = "table") -> "TableSchedule":
        """The schedule of ``table`` (one iterable of actions per rank), validated.

        Raises:
            ValueError: a cell that is not an action, or a table that cannot run;
                the message names the first action that breaks it.
        """
        if isinstance(table, (str, bytes)) or not len(table):
            raise ValueError(f"a schedule table needs one list of actions per rank, got {table!r}")
        programs = tuple(tuple(_action(cell, rank) for cell in row) for rank, row in enumerate(table))
        placement: dict[int, tuple[int, Action]] = {}
        for rank, program in enumerate(programs):
            for action in program:
                home = placement.setdefault(action.stage, (rank, action))
                if home[0] != rank:
                    raise ValueError(f"table {name!r}: rank {rank} runs {action} but stage {action.stage} runs "
                                     f"on rank {home[0]} ({home[1]}); each stage runs on one rank")
        stages = max(placement, default=-1) + 1
        missing = [s for s in range(stages) if s not in placement]
        if missing or not stages:
            raise ValueError(f"table {name!r}: no rank runs stage {missing[0] if missing else 0}; "
                             "stages are numbered 0, 1, ... in model order, each run by one rank")
        if any(a.phase in (Phase.INPUT, Phase.WEIGHT) for p in programs for a in p):  # B = I then W at once
            programs = tuple(tuple(b for a in p for b in ((Action(Phase.INPUT, a.microbatch, a.stage),
                                                           Action(Phase.WEIGHT, a.microbatch, a.stage))
                                                          if a.phase is Phase.BACKWARD else (a,)))
                             for p in programs)
        microbatches = 1 + max(a.microbatch for p in programs for a in p)
        per_rank = max(sum(1 for r in placement.values() if r[0] == rank) for rank in range(len(programs)))
        schedule = cls("table", len(programs), microbatches, per_rank, programs,
                       tuple(placement[s][0] for s in range(stages)), name)
        schedule.validate()
        return schedule

    @classmethod
    def from_csv(cls, source: Union[str, "PathLike[str]", io.TextIOBase], name: str | None = None) -> "TableSchedule":
        """The schedule of a CSV table (a path or an open text file): one row per rank, see the module docstring."""
        if isinstance(source, io.TextIOBase):
            rows = list(csv.reader(source))
        else:
            path = Path(source)
            name = name or path.stem
            with path.open(newline="") as handle:
                rows = list(csv.reader(handle))
        rows = [[cell.strip() for cell in row if cell.strip()] for row in rows]
        posts = [row for row in rows if row and row[0] == _POSTS]
        table = cls.from_table([row for row in rows if not row or row[0] != _POSTS], name or "table")
        if not posts:
            return table
        try:
            return table.with_posts([int(cell) for cell in posts[-1][1:]])
        except ValueError as error:
            raise ValueError(f"table {table.name!r}: its {_POSTS!r} row {posts[-1][1:]} is not one int >= 0 per "
                             f"rank ({error})") from None

    def to_csv(self) -> str:
        """The table as CSV, in torch's ``compute_only`` notation (``{stage}{phase}{micro-batch}``), and the
        ``# post_ahead`` row where a rank posts other than one action ahead."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        for program in self.programs:
            writer.writerow([f"{a.stage}{a.phase.value}{a.microbatch}" for a in program])
        if any(n != 1 for n in self.posts):
            writer.writerow([_POSTS, *self.posts])
        return out.getvalue()

    def with_posts(self, posts: Sequence[int]) -> "TableSchedule":
        """This table with each rank posting its receives ``posts[rank]`` actions ahead (0: just before
        its wait; 1: the runner's default, before the action before; more: earlier, each posted receive
        holding its buffer till it is waited for).

        Raises:
            ValueError: not one int >= 0 per rank.
        """
        listed = list(posts) if isinstance(posts, Iterable) and not isinstance(posts, (str, bytes)) else None
        if listed is None or len(listed) != self.ranks or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in listed):
            raise ValueError(f"posts must be one int >= 0 per rank ({self.ranks}), actions ahead that rank "
                             f"posts its receives; got {posts!r}")
        return replace(self, posts=tuple(listed))

    def post_ahead(self, rank: int) -> int:
        self._check_rank(rank)
        return self.posts[rank] if self.posts else 1

    @property
    def stages(self) -> int:
        return len(self.placement)

    @property
    def splits_backward(self) -> bool:
        return any(a.phase is Phase.INPUT for program in self.programs for a in program)

    def rank_of(self, stage: int) -> int:
        if not 0 <= stage < self.stages:
            raise ValueError(f"stage {stage} is out of range for table {self.name!r} with {self.stages} stages; "
                             f"expected 0 <= stage < {self.stages}")
        return self.placement[stage]

    def stages_of(self, rank: int) -> list[int]:
        self._check_rank(rank)
        return [s for s, r in enumerate(self.placement) if r == rank]

    def actions(self, rank: int) -> list[Action]:
        self._check_rank(rank)
        return list(self.programs[rank])

    def __str__(self) -> str:
        return f"table {self.name!r} ({self.ranks} ranks, {self.stages} stages, {self.microbatches} micro-batches)"


def _action(cell: ActionLike, rank: int) -> Action:
    if isinstance(cell, Action):
        return cell
    if isinstance(cell, str):
        text = cell.strip()
        ours, torchs = _OURS.match(text), _TORCHS.match(text)
        if ours:
            return Action(Phase(ours.group(1)), int(ours.group(2)), int(ours.group(3)))
        if torchs:
            return Action(Phase(torchs.group(2)), int(torchs.group(3)), int(torchs.group(1)))
    elif isinstance(cell, Sequence) and len(cell) == 3 and str(cell[0]) in "FBIW" and str(cell[0]) \
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in cell[1:]):
        return Action(Phase(str(cell[0])), int(cell[1]), int(cell[2]))
    raise ValueError(
        f"rank {rank}: {cell!r} is not an action; write 'F3@1' (phase, micro-batch @ stage), torch's '1F3' "
        "(stage, phase, micro-batch) or ('F', 3, 1), with phase F, B, I or W")


def torch_order(schedule: str, ranks: int, microbatches: int) -> TableSchedule:
    """The table of torch's schedule ``schedule`` (``torch.distributed.pipelining``), computed by torch's code.

    Args:
        schedule: ``"DualPipeV"`` (2 stages per rank in a V, B's and I/W's),
            ``"InterleavedZeroBubble"`` (2 stages per rank, looped, I/W) or
            ``"ZBVZeroBubble"`` (torch's ZB-V: 2 stages per rank in a V, I/W;
            pipe's ``schedule="zbv"`` runs the same order once there are
            more micro-batches than ranks).
        ranks, microbatches: the pipeline ranks and micro-batches.

    Raises:
        ValueError: another name, or sizes torch's schedule refuses.
    """
    from torch.distributed.pipelining import schedules

    classes = {"DualPipeV": schedules.ScheduleDualPipeV,
               "InterleavedZeroBubble": schedules.ScheduleInterleavedZeroBubble,
               "ZBVZeroBubble": schedules.ScheduleZBVZeroBubble}
    if schedule not in classes:
        raise ValueError(f"torch_order knows {sorted(classes)}, got {schedule!r}")
    if microbatches < 2 * ranks if schedule == "DualPipeV" else microbatches % max(1, microbatches // ranks):
        raise ValueError(f"torch's {schedule} refuses {microbatches} micro-batches on {ranks} ranks "
                         "(DualPipeV: at least 2 * ranks; InterleavedZeroBubble: a multiple of the rounds)")
    order: Any = object.__new__(classes[schedule])  # the order needs the sizes only, not stages or a group
    order.pp_group_size, order._n_microbatches, order.n_local_stages = ranks, microbatches, 2
    order._num_stages = order.num_stages = 2 * ranks
    order.stage_index_to_group_rank = {s: s if s < ranks else 2 * ranks - 1 - s for s in range(2 * ranks)}  # a V
    order.number_of_rounds = max(1, microbatches // ranks)
    order.microbatches_per_round = microbatches // order.number_of_rounds
    table = []
    for rank in range(ranks):
        row: list[Action] = []
        for step in order._calculate_single_rank_operations(rank):
            for sub in (step.sub_actions or (step,)) if step is not None else ():
                kind = sub.computation_type.name
                phase = {"F": "F", "B": "B", "I": "I", "W": "W", "FORWARD": "F", "FULL_BACKWARD": "B",
                         "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}[kind]
                row.append(Action(Phase(phase), sub.microbatch_index, sub.stage_index))
        table.append(row)
    return TableSchedule.from_table(table, name=f"torch {schedule}")
