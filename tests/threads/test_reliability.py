"""No silent wrong result, no hang (issue 12): interrupts, threads, fork, nesting, close, mixing outputs, grad().

Each test names the cause it guards against. Interrupts and forks run in a
subprocess with a deadline, so that a signal does not disturb the pytest
worker and a hang fails instead of blocking; the others carry a timeout.
"""
import copy
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch import nn

from helpers import assert_same_grads
import pipe
from pipe import Pipe
from pipe.threads.call import PipeClosedError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(pipe.__file__)))


def run_script(code: str, timeout: float = 90.0, **env_vars: str) -> str:
    """Runs ``code`` in a fresh interpreter (``env_vars`` added to its environment); fails on a non-zero exit or a
    hang; returns its stdout."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **env_vars)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def cpu_pipe(model: nn.Sequential, chunks: int = 4, checkpoint: str = "except_last", parts: int = 2) -> Pipe:
    size = len(model) // parts
    balance = [size] * (parts - 1) + [len(model) - size * (parts - 1)]
    return Pipe(model, chunks=chunks, checkpoint=checkpoint, balance=balance, devices=["cpu"] * parts)


def small_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


# -- 1. KeyboardInterrupt -----------------------------------------------------------------

_SLOW_MODEL = """
import copy, signal, threading, weakref
import torch
from torch import nn
from pipe import Pipe

# The interrupt is sent from inside the pipeline (a worker, in a layer's forward or backward) and that worker
# waits until the main thread's handler has run, so the call cannot finish before the signal lands, on any
# machine: the tests count events, never time.
landed = threading.Event()
armed = [0]  # the layer call (counted from 1) that sends the interrupt; 0: none
calls = [0]
count = threading.Lock()

def on_interrupt(signum, frame):
    if not 0 < armed[0] <= calls[0] or landed.is_set():
        return  # a copy of this trial's signal, sent again below
    # Python ignores an exception raised inside a finalizer (autograd frees the pipeline's saved tokens during
    # backward, and their weakref.finalize callbacks run Python code): there the signal is not taken, and
    # the worker sends it again, as a user presses Ctrl-C again.
    caller = frame
    while caller is not None:
        if caller.f_code is weakref.finalize.__call__.__code__:
            return
        caller = caller.f_back
    landed.set()
    raise KeyboardInterrupt

signal.signal(signal.SIGINT, on_interrupt)

def interrupt_at(call):
    with count:
        landed.clear()
        calls[0] = 0
        armed[0] = call

def counted():
    with count:
        calls[0] += 1
        fire = calls[0] == armed[0]
    if not fire:
        return
    # Sent to the main thread itself, and again until its handler raised: a signal sent to the process may
    # be taken by this thread, and one that arrives just before the main thread blocks on a lock is handled
    # only when that lock is released (which waits on this thread).
    for _ in range(1200):  # a minute at most
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        if landed.wait(0.05):
            return
    raise RuntimeError("the interrupt did not reach the main thread in a minute")

class Slow(nn.Module):
    # counts its forward and backward calls; the armed one interrupts the main thread
    def forward(self, x):
        counted()
        return SlowBackward.apply(x)

class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)
    @staticmethod
    def backward(ctx, g):
        counted()
        return g

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), Slow(), nn.Tanh(), nn.Linear(8, 8), Slow(), nn.Linear(8, 8))
plain = copy.deepcopy(model)
piped = Pipe(model, chunks=4, balance=[3, 3], devices=["cpu", "cpu"])
"""


@pytest.mark.timeout(120)
def test_interrupted_forward_leaves_nothing_for_the_next_call():
    # Cause: results of the interrupted call stayed in the workers' shared queues
    # and the next call took them. Now each call has its own queues and drains.
    # The forward makes 8 layer calls (2 Slow layers x 4 micro-batches): interrupted at the first, a middle
    # and the last, with and without grad.
    out = run_script(_SLOW_MODEL + """
trials = [1, 4, 8, 2]
interrupted = 0
for trial, call in enumerate(trials):
    x = torch.randn(16, 8)
    interrupt_at(call)
    try:
        with torch.set_grad_enabled(trial % 2 == 0):
            piped(x)
    except KeyboardInterrupt:
        interrupted += 1
    interrupt_at(0)
    for _ in range(3):
        y = torch.randn(16, 8)
        with torch.no_grad():
            # float rounding only (16 threads round a 4-row chunk unlike the whole batch); a stale
            # micro-batch would differ by far more
            torch.testing.assert_close(piped(y), plain(y))
