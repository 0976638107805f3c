"""The watchdog ends a rank that the others blamed as stalled, or whose wait outlived its timeout; nothing else.

In-process, on a ``HashStore`` standing in for the job's store, with a watchdog of the test's own whose
``end`` records the reason instead of ending the process. The end-to-end cases (real processes, the store
outside them, every process's exit time and status) are in ``test_fault_matrix.py``.
"""
from __future__ import annotations

import threading
import time
from typing import Iterator

import pytest
import torch.distributed as dist

from pipe.distributed import failure, watchdog

WAIT = 5.0  # seconds a test waits for the watchdog to act (it looks every 0.01 s here)
Ended = tuple[list[str], threading.Event, dist.Store]


@pytest.fixture
def ended(monkeypatch: pytest.MonkeyPatch) -> Iterator[Ended]:
    """The reasons the test's watchdog would have ended the process for, an event set at the first, the store."""
    reasons: list[str] = []
    event = threading.Event()

    def end(reason: str) -> None:
        reasons.append(reason)
        event.set()

    dog = watchdog.Watchdog(end=end, interval=0.01)
    store = dist.HashStore()
    monkeypatch.setattr(watchdog, "_watchdog", dog)  # the Failures built below register with it
    monkeypatch.setattr(watchdog, "_REPORTS", 0.1)
    monkeypatch.setattr(watchdog, "_LOG_PAUSE", 0.0)
    monkeypatch.setattr(failure, "_store", lambda: store)
    yield reasons, event, store
    dog.stop()


def _root(store: dist.Store, failures: failure.Failures, step: int, headline: str) -> None:
    store.set(f"pipe/{failures.instance}/{step}/root", headline)


def test_a_rank_the_others_agreed_stalled_is_ended_naming_the_headline(ended: Ended) -> None:
    reasons, event, store = ended
    failures = failure.Failures(rank=2, world=4, timeout=4.0)
    failures.begin_step()
    headline = "rank 2 stalled: it did not answer within the 4 s timeout (seen by rank 1 in B1@0)"
    _root(store, failures, failures.step, headline)
    assert event.wait(WAIT), "the watchdog did not act"
    assert reasons[0] == ("rank 2 ended itself (exit status 75): the other ranks gave up on it and agreed that "
                          f"{headline}")


def test_between_steps_the_next_steps_headline_is_read(ended: Ended) -> None:
    # The rank finished step 1 and stalls before step 2; the others began step 2 and blamed it there.
    reasons, event, store = ended
    failures = failure.Failures(rank=2, world=4, timeout=4.0)
    failures.begin_step()
    failures.end_step()
    _root(store, failures, failures.step + 1, "rank 2 stalled: it did not answer within the 4 s timeout")
    assert event.wait(WAIT), "the watchdog did not act"
    assert "agreed that rank 2 stalled" in reasons[0]


@pytest.mark.parametrize("headline", ["rank 1 stalled: it did not answer within the 4 s timeout",
                                      "rank 2 failed in F0@1: ValueError: boom",
                                      "rank 2 died: its process ended without raising an error"])
def test_a_headline_that_does_not_blame_this_rank_as_stalled_ends_nothing(ended: Ended, headline: str) -> None:
    reasons, event, store = ended
    failures = failure.Failures(rank=2, world=4, timeout=4.0)
    failures.begin_step()
    _root(store, failures, failures.step, headline)
    _root(store, failures, failures.step + 1, headline)
    assert not event.wait(0.3), reasons
    assert failures.blamed_for_stall() is None


def test_a_rank_that_met_the_failure_itself_is_left_to_raise_it(ended: Ended) -> None:
    # Its stall ended and its step is raising (failure_from): the watchdog must not cut that short.
    reasons, event, store = ended
    failures = failure.Failures(rank=2, world=4, timeout=4.0)
    failures.begin_step()
    failures.reporting = True
    _root(store, failures, failures.step, "rank 2 stalled: it did not answer within the 4 s timeout")
    assert not event.wait(0.3), reasons


def test_a_wait_past_its_timeout_and_the_slack_is_ended(ended: Ended, monkeypatch: pytest.MonkeyPatch) -> None:
    reasons, event, _ = ended
    monkeypatch.setattr(watchdog, "WAIT_SLACK", 0.05)
    dog = watchdog._watchdog
    dog.start()
    with watchdog.waiting("receiving act main 0->1 of micro-batch 0 from rank 0", 0.05):
        assert event.wait(WAIT), "the watchdog did not act"
    assert "its wait (receiving act main 0->1 of micro-batch 0 from rank 0) has run" in reasons[0]
    assert "past its 0.05 s timeout" in reasons[0]


def test_a_wait_within_its_timeout_and_long_compute_end_nothing(ended: Ended) -> None:
    reasons, event, _ = ended
    failures = failure.Failures(rank=2, world=4, timeout=0.05)
    failures.begin_step()  # a step runs, computes far past the timeout, and waits within it: healthy
    with watchdog.waiting("receiving act main 0->1 of micro-batch 0 from rank 0", 60.0):
        time.sleep(0.3)
    assert not event.wait(0.1), reasons
    assert not watchdog._watchdog.waits  # the mark is gone with the wait


def test_the_thread_is_a_daemon_and_stops(ended: Ended) -> None:
    failure.Failures(rank=0, world=2, timeout=4.0)
    dog = watchdog._watchdog
    thread = dog._thread
    assert thread is not None and thread.daemon and thread.is_alive()
    dog.stop()
    assert not thread.is_alive()


def test_a_store_gone_with_its_host_is_read_once_and_no_more(ended: Ended, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every read of a dead TCPStore prints torch's warning with a C++ stack: the watchdog stops at the first.
    reasons, event, _ = ended
    reads = []

    class Gone:
        def check(self, keys: list[str]) -> bool:
            reads.append(keys)
            raise RuntimeError("Broken pipe")

    monkeypatch.setattr(failure, "_store", lambda: Gone())
    dog, looks, looked = watchdog._watchdog, [], threading.Event()
    real = dog.reason

    def reason() -> object:  # counts the watchdog's looks (a thread's pace is not the test's to time)
        looks.append(1)
        if len(looks) >= 30:
            looked.set()
        return real()

    monkeypatch.setattr(dog, "reason", reason)
    failures = failure.Failures(rank=2, world=4, timeout=4.0)
    failures.begin_step()
    assert looked.wait(WAIT), f"the watchdog looked {len(looks)} times"  # some 30 looks
    assert len(reads) == 1 and not reasons
    assert not watchdog._watchdog.pipelines
