"""Launch ``torchrun`` on 127.0.0.1 for a test, on a port that is free, with a deadline.

A port found free can be taken by another test before torchrun binds it (the
suite runs on several workers): a launch whose store fails with EADDRINUSE is
retried on a new port, up to three times; any other failure is the test's.

The deadline (``timeout=``) is a hang guard, not a speed: a launch that passes
it fails the test with what the job printed so far, and, where the job has a
session of its own (``start_new_session=True``), every process of it is ended,
ranks included (killing the agent alone would leave its ranks running).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any, Optional

from pipe.distributed.local_ranks import free_port

_IN_USE = "EADDRINUSE"
_EXIT_ABORT = "terminate called without an active exception"


def aborted_at_exit(code: int, out: str, done: str) -> bool:
    """Whether a launched run printed ``done`` (its work finished) and then aborted while exiting, in gloo's
    C++ threads: seen about once in 100 launches of the distributed examples on a loaded machine. pipe
    destroys the groups it can before the interpreter finalizes (``pipe.distributed.env._close_at_exit``);
    groups that torch's own caches keep alive are still destroyed in the finalization. A test may run such a
    launch once more; a second failure is the test's."""
    return code != 0 and done in out and _EXIT_ABORT in out


def run_torchrun(torchrun_args: list[str], script_and_args: list[str], **run: Any) -> "subprocess.CompletedProcess[str]":
    """``python -m torch.distributed.run ARGS --master-addr=127.0.0.1 --master-port=P SCRIPT...``, output captured."""
    for _ in range(3):
        done = _run(
            [sys.executable, "-m", "torch.distributed.run", *torchrun_args, "--master-addr=127.0.0.1",
             f"--master-port={free_port()}", *script_and_args], **run)
        if done.returncode == 0 or _IN_USE not in done.stdout + done.stderr:
            return done
    return done


def _run(command: list[str], *, timeout: Optional[float] = None, start_new_session: bool = False,
         **popen: Any) -> "subprocess.CompletedProcess[str]":
    """``subprocess.run(command, capture_output=True, text=True)``, but a launch past ``timeout`` fails with its
    output and, in a session of its own, has its whole session ended."""
    began = time.monotonic()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=start_new_session, **popen) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            if start_new_session:
                os.killpg(proc.pid, signal.SIGKILL)  # the session this launch began: the agent and its ranks
            else:
                proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"torchrun had not ended {time.monotonic() - began:.0f} s after its start (the "
                                 f"guard is {timeout} s); its output so far:\n{(out + err)[-6000:]}") from None
    return subprocess.CompletedProcess(command, proc.returncode, out, err)