assert interrupted == len(trials), (interrupted, "a call ended normally though its interrupt landed inside it")
print("interrupted", interrupted)
""")
    assert "interrupted 4" in out


@pytest.mark.timeout(120)
def test_interrupted_backward_stops_before_the_next_step():
    # Cause: the worker jobs of an interrupted backward kept running and wrote
    # into .grad after the next step had zeroed it. Now backward cancels the jobs
    # that have not started and waits for the running ones before it raises.
    # The backward makes 8 layer calls after the forward's 8: interrupted at its first, a middle and its last.
    out = run_script(_SLOW_MODEL + """
trials = [9, 12, 16]
interrupted = 0
for call in trials:
    x = torch.randn(16, 8)
    interrupt_at(call)
    try:
        output = piped(x)
        output.sum().backward()
    except KeyboardInterrupt:
        interrupted += 1
    interrupt_at(0)
    piped.zero_grad()
    plain.zero_grad()
    y = torch.randn(16, 8)
    piped(y).sum().backward()
    plain(y).sum().backward()
    for p, q in zip(piped.parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), "wrong gradient after an interrupted backward"
assert interrupted == len(trials), (interrupted, "a backward ended normally though its interrupt landed inside it")
print("interrupted", interrupted)
""")
    assert "interrupted 3" in out


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.03)
        return grad


class FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("failed in backward")


@pytest.mark.timeout(60)
def test_backward_failing_elsewhere_in_the_graph_stops_the_jobs_first():
    # Cause: an exception in another node of the caller's graph ended autograd's
    # backward without its end-of-backward callback, and the workers' jobs went on
    # writing .grad after backward() had raised (and after zero_grad()).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Lambda(SlowBackward.apply), nn.Linear(8, 8), Lambda(SlowBackward.apply))
    plain = copy.deepcopy(model)
    piped = cpu_pipe(model, chunks=4)
    x = torch.randn(16, 8)
    # Created before the pipeline's nodes, so autograd reaches it after every Boundary.
    side = FailInBackward.apply(torch.ones(1, requires_grad=True)).sum()
    loss = side + piped(x).sum()
    with pytest.raises(RuntimeError, match="failed in backward"):
        loss.backward()
    piped.zero_grad()
    time.sleep(1.5)  # a job left running would write now
    assert all(p.grad is None for p in piped.parameters())
    piped(x).sum().backward()
    plain(x).sum().backward()
    assert_same_grads(piped, plain)
    piped.close()


# -- 2. two threads ---------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("grad", [False, True])
def test_two_threads_calling_one_pipe_get_their_own_outputs(grad):
    # Cause: both calls read the same result queues and took each other's micro-batches.
    # Now calls of one Pipe are serialised by a lock, and each reads only its own results.
    torch.manual_seed(0)
    model = small_mlp()
    plain = copy.deepcopy(model)
    piped = cpu_pipe(model, chunks=4)
    wrong: list[int] = []
    errors: list[BaseException] = []

    def serve(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        try:
            for k in range(40):
                x = torch.randn(8, 6, generator=generator)
                with torch.set_grad_enabled(grad):
                    y = piped(x)
                    if grad:
                        y.sum().backward()
                with torch.no_grad():
                    if not torch.allclose(y, plain(x), atol=1e-6):
                        wrong.append(k)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=serve, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert not errors and wrong == []
    piped.close()


# -- 3. a last layer that mixes samples ---------------------------------------------------------

class Lambda(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, x):
        return self.function(x)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reduce, match", [
    (lambda x: x.mean(0), r"returned tensors of \[4, 4, 4\] rows .* micro-batches of \[3, 3, 2\] samples"),
    (lambda x: x.sum(0, keepdim=True), r"\[1, 1, 1\] rows"),
    (lambda x: x.mean(), "returned a 0-dim tensor"),
])
def test_a_last_layer_that_mixes_samples_is_refused(reduce, match):
    # Cause: micro-batch outputs were concatenated whatever they were: [12] instead
    # of [4] for x.mean(0), and a bare torch.cat error for a scalar.
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), Lambda(reduce))
    piped = cpu_pipe(model, chunks=3)
    with pytest.raises(ValueError, match=match) as info:
        piped(torch.randn(8, 6))
    assert "the last layer '2' (partition 1)" in str(info.value)
    assert "use chunks=1" in str(info.value)
    piped.close()


@pytest.mark.timeout(60)
def test_a_mixing_last_layer_with_one_chunk_equals_plain():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), Lambda(lambda x: x.mean(0)))
    plain = copy.deepcopy(model)
    piped = cpu_pipe(model, chunks=1)
    x = torch.randn(8, 6)
    out = piped(x)
    expected = plain(x)
    assert torch.equal(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_same_grads(piped, plain)
    piped.close()


@pytest.mark.timeout(60)
def test_flattened_per_sample_outputs_still_gather():
    # Not a false alarm: [B, T, F] -> [B*T, F] has T rows per sample in every micro-batch.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), Lambda(lambda x: x.reshape(-1, 4)))
    plain = copy.deepcopy(model)
    piped = cpu_pipe(model, chunks=3)
    x = torch.randn(8, 5, 6)
    torch.testing.assert_close(piped(x), plain(x))
    piped.close()


# -- 4. torch.autograd.grad, inputs=, retain_graph, create_graph ------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_grad_of_the_input_fills_no_parameter_grad(checkpoint):
    # Cause: the workers ran a full backward per cell, filling every parameter's .grad.
    torch.manual_seed(0)
    model = small_mlp()
    plain = copy.deepcopy(model)
    piped = cpu_pipe(model, chunks=4, checkpoint=checkpoint)
    x = torch.randn(8, 6, requires_grad=True)
    (got,) = torch.autograd.grad(piped(x).sum(), x)
    (expected,) = torch.autograd.grad(plain(x).sum(), x)
    torch.testing.assert_close(got, expected)
    assert all(p.grad is None for p in piped.parameters())
    piped.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_grad_of_parameters_and_backward_inputs_equal_plain(checkpoint):
    torch.manual_seed(0)
    model = small_mlp()
    plain = copy.deepcopy(model)
    piped = cpu_pipe(model, chunks=4, checkpoint=checkpoint)
    x = torch.randn(8, 6)
    got = torch.autograd.grad(piped(x).sum(), list(piped.parameters()))
    expected = torch.autograd.grad(plain(x).sum(), list(plain.parameters()))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    assert all(p.grad is None for p in piped.parameters())
    # backward(inputs=[one weight]) fills that weight's grad only.
    piped(x).sum().backward(inputs=[piped[2].weight])
    plain(x).sum().backward(inputs=[plain[2].weight])
    assert_same_grads(piped, plain, missing_is_zero=True)  # the others have none, in both
    assert piped[0].weight.grad is None and piped[2].weight.grad is not None
    piped.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_second_backward_after_retain_graph_equals_plain(checkpoint):
    # Cause: a cell dropped its graph after its first backward (a bare AssertionError on the second).
    torch.manual_seed(0)
    model = small_mlp()
    plain = copy.deepcopy(model)
    piped = cpu_pipe(model, chunks=4, checkpoint=checkpoint)
    x = torch.randn(8, 6, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    loss, loss_plain = piped(x).sum(), plain(x_plain).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    loss_plain.backward(retain_graph=True)
    loss_plain.backward()
    assert_same_grads(piped, plain)
    torch.testing.assert_close(x.grad, x_plain.grad)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    piped.close()


@pytest.mark.timeout(60)
def test_create_graph_is_refused_with_the_fix_and_the_fix_equals_plain():
    # A gradient penalty cannot cross the worker backward's cut between partitions.
    torch.manual_seed(0)
    model = small_mlp()
    plain = copy.deepcopy(model)
    piped = cpu_pipe(model, chunks=4, checkpoint="never")
    x = torch.randn(8, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"create_graph=True .* set pipe.worker_backward = False"):
        torch.autograd.grad(piped(x).sum(), x, create_graph=True)
    piped.worker_backward = False
    for module in (piped, plain):
        (g,) = torch.autograd.grad(module(x).sum(), x, create_graph=True)
        g.pow(2).sum().backward()
    assert_same_grads(piped, plain, missing_is_zero=True)
    piped.close()


# -- 5. a Pipe inside a Pipe -------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_pipe_as_a_layer_of_another_pipe_equals_plain(checkpoint):
    # Cause: the outer cell held the CPU generator lock while the inner cells waited for it.
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    model = nn.Sequential(nn.Linear(6, 8), copy.deepcopy(inner), nn.Linear(8, 4))
    plain = copy.deepcopy(model)
    model[1] = cpu_pipe(model[1], chunks=2, checkpoint=checkpoint)
    piped = Pipe(model, chunks=4, checkpoint=checkpoint, balance=[1, 1, 1], devices=["cpu"] * 3)
    x = torch.randn(8, 6)
    out, expected = piped(x), plain(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_same_grads(piped, plain)
    model[1].close()
    piped.close()


# -- 6. fork --------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_pipe_in_a_forked_child_after_the_parent_ran_it():
    # Cause: the child inherited the parent's worker objects but not their threads.
    # The GPU is hidden: where one is visible, torch's autograd starts device threads at the parent's first
    # backward and then refuses any backward in a forked child, with or without pipe.
    out = run_script("""
