"""Workers: one thread per partition, concurrency on the CPU, errors, lifecycle."""
import gc
import threading

import pytest
import torch
from torch import nn

from pipe import Pipe


def pipe_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pipe-worker-")]


def wait_for_no_pipe_threads(timeout: float = 5.0) -> None:
    gc.collect()  # a failed step's exception and traceback form cycles that hold its Pipe
    for thread in pipe_threads():
        thread.join(timeout)
    assert pipe_threads() == []


def test_two_cpu_partitions_run_concurrently():
    """Clock cycle 1 runs (micro-batch 1, partition 0) and (micro-batch 0, partition 1).

    Both cells wait on one barrier: it only opens if they run at the same time,
    otherwise it times out and the test fails.
    """
    barrier = threading.Barrier(2, timeout=10)
    calls = []

    class Once(nn.Module):
        def __init__(self, barrier, index):
            super().__init__()
            self.barrier, self.index, self.count = barrier, index, 0

        def forward(self, x):
            self.count += 1
            # partition 0 meets partition 1 on its 2nd micro-batch; partition 1 on its 1st
            if (self.index == 0 and self.count == 2) or (self.index == 1 and self.count == 1):
                calls.append(threading.current_thread().name)
                self.barrier.wait()
            return x + 1

    piped = Pipe(nn.Sequential(Once(barrier, 0), Once(barrier, 1)), chunks=2, checkpoint="never",
                 balance=[1, 1], devices=["cpu", "cpu"])
    out = piped(torch.zeros(2, 1))
    assert torch.equal(out, torch.full((2, 1), 2.0))
    assert len(set(calls)) == 2  # two different worker threads met at the barrier
    piped.close()


def test_cpu_threads_per_worker():
    seen = {}

    class Threads(nn.Module):
        def forward(self, x):
            seen[threading.current_thread().name] = torch.get_num_threads()
            return x

    piped = Pipe(nn.Sequential(Threads(), Threads()), chunks=2, balance=[1, 1], devices=["cpu", "cpu"], cpu_threads=1)
    before = torch.get_num_threads()
    piped(torch.zeros(2, 1))
    assert set(seen.values()) == {1}
    assert torch.get_num_threads() == before  # the caller's setting is untouched
    piped.close()


class Boom(nn.Module):
    def __init__(self, fail_on: int) -> None:
        super().__init__()
        self.fail_on, self.calls = fail_on, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("boom in layer")
        return x * 2


@pytest.mark.timeout(30)
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_exception_reaches_caller_and_pipe_stays_usable(checkpoint):
    boom = Boom(fail_on=2)
    counter = Boom(fail_on=-1)
    piped = Pipe(nn.Sequential(nn.Linear(2, 2), boom, counter), chunks=4, checkpoint=checkpoint,
                 balance=[1, 1, 1], devices=["cpu"] * 3)
    with pytest.raises(RuntimeError, match="boom in layer"):
        piped(torch.randn(8, 2))
    # The pipeline stopped early: the last partition did not see all 4 micro-batches.
    assert counter.calls < 4
    # ...and it is usable again.
    boom.fail_on = -1
    out = piped(torch.randn(8, 2))
    out.sum().backward()
    assert out.shape == (8, 2)
    piped.close()


@pytest.mark.timeout(30)
def test_exception_in_backward_recompute_reaches_caller():
    class FailOnRecompute(nn.Module):
        def forward(self, x):
            from pipe import is_recomputing

            if is_recomputing():
                raise ValueError("recompute failed")
            return x * 3

    piped = Pipe(nn.Sequential(nn.Linear(2, 2), FailOnRecompute()), chunks=2, checkpoint="always",
                 balance=[1, 1], devices=["cpu", "cpu"])
    out = piped(torch.randn(4, 2))
    with pytest.raises(ValueError, match="recompute failed"):
        out.sum().backward()


def test_threads_start_lazily_and_end_on_close():
    wait_for_no_pipe_threads()
    piped = Pipe(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), chunks=2, balance=[1, 1], devices=["cpu", "cpu"])
    assert pipe_threads() == []
    piped(torch.randn(4, 2))
    assert len(pipe_threads()) == 2
    piped(torch.randn(4, 2))
    assert len(pipe_threads()) == 2  # persistent, not one set per call
    piped.close()
    wait_for_no_pipe_threads()


def test_threads_end_when_pipe_is_collected():
    wait_for_no_pipe_threads()
    piped = Pipe(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), chunks=2, balance=[1, 1], devices=["cpu", "cpu"])
    piped(torch.randn(4, 2)).sum().backward()
    assert len(pipe_threads()) == 2
    del piped
    gc.collect()
    wait_for_no_pipe_threads()


def test_no_thread_growth_over_many_steps():
    wait_for_no_pipe_threads()
    piped = Pipe(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1)), chunks=4, checkpoint="except_last",
                 balance=[1, 1, 1], devices=["cpu"] * 3)
    baseline = threading.active_count()
    for _ in range(200):
        piped(torch.randn(8, 2)).sum().backward()
    assert threading.active_count() <= baseline + 3
    piped.close()
