"""The ``pipe-viz`` command: draw a planned schedule or a recorded trace.

Usage::

    pipe-viz plan --schedule 1f1b --ranks 4 --microbatches 8 [--virtual-stages 2]
                  [--checkpoint always] [--transfer 0.2] [--fsdp zero3 --gather 0.5 --reduce 0.5]
                  [-o out.svg]
    pipe-viz trace run.json [more ranks' files ...] [--step N] [--plan] [--explain] [-o out.html]

The output format follows the extension of ``-o``: ``.svg``, ``.html``,
``.txt`` or ``.json`` (Chrome trace events, for https://ui.perfetto.dev);
without ``-o`` a text timeline goes to the terminal. Bad arguments exit with
status 2 and a message naming the value and the fix.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from pipe.core.options import CHECKPOINT_MODES
from pipe.core.schedule import SCHEDULE_KINDS
from pipe.trace import TraceError, load, merge
from pipe.viz.html import render_html
from pipe.viz.measured import from_trace, schedule_like
from pipe.viz.planned import Communication, schedule_timeline
from pipe.viz.svg import render_svg
from pipe.viz.text import render_text
from pipe.viz.timeline import Timeline

__all__: list[str] = []

FORMATS = (".svg", ".html", ".txt", ".json")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value} (use 1 or more)")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def _time(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a time >= 0, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite time >= 0, got {text!r}")
    return value


def _output(text: str) -> Path:
    path = Path(text)
    if path.suffix.lower() not in FORMATS:
        raise argparse.ArgumentTypeError(
            f"cannot tell the format of {text!r} from its extension; use one of {', '.join(FORMATS)}"
        )
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipe-viz",
        description="Draw pipeline schedules: planned ones from pipe.core.schedule, measured ones from pipe.trace.",
    )
    commands = parser.add_subparsers(dest="command", metavar="{plan,trace}", required=True)

    p = commands.add_parser("plan", help="draw the planned schedule of a configuration",
                            description="Draw the planned schedule (its lowered programs, simulated: pipe.core.program_time) of a "
                                        "configuration, with its bubble and micro-batches in flight.")
    p.add_argument("--schedule", choices=SCHEDULE_KINDS, default="gpipe", help="schedule kind (default: gpipe)")
    p.add_argument("--table", metavar="CSV", default=None,
                   help="draw a schedule of your own: a CSV table, one row of actions per rank (docs/schedules.md); "
                        "its ranks, stages and micro-batches replace --schedule, --ranks and --microbatches")
    p.add_argument("--ranks", type=_positive_int, default=4, help="pipeline ranks, one row each (default: 4)")
    p.add_argument("--stages", type=_positive_int, dest="stages", default=None,
                   help=argparse.SUPPRESS)  # the old name of --ranks, one release
    p.add_argument("--microbatches", type=_positive_int, default=8, help="micro-batches (default: 8)")
    p.add_argument("--virtual-stages", type=_positive_int, default=1,
                   help="model chunks per rank, for --schedule interleaved or looped-bfs (default: 1)")
    p.add_argument("--checkpoint", choices=CHECKPOINT_MODES, default="never",
                   help="checkpoint mode: checkpointed micro-batches recompute before backward (default: never)")
    p.add_argument("--forward", type=_positive_float, default=1.0, help="forward time of a stage (default: 1)")
    p.add_argument("--backward", type=_positive_float, default=2.0, help="backward time of a stage (default: 2)")
    p.add_argument("--recompute", type=_positive_float, default=None,
                   help="recompute time of a stage (default: the forward time)")
    p.add_argument("--costs", metavar="JSON", default=None,
                   help="with --table: each stage's own costs, a JSON object of pipe.StageCosts.of's arguments "
                        "(forward, input_grad, weight_grad lists; transfer, overhead), e.g. "
                        "dataclasses.asdict(auto.costs); they replace --forward and --backward")
    p.add_argument("--transfer", type=_time, default=None,
                   help="time of each message between stages; given (or --fsdp), the plan is the ranks' lowered "
                        "programs, with sends, waits, gathers and reduces drawn as marks (default: free)")
    p.add_argument("--fsdp", choices=("zero2", "zero3"), default=None,
                   help="FSDP stages: gathered before use, reduced after their last backward, resharded after "
                        "their last action (zero2) or whenever the rank moves to another stage (zero3)")
    p.add_argument("--gather", type=_time, default=0.0, help="time to gather one FSDP stage (with --fsdp)")
    p.add_argument("--reduce", type=_time, default=0.0, help="time to reduce one FSDP stage's gradients (with --fsdp)")
    p.add_argument("-o", "--output", type=_output, help=f"output file ({', '.join(FORMATS)}); default: text to stdout")
    p.set_defaults(subparser=p)

    t = commands.add_parser("trace", help="draw a recorded trace (pipe.trace)",
                            description="Draw a trace recorded with pipe.trace.record() (several files: one per "
                                        "rank, merged onto one clock).")
    t.add_argument("traces", nargs="+", metavar="TRACE", help="trace JSON file(s)")
    t.add_argument("--step", type=int, default=None,
                   help="draw only this training step (0-based, -1 for the last); default: the whole trace")
    t.add_argument("--plan", action="store_true",
                   help="also draw the plan of the same configuration with the mean measured durations")
    t.add_argument("--explain", action="store_true",
                   help="also print where each stage's idle time went (pipe.viz.idle)")
    t.add_argument("-o", "--output", type=_output, help=f"output file ({', '.join(FORMATS)}); default: text to stdout")
    t.set_defaults(subparser=t)
    return parser


class _Unwritable(Exception):
    """The output file cannot be written (reported like a bad argument: exit status 2)."""


def _write(timelines: Sequence[Timeline], output: Optional[Path], title: str,
           trace: Optional[dict[str, Any]] = None) -> None:
    if output is None:
        sys.stdout.write(render_text(timelines))
        return
    suffix = output.suffix.lower()
    if suffix == ".svg":
        content = render_svg(timelines)
    elif suffix == ".html":
        content = render_html(timelines, title=title)
    elif suffix == ".txt":
        content = render_text(timelines)
    else:
        # A recording is written back as recorded (merged); a plan as trace events.
        content = json.dumps(trace if trace is not None else timelines[0].to_trace(), indent=None)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(content)
    except OSError as error:
        raise _Unwritable(
            f"cannot write {str(output)!r}: {error.strerror or error}; pass -o a path in a writable folder"
        ) from error
    sys.stderr.write(f"pipe-viz: wrote {output}\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command; returns the exit status (argument errors exit with 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    with _without_gc():
        return _run(args)


@contextlib.contextmanager
def _without_gc() -> Iterator[None]:
    """No cyclic garbage collection while drawing: a plan of millions of cells creates no reference
    cycles, and every collection would only scan them again (a fifth of the time of 2000 x 2000)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _run(args: argparse.Namespace) -> int:
    sub: argparse.ArgumentParser = args.subparser
    if args.command == "plan":
        if args.virtual_stages > 1 and args.schedule not in ("interleaved", "looped-bfs"):
            sub.error(f"--virtual-stages {args.virtual_stages} needs --schedule interleaved or looped-bfs "
                      f"(got --schedule {args.schedule})")
        if args.stages is not None:
            sys.stderr.write("pipe-viz plan: --stages is deprecated and will be removed in the next release; "
                             "use --ranks\n")
            args.ranks = args.stages
        if (args.gather or args.reduce) and args.fsdp is None:
            sub.error("--gather and --reduce time FSDP stages: add --fsdp zero2 or --fsdp zero3")
        if args.costs is not None and args.table is None:
            sub.error("--costs gives each stage of a table its own costs: add --table FILE.csv")
        if args.table is not None:
            return _plan_table(args)
        try:
            timeline = schedule_timeline(args.schedule, args.ranks, args.microbatches,
                                         virtual_stages=args.virtual_stages, checkpoint=args.checkpoint,
                                         forward=args.forward, backward=args.backward, recompute=args.recompute,
                                         communication=_communication(args))
        except ValueError as error:
            sub.error(str(error))
        try:
            _write([timeline], args.output, "pipe-viz plan")
        except _Unwritable as error:
            sub.error(str(error))
        return 0
    try:
        trace = load(args.traces[0]) if len(args.traces) == 1 else merge(args.traces)
        measured = from_trace(trace, args.step, source=repr(args.traces[0]) if len(args.traces) == 1 else "trace")
        timelines = [measured] + ([schedule_like(measured, trace)] if args.plan else [])
    except TraceError as error:
        sub.error(str(error))
    try:
        _write(timelines, args.output, f"pipe-viz trace {' '.join(args.traces)}", trace)
    except _Unwritable as error:
        sub.error(str(error))
    if args.explain:
        from pipe.viz.idle import explain_timeline

        kind = str(trace.get("otherData", {}).get("config", {}).get("schedule", "gpipe"))
        sys.stdout.write(explain_timeline(measured, kind).table() + "\n")
    return 0


