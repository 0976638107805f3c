"""Old names kept for one release (issue 23): each still works, warns, and names its replacement."""
from __future__ import annotations

import pytest



@pytest.mark.parametrize("module, old, new_module, new", [
    ("pipe.viz", "Cell", "pipe.viz.timeline", "Span"),
    ("pipe.viz.timeline", "Cell", "pipe.viz.timeline", "Span"),
    ("pipe.viz", "plan_like", "pipe.viz.measured", "schedule_like"),
    ("pipe.skip", "inspect_skip_layout", "pipe.skip.layout", "inspect_skip_layout"),
    ("pipe.skip", "SkipTracker", "pipe.skip.tracker", "SkipTracker"),
    ("pipe.skip", "Skippable", "pipe.skip.skippable", "Skippable"),
])
def test_an_old_name_is_the_new_object_with_a_warning(module: str, old: str, new_module: str, new: str) -> None:
    import importlib

    old_module = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{old} is deprecated .* use .*\.{new}"):
        value = getattr(old_module, old)
    assert value is getattr(importlib.import_module(new_module), new)


def test_an_unknown_name_of_an_old_module_is_an_attribute_error() -> None:
    import pipe.viz

    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        pipe.viz.nothing  # noqa: B018


def test_pre_release_shims_are_gone() -> None:
    """pipe.sequential, pipe.tied and pipe.viz.plan never shipped in a release (issue 51): no alias is left."""
    from pathlib import Path

    import pipe.viz

    package = Path(pipe.viz.__file__).resolve().parent.parent
    assert not (package / "sequential.py").exists() and not (package / "tied.py").exists()
    assert not hasattr(pipe.viz, "plan")


def test_pipe_viz_plan_stages_still_works_and_says_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    from pipe.viz.cli import main

    assert main(["plan", "--schedule", "1f1b", "--stages", "2", "--microbatches", "3"]) == 0
    captured = capsys.readouterr()
    assert "--stages is deprecated" in captured.err and "use --ranks" in captured.err
    main(["plan", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "3"])
    assert capsys.readouterr().out == captured.out


def test_selective_recompute_plans_is_decisions() -> None:
    from torch import nn

    from pipe.recompute.selective import SelectiveRecompute

    policy = SelectiveRecompute(nn.Linear(2, 2), names=["linear"])
    with pytest.warns(DeprecationWarning, match=r"use SelectiveRecompute.decisions\(\)"):
        assert policy.plans() == policy.decisions() == []