import copy, multiprocessing
import torch
from torch import nn
from pipe import Pipe

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
plain = copy.deepcopy(model)
piped = Pipe(model, chunks=4, balance=[2, 1], devices=["cpu", "cpu"])
x = torch.randn(8, 6)
piped(x).sum().backward()  # the parent's workers are running

def child(queue):
    torch.set_num_threads(1)
    piped.zero_grad()
    plain.zero_grad()
    out = piped(x)
    out.sum().backward()
    plain(x).sum().backward()
    same = torch.allclose(out, plain(x)) and all(
        torch.allclose(p.grad, q.grad) for p, q in zip(piped.parameters(), plain.parameters()))
    queue.put(same)

context = multiprocessing.get_context("fork")
queue = context.Queue()
process = context.Process(target=child, args=(queue,))
process.start()
result = queue.get(timeout=60)
process.join(30)
assert result is True and process.exitcode == 0, (result, process.exitcode)
# A DataLoader worker is a forked child too.
class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, k):
        torch.set_num_threads(1)
        with torch.no_grad():
            return piped(x[2 * k % 8:2 * k % 8 + 2])
loader = torch.utils.data.DataLoader(Data(), batch_size=None, num_workers=1, multiprocessing_context="fork",
                                     timeout=60)
with torch.no_grad():
    for k, got in enumerate(loader):
        assert torch.allclose(got, plain(x[2 * k % 8:2 * k % 8 + 2]))
