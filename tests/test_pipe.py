"""Pipe against the plain module (the oracle), and every check of its front end."""
import copy
import threading

import pytest
import torch
from torch import nn

from helpers import assert_same_grads
from pipe import Pipe


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 8), nn.GELU(), nn.Linear(8, 3)
    )


def run_both(model: nn.Sequential, pipe_kwargs: dict, x: torch.Tensor):
    plain = copy.deepcopy(model)
    piped = Pipe(copy.deepcopy(model), **pipe_kwargs)
    x1 = x.clone().requires_grad_()
    x2 = x.clone().requires_grad_()
    y1 = plain(x1)
    y2 = piped(x2)
    (y1 ** 2).sum().backward()
    (y2 ** 2).sum().backward()
    return plain, piped, (x1, y1), (x2, y2)


BALANCES = [[7], [3, 4], [1, 5, 1], [2, 2, 2, 1]]


@pytest.mark.filterwarnings("ignore:.*compete for them")  # 3-4 CPU partitions on a 2-core machine
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 2, 3, 8])
@pytest.mark.parametrize("balance", BALANCES, ids=str)
def test_matches_plain_module(checkpoint, chunks, balance):
    x = torch.randn(10, 6)
    plain, piped, (x1, y1), (x2, y2) = run_both(
        make_model(), dict(chunks=chunks, checkpoint=checkpoint, balance=balance, devices=["cpu"] * len(balance)), x
    )
    torch.testing.assert_close(y2, y1)
    torch.testing.assert_close(x2.grad, x1.grad)
    assert_same_grads(piped, plain)
    piped.close()


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_chunks_one_is_bit_identical(checkpoint):
    x = torch.randn(9, 6)
    plain, piped, (x1, y1), (x2, y2) = run_both(make_model(), dict(chunks=1, checkpoint=checkpoint, balance=[3, 4], devices=["cpu", "cpu"]), x)
    assert torch.equal(y1, y2)
    assert torch.equal(x1.grad, x2.grad)
    assert_same_grads(piped, plain, atol=0, rtol=0)


def test_several_inputs_and_non_tensors_reach_every_microbatch():
    seen_flags = []

    class First(nn.Module):
        def forward(self, inputs):
            x, mask, scale, flag = inputs
            seen_flags.append((scale, flag))
            return (x * mask * scale, mask)

    class Second(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, inputs):
            x, mask = inputs
            return (self.linear(x), mask.sum(dim=1, keepdim=True))

    torch.manual_seed(0)
    model = nn.Sequential(First(), Second())
    x = torch.randn(6, 4)
    mask = (torch.rand(6, 4) > 0.5).float()
    expected = copy.deepcopy(model)((x, mask, 2.0, None))
    seen_flags.clear()
    piped = Pipe(model, chunks=3, balance=[1, 1], devices=["cpu", "cpu"])
    out = piped(x, mask, 2.0, None)
    assert isinstance(out, tuple) and len(out) == 2
    torch.testing.assert_close(out[0], expected[0])
    torch.testing.assert_close(out[1], expected[1])
    assert seen_flags == [(2.0, None)] * 3


def test_integer_inputs_embedding():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 20))
    tokens = torch.randint(0, 20, (8, 5))
    plain = copy.deepcopy(model)
    piped = Pipe(model, chunks=4, checkpoint="always", balance=[2, 2], devices=["cpu", "cpu"])
    plain(tokens).logsumexp(-1).sum().backward()
    piped(tokens).logsumexp(-1).sum().backward()
    assert_same_grads(piped, plain)


def test_state_dict_keys_are_the_plain_modules():
    model = make_model()
    keys = list(model.state_dict().keys())
    piped = Pipe(model, chunks=2, balance=[3, 4], devices=["cpu", "cpu"])
    assert list(piped.state_dict().keys()) == keys
    # A plain checkpoint loads straight into the Pipe and back.
    piped.load_state_dict(make_model(seed=1).state_dict())
    make_model().load_state_dict(piped.state_dict())


def test_sequence_interface_and_attributes():
    model = make_model()
    layers = list(model)
    piped = Pipe(model, chunks=4, checkpoint="never", balance=[3, 4], devices=["cpu", "cpu"])
    assert len(piped) == 7
    assert list(piped) == layers
    assert piped[0] is layers[0] and piped[-1] is layers[-1]
    assert list(piped[1:3]) == layers[1:3]
    assert piped.balance == [3, 4]
    assert piped.devices == [torch.device("cpu")] * 2
    assert piped.chunks == 4 and piped.checkpoint == "never"
    assert [list(p) for p in piped.partitions] == [layers[:3], layers[3:]]


