"""Worker backward: CPU partitions back-propagate on their own threads, side by side."""
import copy
import threading

import pytest
import torch
from torch import nn

from pipe import Pipe
from pipe.threads.backward_pass import BackwardPass
from pipe.threads.worker import Workers


class MeetInBackward(torch.autograd.Function):
    """Identity whose backward waits on a barrier on chosen calls: proves two backwards overlap."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        layer = ctx.layer
        layer.calls += 1
        if layer.calls == layer.meet_on:
            layer.threads.append(threading.current_thread().name)
            layer.barrier.wait()
        return grad, None


class Meet(nn.Module):
    def __init__(self, barrier, meet_on, threads):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.barrier, self.meet_on, self.threads, self.calls = barrier, meet_on, threads, 0

    def forward(self, x):
        return MeetInBackward.apply(self.linear(x), self)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_cpu_partitions_overlap_in_backward(checkpoint):
    """Backward of 2 micro-batches over 2 partitions: (1, 1) alone, then (0, 1) with (1, 0), then (0, 0).

    Partition 1's second backward and partition 0's first wait on one barrier, which
    opens only if they run at the same time.
    """
    barrier = threading.Barrier(2, timeout=20)
    threads: list[str] = []
    model = nn.Sequential(Meet(barrier, 1, threads), Meet(barrier, 2, threads))
    piped = Pipe(model, chunks=2, checkpoint=checkpoint, balance=[1, 1], devices=["cpu", "cpu"])
    piped(torch.randn(4, 3)).sum().backward()
    assert len(set(threads)) == 2 and all(name.startswith("pipe-worker-") for name in threads)
    assert all(p.grad is not None for p in piped.parameters())
    piped.close()


def test_two_forwards_one_backward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    plain = copy.deepcopy(model)
    piped = Pipe(model, chunks=2, checkpoint="except_last", balance=[2, 1], devices=["cpu", "cpu"])
    a, b = torch.randn(6, 4), torch.randn(6, 4)
    (piped(a).square().sum() + piped(b).sum()).backward()
    (plain(a).square().sum() + plain(b).sum()).backward()
    for p, q in zip(plain.parameters(), piped.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    piped.close()


def test_gradient_flows_to_layers_before_the_pipe():
    """Inputs that require grad get real gradients: partition 0's jobs finish inside backward."""
    torch.manual_seed(0)
    before = nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    plain_before, plain = copy.deepcopy(before), copy.deepcopy(model)
    piped = Pipe(model, chunks=3, checkpoint="always", balance=[2, 1], devices=["cpu", "cpu"])
    x = torch.randn(6, 4)
    (piped(before(x)) * 2).sum().backward()
    (plain(plain_before(x)) * 2).sum().backward()
    torch.testing.assert_close(before.weight.grad, plain_before.weight.grad)
    piped.close()


@pytest.mark.timeout(60)
def test_failure_in_a_backward_job_reaches_the_caller_and_pipe_stays_usable():
    class FailInBackward(torch.autograd.Function):
        fail = True

        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            if FailInBackward.fail:
                raise RuntimeError("backward exploded")
            return grad

    class Layer(nn.Module):
        def forward(self, x):
            return FailInBackward.apply(x)

    piped = Pipe(nn.Sequential(nn.Linear(3, 3), Layer(), nn.Linear(3, 3)), chunks=4, checkpoint="except_last",
                 balance=[2, 1], devices=["cpu", "cpu"])
    with pytest.raises(RuntimeError, match="backward exploded"):
        piped(torch.randn(8, 3)).sum().backward()
    FailInBackward.fail = False
    piped.zero_grad()
    piped(torch.randn(8, 3)).sum().backward()
    assert all(p.grad is not None for p in piped.parameters())
    piped.close()


def test_worker_backward_only_for_cpu_pipelines_without_skips():
    piped = Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), chunks=2, balance=[1, 1], devices=["cpu", "cpu"])
    assert piped._pipeline.worker_backward
    single = Pipe(nn.Sequential(nn.Linear(2, 2)), chunks=2)
    assert not single._pipeline.worker_backward  # one partition: nothing to overlap
    piped.close()
    single.close()


@pytest.mark.timeout(30)
def test_a_job_whose_hand_over_was_interrupted_is_not_waited_for():
    # Cause: the pass counted a job before handing it to its worker; an interrupt between the two left a
    # count that nothing lowered, and the interrupted backward waited for it forever. Now the pass waits
    # for markers behind its jobs in each worker's queue.
    workers = Workers([torch.device("cpu")])
    handed = []

    def submit(j, job):
        if not handed:
            handed.append("interrupted")
            raise KeyboardInterrupt  # lands before the job reaches worker j
        handed.append("marker")
        workers.submit(j, job)

    backward_pass = BackwardPass(submit)
    ran = []

    class Hand(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            backward_pass.submit(0, lambda: ran.append("job"))
            return grad

    x = torch.ones(2, requires_grad=True)
    with pytest.raises(KeyboardInterrupt):
        Hand.apply(x).sum().backward()  # autograd drops the pass's callback: the pass is cancelled
    assert handed == ["interrupted", "marker"] and ran == [] and backward_pass.cancelled
    workers.close()
