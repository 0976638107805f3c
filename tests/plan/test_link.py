"""The transport's cost per message and per byte: fitted, cached per machine, measured on two gloo processes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipe.plan.link import fit_line, cache_path, cached_link, link_key, measure_link
from pipe.plan.timing import Link


def test_the_line_through_round_trips_is_latency_plus_bytes() -> None:
    latency, per_byte = fit_line({1000: 1e-4 + 1000e-9, 10**6: 1e-4 + 1e-3})
    assert latency == pytest.approx(1e-4) and per_byte == pytest.approx(1e-9)


def test_the_cache_is_keyed_by_machine_and_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPE_CACHE_DIR", str(tmp_path))
    assert cache_path() == tmp_path / "link.json"
    assert cached_link(measure=False) is None  # nothing measured here yet
    cache_path().write_text(json.dumps({"another machine": {"latency": 1.0, "per_byte": 1.0, "when": "x"},
                                        link_key(): {"latency": 5e-5, "per_byte": 2e-10, "when": "today"}}))
    link = cached_link(measure=False)
    assert link is not None and link.latency == 5e-5 and link.per_byte == 2e-10 and "cached today" in link.source


def test_measuring_two_processes_gives_a_positive_cost() -> None:
    link = measure_link(sizes=(1024, 1 << 18), repeats=2, timeout=120)
    # Two sizes, two rounds on a loaded machine: only the shape of the answer is certain.
    assert link.latency >= 0 and link.per_byte >= 0
    assert link.cost(1 << 20) >= link.cost(1024) > 0
    assert link.reduce_latency + link.reduce_per_byte > 0  # the all-reduce was measured too
    assert link.all_reduce(1 << 20, 2) == pytest.approx(link.reduce_latency + (1 << 20) * link.reduce_per_byte)


def test_an_all_reduce_is_a_ring_of_the_measured_pair_or_of_messages() -> None:
    measured = Link(1e-4, 1e-9, reduce_latency=2e-4, reduce_per_byte=3e-9)
    # 2 ranks: the measured all-reduce itself; 4 ranks: 6 ring steps of a quarter of the buffer each.
    assert measured.all_reduce(10**6, 2) == pytest.approx(2e-4 + 3e-3)
    assert measured.all_reduce(10**6, 4) == pytest.approx(6 * 1e-4 + 6 / 4 * 3e-3)
    assert measured.all_reduce(10**6, 1) == 0.0
    # Not measured (a given link, or one cached before): 2 (R - 1) messages of the buffer / R.
    assert Link(1e-4, 1e-9).all_reduce(10**6, 4) == pytest.approx(6 * (1e-4 + 250_000e-9))


def test_the_thread_runners_overhead_is_measured_once_and_planned_with(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipe's plans charge each action the thread runner's measured overhead: without it, the planner
    benchmark's MLP ran 19-33% slower than predicted (median; python benchmarks/planner.py threads)."""
    import torch
    from torch import nn

    from pipe.plan import plan
    from pipe.plan.link import cached_thread_overhead

    monkeypatch.setenv("PIPE_CACHE_DIR", str(tmp_path))
    assert cached_thread_overhead(measure=False) is None  # nothing measured here yet
    measured = cached_thread_overhead()
    assert measured is not None and 0 < measured < 1.0  # seconds per action
    assert cached_thread_overhead(measure=False) == measured  # cached, as the link is
    assert link_key("threads") in json.loads(cache_path().read_text())

    # A plan with a known overhead: 10 ms per action, on the cache.
    cache_path().write_text(json.dumps({link_key("threads"): {"action_overhead": 0.01, "when": "today"}}))
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    options = dict(memory_budget="1GiB", stages=2, chunks=[1], checkpoints=["never"])
    charged = plan(model, torch.randn(4, 8), link="cached", **options)
    free = plan(model, torch.randn(4, 8), link=None, **options)
    assert charged.model.action_overhead == 0.01 and free.model.action_overhead == 0.0
    # GPipe, 1 micro-batch, 2 stages: F, F, B, B on the critical path, 10 ms each more.
    assert charged.best.step_time - free.best.step_time == pytest.approx(0.04, rel=0.25)