def test_balance_follows_placement_without_balance():
    piped = Pipe(make_model(), chunks=2)
    assert piped.balance == [7]
    assert piped.devices == [torch.device("cpu")]


# -- R1: every error with its wording ----------------------------------------------------


def test_rejects_non_sequential():
    with pytest.raises(TypeError, match=r"Pipe takes an nn.Sequential, got Linear"):
        Pipe(nn.Linear(2, 2))


@pytest.mark.parametrize("chunks", [0, -1])
def test_rejects_non_positive_chunks(chunks):
    with pytest.raises(ValueError, match=rf"chunks must be a positive int, got {chunks}"):
        Pipe(make_model(), chunks=chunks)


def test_rejects_non_int_chunks():
    with pytest.raises(TypeError, match=r"chunks must be an int .* got 2.5"):
        Pipe(make_model(), chunks=2.5)


def test_rejects_unknown_checkpoint():
    with pytest.raises(ValueError, match=r"checkpoint must be one of 'always', 'except_last', 'never', got 'sometimes'"):
        Pipe(make_model(), checkpoint="sometimes")


def test_rejects_balance_not_summing_to_layers():
    with pytest.raises(ValueError, match=r"balance \[3, 3\] covers 6 layers but the module has 7.*balance_by_time"):
        Pipe(make_model(), balance=[3, 3], devices=["cpu", "cpu"])


def test_rejects_empty_partition():
    with pytest.raises(ValueError, match=r"balance \[0, 7\] has a partition with fewer than 1 layer"):
        Pipe(make_model(), balance=[0, 7], devices=["cpu", "cpu"])


def test_rejects_non_int_balance():
    with pytest.raises(TypeError, match=r"balance must be a list of ints"):
        Pipe(make_model(), balance=[3.5, 3.5], devices=["cpu", "cpu"])


def test_rejects_too_few_devices():
    with pytest.raises(IndexError, match=r"balance \[3, 4\] has 2 partitions but only 1 devices \['cpu'\]"):
        Pipe(make_model(), balance=[3, 4], devices=["cpu"])


def test_rejects_devices_without_balance():
    with pytest.raises(ValueError, match=r"devices=.* was given without balance"):
        Pipe(make_model(), devices=["cpu"])


def test_rejects_duplicate_layer():
    layer = nn.Linear(2, 2)
    model = nn.Sequential()
    model.add_module("a", layer)
    model.add_module("b", layer)
    with pytest.raises(ValueError, match=r"layers 'a' and 'b' are the same module object"):
        Pipe(model)


def test_shared_parameters_within_one_partition_are_fine():
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    Pipe(nn.Sequential(first, second, nn.ReLU()), balance=[2, 1], devices=["cpu", "cpu"])


def test_warns_when_batch_smaller_than_chunks():
    piped = Pipe(make_model(), chunks=8, balance=[3, 4], devices=["cpu", "cpu"])
    with pytest.warns(UserWarning, match=r"batch size 3 is smaller than chunks=8"):
        out = piped(torch.randn(3, 6))
    assert out.shape == (3, 3)


def test_rejects_input_on_wrong_device():
    piped = Pipe(make_model(), chunks=2)
    with pytest.raises(ValueError, match=r"input is on meta but the first partition is on cpu"):
        piped(torch.empty(4, 6, device="meta"))


def test_rejects_mismatched_batch_sizes():
    piped = Pipe(nn.Sequential(nn.Identity()), chunks=2)
    with pytest.raises(ValueError, match=r"different batch sizes \[4, 5\]"):
        piped(torch.randn(4, 2), torch.randn(5, 2))


def test_rejects_input_without_tensor():
    piped = Pipe(nn.Sequential(nn.Identity()), chunks=2)
    with pytest.raises(TypeError, match=r"Pipe input contains no tensor"):
        piped(3)


@pytest.mark.parametrize("move", ["to_cpu", "cuda", "cpu", "to_tensor"])
def test_moving_is_refused(move):
    piped = Pipe(make_model(), chunks=2)
    with pytest.raises(TypeError, match=r"a Pipe cannot be moved"):
        if move == "to_cpu":
            piped.to("cpu")
        elif move == "cuda":
            piped.cuda()
        elif move == "cpu":
            piped.cpu()
        else:
            piped.to(torch.zeros(1))


def test_dtype_change_is_allowed():
    piped = Pipe(make_model(), chunks=2, balance=[3, 4], devices=["cpu", "cpu"])
    piped.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in piped.parameters())
    piped.float()
    out = piped(torch.randn(4, 6))
    assert out.dtype == torch.float32


