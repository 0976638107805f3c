"""Calls: a forward's tasks report to it alone, and it cancels and waits for them before it ends."""
import copy
import threading
import time

import pytest
import torch

from pipe.core.microbatch import Batch
from pipe.core.stream import CPUStream
from pipe.threads.call import Call, CallLock, PipeClosedError
from pipe.threads.worker import Task, Workers

CPU = torch.device("cpu")


def task(call: Call, compute) -> Task:
    return Task(CPUStream, compute=compute, call=call, tag=(0, 0))


@pytest.mark.timeout(30)
def test_results_go_to_their_own_call():
    workers = Workers([CPU])
    first, second = workers.open_call(), workers.open_call()
    workers.put(0, task(first, lambda: Batch(torch.ones(1))))
    workers.put(0, task(second, lambda: Batch(torch.zeros(1))))
    ok, (_, batch) = second.get(0)
    assert ok and torch.equal(batch.value, torch.zeros(1))
    ok, (_, batch) = first.get(0)
    assert ok and torch.equal(batch.value, torch.ones(1))
    workers.end_call(first)
    workers.end_call(second)
    workers.close()


@pytest.mark.timeout(30)
def test_ending_a_call_skips_what_has_not_started_and_waits_for_what_runs():
    workers = Workers([CPU])
    call = workers.open_call()
    started, ran = threading.Event(), []

    def slow() -> Batch:
        started.set()
        time.sleep(0.2)
        ran.append("slow")
        return Batch(torch.ones(1))

    workers.put(0, task(call, slow))
    workers.put(0, task(call, lambda: ran.append("queued") or Batch(torch.ones(1))))
    started.wait(5)
    workers.end_call(call)  # as a forward does when an exception or an interrupt ends it
    assert ran == ["slow"]  # waited for the running task, skipped the queued one
    workers.close()


@pytest.mark.timeout(30)
def test_a_hand_over_interrupted_before_its_put_leaves_nothing_to_wait_for():
    # Cause: a count raised before the task reached its worker's queue was never lowered when an interrupt
    # landed between the two, and the call waited for it forever. Now a call waits for markers behind its
    # tasks in each worker's queue: whatever the interrupt cut short, the markers are reached.
    workers = Workers([CPU, CPU])
    call = workers.open_call()
    workers.put(1, task(call, lambda: Batch(torch.ones(1))))
    call.handed(0)  # Workers.put notes worker 0, then the interrupt lands before the put
    workers.end_call(call)  # returns (the count waited here forever)
    assert call.cancelled
    later = workers.open_call()  # and the workers serve the next call
    workers.put(0, task(later, lambda: Batch(torch.zeros(1))))
    ok, (_, batch) = later.get(0)
    assert ok and torch.equal(batch.value, torch.zeros(1))
    workers.end_call(later)
    workers.close()


@pytest.mark.timeout(30)
def test_close_aborts_a_call_under_way():
    workers = Workers([CPU])
    call = workers.open_call()

    def forward() -> Batch:  # runs until close() has aborted the call, however late the timer fires
        deadline = time.monotonic() + 20
        while call._abort is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return Batch(torch.ones(1))

    workers.put(0, task(call, forward))
    threading.Timer(0.05, workers.close).start()
    with pytest.raises(PipeClosedError, match="Pipe.close\\(\\) was called while this forward ran"):
        call.get(0)
    with pytest.raises(PipeClosedError):
        call.get(0)  # every later get too
    workers.end_call(call)


def test_call_lock_is_fresh_in_a_forked_process_and_in_copies():
    lock = CallLock()
    lock.__enter__()  # held, as by a thread of the parent at fork time
    lock._pid = -1  # what a forked child sees: another process id
    with lock:  # a fresh lock: does not wait for a holder that does not exist here
        pass
    assert copy.deepcopy(lock)._lock is not lock._lock