def _communication(args: argparse.Namespace) -> Optional[Communication]:
    """The plan's communication costs, if any option asks for them."""
    if args.transfer is None and args.fsdp is None:
        return None
    return Communication(args.transfer or 0.0, args.gather, args.reduce,
                         None if args.fsdp is None else args.fsdp == "zero3")


def _costs(path: str) -> Any:
    """The ``StageCosts`` of a JSON file of ``StageCosts.of``'s arguments; ValueError naming what is wrong."""

    from pipe.core.stage_costs import StageCosts

    try:
        with open(path) as file:
            given = json.load(file)
    except OSError as error:
        raise ValueError(f"cannot read it: {error.strerror or error}") from error
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error.msg} at line {error.lineno})") from error
    if not isinstance(given, dict):
        raise ValueError(f"expected a JSON object of StageCosts.of's arguments, got {type(given).__name__}")
    try:
        return StageCosts.of(**given)
    except TypeError as error:
        raise ValueError(f"{error}; the keys are StageCosts.of's arguments: forward, input_grad, weight_grad, "
                         f"backward, transfer, activation, overhead") from error


def _plan_table(args: argparse.Namespace) -> int:
    from pipe.core.options import checkpoint_stop
    from pipe.core.schedule_table import TableSchedule
    from pipe.viz.planned import lay_out

    sub: argparse.ArgumentParser = args.subparser
    try:
        schedule = TableSchedule.from_csv(args.table)
    except OSError as error:
        sub.error(f"cannot read --table {args.table!r}: {error.strerror or error}")
    except ValueError as error:
        sub.error(f"--table {args.table!r}: {error}")
    stop = checkpoint_stop(args.checkpoint, schedule.microbatches)
    redo = args.forward if args.recompute is None else args.recompute
    try:
        timeline = lay_out(schedule, args.forward, args.backward, redo, stop, communication=_communication(args),
                           costs=_costs(args.costs) if args.costs else None)
    except ValueError as error:
        sub.error(f"--costs {args.costs!r}: {error}")
    timeline.title += f" · checkpoint={args.checkpoint} · bubble {timeline.bubble():.1%}"
    try:
        _write([timeline], args.output, "pipe-viz plan")
    except _Unwritable as error:
        sub.error(str(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())
