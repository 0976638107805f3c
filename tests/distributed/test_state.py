"""Stage-agnostic checkpoints: saved with 2 stages, resumed with 4 stages and into the plain module, same losses."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_models import WIDTH
from pipe.distributed import DistributedPipe, state
from spawn_ranks import run_ranks


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(8)])


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, WIDTH, generator=generator), torch.randn(8, WIDTH, generator=generator)


def _train(pipe: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = _data(step)
        if isinstance(pipe, DistributedPipe):
            loss = pipe.step(x, y, F.mse_loss, broadcast_loss=True)
        else:
            loss = F.mse_loss(pipe(x), y)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _save_and_resume(rank: int, world: int, path: str) -> tuple[list[float], list[float]]:
    # 2 stages (one per rank): 2 steps, save, 2 more steps = the reference curve.
    pipe = DistributedPipe(_model(0), chunks=2, schedule="1f1b")
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.01)
    _train(pipe, optimizer, range(2))
    state.save(path, pipe, optimizer, step=2)
    reference = _train(pipe, optimizer, range(2, 4))
    # 4 stages (two per rank, interleaved), from other initial weights: load, then the same 2 steps.
    resumed = DistributedPipe(_model(1), chunks=2, schedule="interleaved", virtual_stages=2, balance=[1, 3, 3, 1])
    optimizer = torch.optim.Adam(resumed.parameters(), lr=0.01)
    extra = state.load(path, resumed, optimizer)
    assert extra == {"step": 2}, extra
    return reference, _train(resumed, optimizer, range(2, 4))


def test_resume_with_another_stage_count_and_into_the_plain_module(tmp_path: Path) -> None:
    path = str(tmp_path / "checkpoint")
    (reference, resumed), again = run_ranks(_save_and_resume, 2, path)
    assert again == (reference, resumed)
    assert resumed == reference  # 4 stages continue exactly where 2 stages stopped
    # The plain module, in this process (no process group), continues the same curve.
    plain = _model(2)
    optimizer = torch.optim.Adam(plain.parameters(), lr=0.01)
    assert state.load_module(path, plain, optimizer) == {"step": 2}
    torch.testing.assert_close(_train(plain, optimizer, range(2, 4)), reference)


def _dies_during_second_save(rank: int, world: int, folder: str) -> str:
    import os

    import torch.distributed.checkpoint as dcp

    pipe = DistributedPipe(_model(0), chunks=2)
    state.save(Path(folder) / "ckpt", pipe, step=1)
    if rank == 1:
        def die(*args: object, **kwargs: object) -> None:
            os._exit(3)  # the process ends half-way through its part of the save

        dcp.FileSystemWriter.write_data = die  # type: ignore[method-assign]
    try:
        state.save(Path(folder) / "fresh", pipe, step=2)
    except Exception as error:  # rank 0: its peer vanished during the save
        return f"{type(error).__name__}"
    return "saved"


def test_a_rank_dying_during_save_leaves_no_checkpoint_that_loads_half(tmp_path: Path) -> None:
    results = run_ranks(_dies_during_second_save, 2, str(tmp_path), barrier=False, expect_missing=(1,))
    assert results[1] is None and results[0] != "saved", results
    plain = _model(1)
    # The complete checkpoint loads; the interrupted one is not published, and load says why.
    assert state.load_module(tmp_path / "ckpt", plain) == {"step": 1}
    assert not (tmp_path / "fresh").exists() and (tmp_path / ("fresh" + state.STAGING)).is_dir()
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at '.*fresh': a save into it did not finish "
                                                r"\(a rank failed during state.save; its partial files are in"):
        state.load_module(tmp_path / "fresh", plain)


def test_an_interrupted_save_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    model = _model(0)
    state.save(tmp_path / "ckpt", model, step=1)

    def fails(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", fails)
    with pytest.raises(CheckpointException, match="disk full"):  # DCP gathers the ranks' errors into one
        state.save(tmp_path / "ckpt", model, step=2)
    monkeypatch.undo()
    assert state.load_module(tmp_path / "ckpt", _model(1)) == {"step": 1}  # the previous one, whole
    state.save(tmp_path / "ckpt", model, step=3)  # a later save replaces it and clears the leftovers
    assert state.load_module(tmp_path / "ckpt", _model(1)) == {"step": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"'.*empty' is not a complete checkpoint: it has no .metadata"):
        state.load_module(tmp_path / "empty", _model(1))


def test_extra_values_come_back_as_given_nested_dicts_nested(tmp_path: Path) -> None:
    model = _model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / 3)
    optimizer.step()
    schedule.step()
    state.save(tmp_path / "ckpt", model, optimizer, step=1, schedule=schedule.state_dict(), **{"dotted.key": "a.b"})
    other = _model(1)
    extra = state.load_module(tmp_path / "ckpt", other, torch.optim.AdamW(other.parameters()))
    assert extra == {"step": 1, "schedule": schedule.state_dict(), "dotted.key": "a.b"}


def _step_folders(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir())


def test_latest_is_the_complete_step_checkpoint_of_the_highest_step(tmp_path: Path) -> None:
    model = _model(0)
    assert state.latest(tmp_path / "none yet") is None and state.latest(tmp_path) is None
    for step in (4, 10, 2):
        state.save(state.step_path(tmp_path, step), model, step=step)
    assert state.step_path(tmp_path, 10) == tmp_path / "step-00000010"
    assert state.latest(tmp_path) == tmp_path / "step-00000010"
    # Not complete, or not a step checkpoint: passed over.
    (tmp_path / "step-00000012.saving").mkdir()  # a save a failed rank interrupted
    (tmp_path / "step-00000012.saving" / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "step-00000011").mkdir()  # no .metadata
    (tmp_path / "step-00000013").write_text("a file")
    state.save(tmp_path / "final", model, step=99)  # complete, but not named as a step
    assert state.latest(tmp_path) == tmp_path / "step-00000010"
    assert not state.is_complete(tmp_path / "step-00000011") and state.is_complete(tmp_path / "step-00000010")
    # The number orders, not the text: an unpadded name of a higher step is newer.
    state.save(tmp_path / "step-20", model, step=20)
    assert state.latest(tmp_path) == tmp_path / "step-20"
    assert state.load_module(state.latest(tmp_path), _model(1)) == {"step": 20}
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match=rf"step_path: step={bad!r}; give the number of optimizer steps"):
            state.step_path(tmp_path, bad)  # type: ignore[arg-type]


def test_prune_keeps_the_newest_complete_checkpoints_and_never_a_save_in_progress(tmp_path: Path) -> None:
    model = _model(0)
    for step in range(1, 6):
        state.save(state.step_path(tmp_path, step), model, step=step)
    (tmp_path / "step-00000006.saving").mkdir()  # being written (or interrupted): not complete
    (tmp_path / "step-00000007").mkdir()  # not complete either
    (tmp_path / "step-00000000.pruning").mkdir()  # left by a prune that died while deleting
    deleted = state.prune(tmp_path, keep=2)
    assert deleted == [state.step_path(tmp_path, step) for step in (1, 2, 3)]
    assert _step_folders(tmp_path) == ["step-00000004", "step-00000005", "step-00000006.saving", "step-00000007"]
    assert state.prune(tmp_path, keep=2) == [] and state.prune(tmp_path, keep=1) == [tmp_path / "step-00000004"]
    assert state.latest(tmp_path) == tmp_path / "step-00000005"  # the newest complete one always stays
    assert state.load_module(state.latest(tmp_path), _model(1)) == {"step": 5}
    assert state.prune(tmp_path / "none yet", keep=3) == []
    for bad in (0, -2, True, 2.0):
        with pytest.raises(ValueError, match=rf"prune: keep={bad!r}; keep at least 1 checkpoint"):
            state.prune(tmp_path, keep=bad)  # type: ignore[arg-type]


def _asynchronous(rank: int, world: int, directory: str) -> list[str]:
    pipe = DistributedPipe(_model(0), chunks=2, schedule="1f1b")
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.01)
    _train(pipe, optimizer, range(2))
    at_save = {name: p.detach().clone() for name, p in pipe.named_parameters()}
    first, second = state.step_path(directory, 2), state.step_path(directory, 4)
    state.save(first, pipe, optimizer, asynchronous=True, step=2)
    reference = _train(pipe, optimizer, range(2, 4))  # training goes on (and changes the weights) while it writes
    assert not state.is_complete(first) and state.latest(directory) is None  # published by wait() only
    state.save(second, pipe, optimizer, asynchronous=True, step=4)  # finishes the first, then starts
    assert state.latest(directory) == first and not state.is_complete(second)
    assert state.prune(directory, keep=1) == []  # the one in flight is no checkpoint yet: nothing to prune
    assert state.wait() == second and state.wait() is None
    assert state.latest(directory) == second
    # The first holds the weights at its call, not those training wrote while it was written: a resume continues
    # exactly where the reference did.
    resumed = DistributedPipe(_model(1), chunks=2, schedule="1f1b")
    resumed_optimizer = torch.optim.Adam(resumed.parameters(), lr=0.01)
    assert state.load(first, resumed, resumed_optimizer) == {"step": 2}
    for name, p in resumed.named_parameters():
        torch.testing.assert_close(p.detach(), at_save[name], rtol=0, atol=0)
    again = _train(resumed, resumed_optimizer, range(2, 4))
    assert state.prune(directory, keep=1) == [first]
    # load() finishes a save in flight first.
    third = state.step_path(directory, 5)
    state.save(third, pipe, optimizer, asynchronous=True, step=5)
    assert state.load(second, DistributedPipe(_model(1), chunks=2, schedule="1f1b")) == {"step": 4}
    assert state.is_complete(third)
    # A write that fails on rank 1: every rank raises naming it, nothing is published, the newest checkpoint stays.
    if rank == 1:
        def refuse(*args: object, **kwargs: object) -> None:
            raise OSError("disk full (injected)")
        state.dcp.FileSystemWriter.write_data = refuse  # type: ignore[method-assign]
    failed = state.step_path(directory, 6)
    state.save(failed, pipe, optimizer, asynchronous=True, step=6)
    with pytest.raises(RuntimeError, match=r"save to .*step-00000006.* failed on rank\(s\) \[1\]: rank 1: OSError: "
                                           r"disk full \(injected\)"):
        state.wait()
    assert state.latest(directory) == third and not state.is_complete(failed)
    return [str(reference), str(again)]


def test_asynchronous_save_is_published_once_written_and_holds_the_state_at_its_call(tmp_path: Path) -> None:
    results = run_ranks(_asynchronous, 2, str(tmp_path / "checkpoints"))
    reference, resumed = results[0]
    assert resumed == reference and results[1] == results[0]
