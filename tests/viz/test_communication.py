"""Plans drawn from the ranks' lowered programs: sends, waits, FSDP gathers and reduces beside compute."""
from __future__ import annotations

from pathlib import Path
from xml.etree import ElementTree

import pytest

from pipe.viz.cli import main
from pipe.viz.planned import Communication, schedule_timeline
from pipe.viz.timeline import COMPUTE

KINDS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("looped-bfs", 2), ("zb-h1", 1), ("zbv", 1)]


@pytest.mark.parametrize("kind,virtual", KINDS)
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_free_communication_draws_the_schedules_own_plan(kind: str, virtual: int, checkpoint: str) -> None:
    """The lowered programs, timed with nothing to communicate, place every compute cell where the schedule does."""
    plain = schedule_timeline(kind, 3, 6, virtual_stages=virtual, checkpoint=checkpoint)
    lowered = schedule_timeline(kind, 3, 6, virtual_stages=virtual, checkpoint=checkpoint,
                                communication=Communication())
    key = lambda c: (c.row, c.start, c.kind, c.microbatch, c.stage)  # noqa: E731
    assert sorted(map(key, (c for c in lowered.cells if c.kind in COMPUTE))) == sorted(map(key, plain.cells))
    assert lowered.bubble() == pytest.approx(plain.bubble())


def test_messages_gathers_and_reduces_appear_and_cost_time() -> None:
    free = schedule_timeline("1f1b", 3, 4, communication=Communication())
    sent = schedule_timeline("1f1b", 3, 4, communication=Communication(transfer=0.5))
    assert sent.makespan > free.makespan
    kinds = {c.kind for c in sent.cells}
    assert {"send", "recv"} <= kinds and not {"gather", "reduce"} & kinds
    zero3 = schedule_timeline("interleaved", 2, 4, virtual_stages=2,
                              communication=Communication(gather=0.5, reduce=0.5, zero3=True))
    zero2 = schedule_timeline("interleaved", 2, 4, virtual_stages=2,
                              communication=Communication(gather=0.5, reduce=0.5, zero3=False))
    gathers = lambda t: sum(1 for c in t.cells if c.kind == "gather")  # noqa: E731
    assert gathers(zero3) > gathers(zero2) >= 4  # ZeRO-2: each of 4 stages once (and the waits for some)
    assert sum(1 for c in zero2.cells if c.kind == "reduce") == 4
    assert "gather 0.5 and reduce 0.5 per stage" in " ".join(zero3.notes)


def test_communication_refuses_what_it_cannot_time() -> None:
    with pytest.raises(ValueError, match="transfer must be a finite number >= 0.*-1"):
        Communication(transfer=-1)
    with pytest.raises(ValueError, match="need FSDP stages: pass zero3=True"):
        Communication(gather=1.0)


def test_pipe_viz_plan_draws_communication_marks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.svg"
    assert main(["plan", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--transfer", "0.5",
                 "--fsdp", "zero3", "--gather", "1", "--reduce", "1", "-o", str(out)]) == 0
    rects = ElementTree.fromstring(out.read_text()).iter("{http://www.w3.org/2000/svg}rect")
    tips = [(r.get("height"), r.findtext("{http://www.w3.org/2000/svg}title") or "") for r in rects]
    marks = [height for height, tip in tips if tip.startswith(("gather", "reduce", "send", "recv"))]
    assert marks and set(marks) == {"8"}  # thin marks along the row's foot, compute stays full height
    assert any(tip.startswith("forward") and height == "30" for height, tip in tips)
    assert main(["plan", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--transfer", "0.5"]) == 0
    assert "S send" in capsys.readouterr().out


def test_pipe_viz_plan_refuses_gathers_without_fsdp(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--gather", "1"])
    assert exit_info.value.code == 2
    assert "--gather and --reduce time FSDP stages: add --fsdp zero2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--transfer", "-1"])
    assert "expected a finite time >= 0, got '-1'" in capsys.readouterr().err