print("fork ok")
""", CUDA_VISIBLE_DEVICES="")
    assert "fork ok" in out


# -- 7. close() from another thread -------------------------------------------------------------

class Sleep(nn.Module):
    def forward(self, x):
        time.sleep(0.05)
        return x


@pytest.mark.timeout(60)
def test_close_from_another_thread_fails_the_forward_at_once():
    # Cause: the forward waited for results of workers that close() had ended.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), Sleep(), nn.Linear(6, 6), Sleep())
    plain = copy.deepcopy(model)
    piped = cpu_pipe(model, chunks=8)
    x = torch.randn(16, 6)
    piped(x)  # threads started
    for delay in (0.0, 0.05, 0.15):
        closer = threading.Timer(delay, piped.close)
        start = time.monotonic()
        closer.start()
        try:
            piped(x)
        except PipeClosedError as error:
            assert "Pipe.close() was called while this forward ran" in str(error)
        closer.join()
        assert time.monotonic() - start < 5.0
        # A later call starts new workers and is right.
        with torch.no_grad():
            torch.testing.assert_close(piped(x), plain(x))
    piped.close()


# -- 11. a CUDA device without CUDA (an empty nn.Sequential and a positional balance: see main's i10 merge) --

@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a PyTorch without CUDA")
def test_cuda_device_without_cuda_is_refused():
    with pytest.raises(ValueError, match=r"device cuda:0 was given but CUDA is not available .* devices=\['cpu'"):
        Pipe(nn.Sequential(nn.Linear(2, 2)), balance=[1], devices=["cuda:0"])
    with pytest.raises(ValueError, match="device cuda:1 was given"):
        Pipe(nn.Sequential(nn.Linear(2, 2)), balance=[1], devices=[1])


@pytest.mark.timeout(60)
def test_autograd_backward_path_refuses_create_graph_through_checkpoints_and_grad_fills_no_grad():
    # With pipe.worker_backward = False, checkpointed cells back-propagate in
    # Checkpoint.backward: it honours grad() and refuses a double backward it would get wrong.
    torch.manual_seed(0)
    model = small_mlp()
    plain = copy.deepcopy(model)
    piped = cpu_pipe(model, chunks=4, checkpoint="always")
    piped.worker_backward = False
    x = torch.randn(8, 6, requires_grad=True)
    (got,) = torch.autograd.grad(piped(x).sum(), x)
    (expected,) = torch.autograd.grad(plain(x).sum(), x)
    torch.testing.assert_close(got, expected)
    assert all(p.grad is None for p in piped.parameters())
    with pytest.raises(RuntimeError, match="create_graph=True .* checkpointed micro-batch; use checkpoint='never'"):
        torch.autograd.grad(piped(x).sum(), x, create_graph=True)
    with pytest.raises(ValueError, match="worker_backward=True needs several partitions, all on the CPU"):
        Pipe(small_mlp(), chunks=2).worker_backward = True
    piped.close()


@pytest.mark.timeout(60)
def test_retain_graph_under_copying_saved_tensor_hooks():
    # The token that tells when autograd lets go of a cell must not be packed by the caller's hooks:
    # a hook that copies (as offloading does) would free it at once and drop the cell's graph.
    torch.manual_seed(0)
    model = small_mlp()
    plain = copy.deepcopy(model)
    piped = cpu_pipe(model, chunks=2, checkpoint="never")
    packed = []

    def pack(tensor):
        packed.append(1)
        return tensor.clone()

    x = torch.randn(8, 6)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = piped(x).sum()
        loss_plain = plain(x).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    loss_plain.backward(retain_graph=True)
    loss_plain.backward()
    assert_same_grads(piped, plain)
    piped.close()