def test_rejects_bad_cpu_threads():
    with pytest.raises(ValueError, match=r"cpu_threads must be a positive int or None, got 0"):
        Pipe(make_model(), balance=[3, 4], devices=["cpu", "cpu"], cpu_threads=0)


def test_warns_on_oversubscribed_cpu_threads():
    import os

    threads = (os.cpu_count() or 1) * 2
    with pytest.warns(UserWarning, match=rf"2 CPU partitions x cpu_threads={threads} need {2 * threads} threads"):
        Pipe(make_model(), balance=[3, 4], devices=["cpu", "cpu"], cpu_threads=threads)


# -- modes ---------------------------------------------------------------------------------


def _count_checkpointed(piped: Pipe, x: torch.Tensor) -> int:
    from pipe.core import checkpoint as chk_module

    count = 0
    original = chk_module.Checkpointing.checkpoint

    def counting(self):
        nonlocal count
        count += 1
        return original(self)

    chk_module.Checkpointing.checkpoint = counting
    try:
        piped(x)
    finally:
        chk_module.Checkpointing.checkpoint = original
    return count


def test_checkpoint_counts_per_mode():
    x = torch.randn(8, 6)
    for mode, expected in [("always", 4 * 2), ("except_last", 3 * 2), ("never", 0)]:
        piped = Pipe(make_model(), chunks=4, checkpoint=mode, balance=[3, 4], devices=["cpu", "cpu"])
        assert _count_checkpointed(piped, x) == expected, mode


def test_eval_and_no_grad_disable_checkpointing():
    x = torch.randn(8, 6)
    piped = Pipe(make_model(), chunks=4, checkpoint="always", balance=[3, 4], devices=["cpu", "cpu"])
    piped.eval()
    assert _count_checkpointed(piped, x) == 0
    piped.train()
    with torch.no_grad():
        assert _count_checkpointed(piped, x) == 0
    assert _count_checkpointed(piped, x) == 8


def test_no_grad_output_does_not_require_grad():
    piped = Pipe(make_model(), chunks=2, balance=[3, 4], devices=["cpu", "cpu"])
    with torch.no_grad():
        out = piped(torch.randn(4, 6))
    assert not out.requires_grad


def test_repeated_training_steps_match_plain_training():
    torch.manual_seed(0)
    model = make_model()
    plain = copy.deepcopy(model)
    piped = Pipe(model, chunks=4, checkpoint="except_last", balance=[3, 4], devices=["cpu", "cpu"])
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_piped = torch.optim.SGD(piped.parameters(), lr=0.1)
    for step in range(5):
        x, y = torch.randn(16, 6), torch.randn(16, 3)
        for m, opt in ((plain, opt_plain), (piped, opt_piped)):
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    for p, q in zip(plain.parameters(), piped.parameters()):
        torch.testing.assert_close(q, p)


def _tensors() -> list:
    import gc

    gc.collect()
    return [obj for obj in gc.get_objects() if type(obj) in (torch.Tensor, nn.Parameter)]


def _open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


def _left_alive(run) -> tuple:
    """What `run` created and left alive: tensors and threads, counted by identity.

    Everything alive before is held for the duration, so an object another test left behind and the
    collector frees meanwhile cannot move the count (a process-wide total went 33 -> 32 that way).
    """
    tensors, threads = _tensors(), set(threading.enumerate())
    known = {id(t) for t in tensors}
    run()
    new_tensors = sum(1 for t in _tensors() if id(t) not in known)
    new_threads = sum(1 for t in threading.enumerate() if t not in threads)
    return new_tensors, new_threads, _open_fds()


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_long_run_holds_steady(checkpoint):
    """R3: no growth of live tensors, threads or open files over many steps.

    A leak grows with the number of steps, so 100 steps leave more alive than 5; without one both leave
    the same (the gradients of the last step).
    """
    piped = Pipe(make_model(), chunks=4, checkpoint=checkpoint, balance=[3, 4], devices=["cpu", "cpu"])
    opt = torch.optim.SGD(piped.parameters(), lr=0.01)

    def steps(n):
        for _ in range(n):
            opt.zero_grad()
            piped(torch.randn(8, 6)).square().mean().backward()
            opt.step()

    steps(20)
    short = _left_alive(lambda: steps(5))
    long = _left_alive(lambda: steps(100))
    assert long == short
    assert short[0] == len(list(piped.parameters()))  # the last step's gradients, nothing else
    piped.close()
