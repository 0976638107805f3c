"""Helpers shared by the tests."""
from __future__ import annotations

import pytest


def without_lowering_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lower schedules afresh for the rest of the test (:mod:`pipe.core.program_time` caches lowered programs
    per schedule): a test that patches what a schedule's actions are must neither time programs lowered
    before the patch nor leave its own in the cache."""
    import pipe.core.program_time as program_time

    monkeypatch.setattr(program_time, "_lowered", program_time._lowered.__wrapped__)
