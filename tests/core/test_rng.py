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
