"""RNG capture/replay and the guard that keeps concurrent partitions' draws apart."""
import threading

import torch

from pipe.core.rng import GeneratorLocks, RandomnessGuard, restore_rng_state, save_rng_state

CPU = torch.device("cpu")


def test_restore_replays_and_puts_state_back():
    state = save_rng_state(CPU)
    first = torch.rand(4)
    after = torch.get_rng_state()
    with restore_rng_state(CPU, state):
        again = torch.rand(4)
    assert torch.equal(first, again)
    assert torch.equal(torch.get_rng_state(), after)


def test_guard_learns_whether_a_partition_draws():
    random_guard, plain_guard = RandomnessGuard(CPU), RandomnessGuard(CPU)
    assert random_guard.draws(True) is None
    with random_guard.forward(True, seed=1):
        torch.rand(1)
    with plain_guard.forward(True, seed=2):
        torch.zeros(1)
    assert random_guard.draws(True) is True
    assert plain_guard.draws(True) is False
    assert plain_guard.draws(False) is None  # each mode is learned separately


def test_guard_serialises_random_partitions():
    guard_a, guard_b = RandomnessGuard(CPU), RandomnessGuard(CPU)
    for guard in (guard_a, guard_b):
        with guard.forward(True, seed=0):
            torch.rand(1)
    inside = []
    overlap = []

    def run(guard):
        for _ in range(50):
            with guard.forward(True, seed=0):
                inside.append(1)
                if len(inside) > 1:
                    overlap.append(1)
                torch.rand(100)
                inside.pop()

    threads = [threading.Thread(target=run, args=(g,)) for g in (guard_a, guard_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlap == []


def test_seeded_forward_draws_from_its_own_stream_and_restores_the_global_one():
    guard = RandomnessGuard(CPU)
    before = torch.get_rng_state()
    with guard.forward(True, seed=123):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the global stream did not move
    with guard.forward(True, seed=123):
        again = torch.rand(3)
    assert torch.equal(first, again)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), first)


def test_a_call_inside_a_guarded_cell_gets_its_own_lock():
    # A Pipe used as a layer of another: its cells must not wait for the lock their caller holds.
    outer = RandomnessGuard(CPU)
    top = GeneratorLocks.for_call()
    assert GeneratorLocks.for_call() is top  # top-level calls share the process's locks
    with outer.forward(True, seed=1, locks=top):
        torch.rand(1)
        inner = GeneratorLocks.for_call()
        assert inner is not top and inner.lock(CPU) is not top.lock(CPU)
        got = []
        thread = threading.Thread(target=lambda: got.append(inner.lock(CPU).acquire(timeout=5)))
        thread.start()
        thread.join()
        assert got == [True]
        inner.lock(CPU).release()
    assert GeneratorLocks.for_call() is top


_HANG = r'''
import gc, sys, threading, time
import torch
from torch import nn
from pipe.core.rng import RandomnessGuard, restore_rng_state, save_rng_state
from pipe.recompute.module import checkpoint

class Cycle:  # garbage whose finalizer lets another thread take the interpreter lock
    def __init__(self):
        self.me = self
    def __del__(self):
        time.sleep(0)

cpu = torch.device("cpu")
layer = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))

def work(k):
    for _ in range(2000):
        Cycle()
        save_rng_state(cpu)
    guard = RandomnessGuard(cpu)
    for i in range(200):
        Cycle()
        with restore_rng_state(cpu, save_rng_state(cpu)):
            Cycle()
        with guard.forward(True, seed=k * 1000 + i):
            Cycle()
    for _ in range(5):
        x = torch.randn(2, 4, requires_grad=True)
        checkpoint(layer, x, use_reentrant=False).sum().backward()

gc.set_threshold(1)  # collect on (nearly) every allocation: inside the generators' reads too
threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("done")
'''


def test_threads_reading_the_random_state_while_the_collector_runs_finalizers_do_not_hang(tmp_path) -> None:
    """torch.get_rng_state keeps the generator's mutex while it makes a Python object, which can run the
    collector, whose finalizers can pass the interpreter lock to a thread that then waits for that mutex
    holding the interpreter lock: four threads reading the state this way hung every time (a Pipe with
    checkpointing hung CI so). pipe reads, writes and seeds the generators under a lock of its own, where a
    waiting thread lets the interpreter lock go. A subprocess: a hang holds the interpreter lock, so no
    timeout inside the process could end it."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**__import__("os").environ, "PYTHONPATH": str(root)}
    script = tmp_path / "hang.py"  # run as a file: under -c the same code did not hang before the fix
    script.write_text(_HANG)
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        raise AssertionError("threads reading and writing the random state hung (120 s)") from None
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-2000:]
