"""Explanations: every idle interval gets a cause, and the causes add up to the idle time."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pipe import Pipe, trace
from pipe.plan import Candidate, Costs, explain, explain_prediction, predict
from pipe.trace import complete_event


def synthetic() -> dict[str, Any]:
    """Two stages, GPipe, two micro-batches (times in ms)::

        stage 0 | F0 F1 . . . . . . B1 B1 B0 B0 |    B1@0 starts 0.5 ms after B1@1 ended
        stage 1 | . . F0 F1 B1 B1 B0 B0 . . .   |    F0@1 starts 0.5 ms after F0@0 ended
    """
    spans = [("forward", 0, 0, 0.0, 1.0), ("forward", 1, 0, 1.0, 2.0),
             ("backward", 1, 0, 6.0, 8.0), ("backward", 0, 0, 8.0, 10.0),
             ("forward", 0, 1, 1.5, 2.5), ("forward", 1, 1, 2.5, 3.5),
             ("backward", 1, 1, 3.5, 5.5), ("backward", 0, 1, 5.5, 7.5)]
    events = [complete_event(kind, i, s, start * 1000, (end - start) * 1000, 0) for kind, i, s, start, end in spans]
    return {"traceEvents": events, "otherData": {"config": {"schedule": "gpipe"}}}


def test_idle_time_is_attributed_to_named_actions() -> None:
    explanation = explain(synthetic())
    assert explanation.wall == pytest.approx(10.0)
    for row in range(2):
        assert explanation.idle_by(row) == pytest.approx(4.0)  # 10 ms minus 6 ms of compute
        assert explanation.attributed(row) == pytest.approx(1.0)
    # Stage 1 waits 1 ms for F0@0 (the plan's own fill), then 0.5 ms with F0@0 done.
    assert explanation.idle_by(1, "bubble") == pytest.approx(1.0 + 2.5)  # fill + drain
    assert explanation.idle_by(1, "overhead") == pytest.approx(0.5)
    # Stage 0 waits 3.5 ms for B1@1; the plan with mean durations waits 3 ms there.
    assert explanation.idle_by(0, "bubble") == pytest.approx(3.0)
    assert explanation.idle_by(0, "wait") == pytest.approx(0.5)
    assert explanation.idle_by(0, "overhead") == pytest.approx(0.5)
    waits = [i for i in explanation.idle if i.row == 0 and i.category == "wait"]
    assert waits[0].waiting_for == "B1@1" and waits[0].waiting_on == "stage 1"
    text = explanation.table()
    assert "stage 0 idled 3 ms waiting for B1@1 from stage 1 [bubble]" in text
    assert "100.0%" in text


def test_a_predicted_plan_is_all_schedule_bubble() -> None:
    costs = Costs.from_table(8, [1e-3] * 4, [2e-3] * 4, [10] * 4, [4] * 4)
    prediction = predict(costs, Candidate("1f1b", 4, (1, 3), "always"))
    explanation = explain_prediction(prediction)
    for row, idle in enumerate(prediction.idle()):
        assert explanation.idle_by(row) == pytest.approx(idle * 1e3)
        assert explanation.idle_by(row, "bubble") == pytest.approx(idle * 1e3)
        assert explanation.attributed(row) == pytest.approx(1.0)


def test_a_recorded_pipe_step_is_fully_attributed() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    piped = Pipe(model, chunks=4, checkpoint="except_last", balance=[2, 3], devices=["cpu", "cpu"])
    with trace.record(schedule="gpipe", checkpoint="except_last") as recorder:
        for _ in range(2):
            piped(torch.randn(8, 8)).square().mean().backward()
    piped.close()
    explanation = explain(recorder.trace(), step=-1)
    assert len(explanation.rows) == 2
    for row in range(2):
        assert explanation.attributed(row) == pytest.approx(1.0)
    assert all(i.category in ("bubble", "wait", "overhead") and i.duration > 0 for i in explanation.idle)


def test_an_empty_timeline_is_refused() -> None:
    with pytest.raises(ValueError, match="no spans"):
        explain({"traceEvents": []})


def test_a_receive_is_waiting_until_the_sender_finished_then_transfer() -> None:
    # Rank 1 posts the receive for F0@1 at 0 ms; F0@0 ends at 2 ms on rank 0; the message lands at 2.5 ms.
    spans = [("forward", 0, 0, 0, 0.0, 2.0), ("recv", 0, 1, 1, 0.0, 2.5), ("forward", 0, 1, 1, 2.5, 3.5),
             ("backward", 0, 1, 1, 3.5, 5.5), ("recv", 0, 0, 0, 2.0, 5.8), ("backward", 0, 0, 0, 5.8, 7.0)]
    events = [complete_event(kind, i, s, start * 1000, (end - start) * 1000, pid)
              for kind, i, s, pid, start, end in spans]
    explanation = explain({"traceEvents": events, "otherData": {"config": {"schedule": "1f1b"}}})
    assert explanation.rows == ["rank 0", "rank 1"]
    assert explanation.transfer == [pytest.approx(0.3), pytest.approx(0.5)]
    waits: dict[tuple[int, str], float] = {}
    for i in explanation.idle:
        if i.waiting_for and i.category != "overhead":
            waits[(i.row, i.waiting_for)] = waits.get((i.row, i.waiting_for), 0.0) + i.duration
    assert waits[(1, "F0@0")] == pytest.approx(2.0) and waits[(0, "B0@1")] == pytest.approx(3.5)
    for row in range(2):
        assert explanation.attributed(row) == pytest.approx(1.0)


def test_a_zero_bubble_plan_is_explained_with_its_i_and_w() -> None:
    from pipe.plan import Candidate, Costs, explain_prediction, predict

    costs = Costs.from_table(8, [1e-3] * 4, [2e-3] * 4, [10] * 4, [4] * 4)
    explained = {}
    for candidate in (Candidate("zb-h1", 4, (2, 2), "never"), Candidate("zbv", 4, (1, 1, 1, 1), "always", 2)):
        explanation = explained[candidate.schedule] = explain_prediction(predict(costs, candidate, runner="processes"))
        assert all(i.category == "bubble" for i in explanation.idle), explanation.table()
    # ZB-H1's first rank waits for the input gradient of the second (an I, not a B); ZB-V's V idles less.
    assert "waiting for I0@1 from rank 1" in explained["zb-h1"].table()
    assert sum(i.end - i.start for i in explained["zbv"].idle) < sum(i.end - i.start for i in explained["zb-h1"].idle)
