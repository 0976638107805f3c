"""The fault matrix: FSDP, HSDP, TP, replicas x exit, SIGKILL, raise, stall of rank 2 of 4 x spawn, fork server, torchrun.

Every case asserts that each survivor's error names rank 2 (and how it
failed: ``failed in`` for a raise, ``died`` for an exit or a kill, ``stalled``
for a stall) and that each survivor ends within :data:`TIMEOUT` seconds plus
a bounded margin of the start of the faulty step; under torchrun, that the
job ends so and the agent's root cause is rank 2 when rank 2's process ended.
The stalled rank sleeps :data:`fault_ranks.STALL` seconds (60): the job must
not wait for it (the mesh's groups used to keep torch's 30-minute default).

A representative subset runs in CI (every layout, every fault, each
launcher at least once); the full product is ``slow`` (``pytest -m slow``). "spawn" forks the
ranks (``run_ranks``' default on the CPU), "forkserver" starts them from a fork server, as where a GPU is seen.
``python tests/distributed/test_fault_matrix.py`` runs the full product and
prints the table of seconds and the rank named.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import pytest

import fault_ranks
from fault_ranks import FAULTS, LAYOUTS, VICTIM, headline
from spawn_ranks import run_ranks

TIMEOUT = 4.0  # the job's process-group timeout, in seconds
MARGIN = 6.0  # what a survivor may take beyond the timeout (evidence settles in at most 4 s; a loaded CI)
NAMED = {"exit": "rank 2 died", "kill": "rank 2 died", "raise": "rank 2 failed in", "stall": "rank 2 stalled"}
CI = {("fsdp", "stall", "spawn"), ("hsdp", "stall", "spawn"), ("tp", "kill", "spawn"), ("replicas", "raise", "spawn"),
      ("fsdp", "exit", "spawn"), ("hsdp", "exit", "torchrun")}
CI |= {("fsdp", "kill", "forkserver")}
LAUNCHERS = ("spawn", "torchrun", "forkserver")
CASES = [pytest.param(layout, how, launcher, marks=() if (layout, how, launcher) in CI else pytest.mark.slow,
                      id=f"{layout}-{how}-{launcher}")
         for launcher in LAUNCHERS for layout in LAYOUTS for how in FAULTS]


def spawned(layout: str, how: str, start_method: Optional[str] = None) -> dict[int, tuple[str, float]]:
    """Each survivor's ``(message, seconds)`` with ranks started by ``run_ranks`` (the store in rank 0):
    forked (the default on the CPU), or from a fork server (``start_method="forkserver"``)."""
    results = run_ranks(fault_ranks.run, 4, layout, how, timeout=TIMEOUT, barrier=False, expect_missing=(VICTIM,),
                        deadline=90, start_method=start_method)
    return {rank: tuple(result) for rank, result in enumerate(results) if rank != VICTIM}


def launched(layout: str, how: str) -> tuple[dict[int, tuple[str, float]], str, float]:
    """Each survivor that reported, torchrun's output, and the seconds from the fault to the job's end."""
    from torchrun_launch import run_torchrun

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(Path(__file__).parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    script = str(Path(fault_ranks.__file__).resolve())
    reports: dict[int, Any] = {}
    began: list[float] = []
    for _ in range(2):  # a launch whose ranks did not reach the faulty step (4 s to connect on a loaded
        with tempfile.TemporaryDirectory(prefix="pipe-faults-") as folder:  # machine) is launched once more
            env["FAULT_REPORTS"] = folder
            done = run_torchrun(["--nproc-per-node=4"], [script, layout, how, str(TIMEOUT)], timeout=150, env=env,
                                start_new_session=True)
            end = time.time()
            for name in os.listdir(folder):
                text = Path(folder, name).read_text()
                if name.startswith("began"):
                    began.append(float(text))
                else:
                    report = json.loads(text)
                    reports[report["rank"]] = (report["message"], report["seconds"])
        if began:
            break
    assert began, (done.stdout + done.stderr)[-3000:]
    out = done.stdout + done.stderr
    return reports, out, end - min(began)


def logged(out: str) -> dict[int, str]:
    """The headline each rank logged (``rank 0 stopped in B0@0 because rank 2 died: ...``), by rank."""
    found = re.findall(r"rank (\d) stopped in [^\n]*? because (rank \d [a-z]+(?: in)?)", out)  # in F0@1, in the end of
    return {int(rank): cause for rank, cause in found}  # the step


def check(layout: str, how: str, reports: dict[int, tuple[str, float]]) -> None:
    for rank, (message, seconds) in reports.items():
        if rank == VICTIM:
            continue
        assert headline(message).startswith(NAMED[how]), (rank, message)
        assert seconds < TIMEOUT + MARGIN, (rank, seconds, message)


@pytest.mark.parametrize("layout,how,launcher", CASES)
def test_every_survivor_names_rank_2_and_ends_in_time(layout: str, how: str, launcher: str) -> None:
    if launcher != "torchrun":
        reports = spawned(layout, how, None if launcher == "spawn" else launcher)
        assert set(reports) == {0, 1, 3}, reports
        check(layout, how, reports)
        return
    reports, out, seconds = launched(layout, how)
    check(layout, how, reports)
    heard = logged(out)
    assert all(cause.startswith(NAMED[how]) for cause in heard.values()), (heard, out[-3000:])
    if how != "stall":  # rank 2's process ended first: the agent's root cause; it ends the others at once
        # (SIGTERM), often before they noticed anything
        summary = out.split("Root Cause (first observed failure):", 1)[1].split("=====", 1)[0]
        assert f"rank      : {VICTIM} (local_rank: {VICTIM})" in summary, out[-3000:]
    else:  # nothing ends rank 2: every survivor gives up on it after the timeout and names it
        assert {0, 1, 3} <= set(heard), (heard, out[-3000:])
    # The job: + up to 15 s for the processes to end (gloo joins its threads, waiting out their receives) and
    # torchrun to notice, on a loaded 2-core machine.
    assert seconds < TIMEOUT + MARGIN + 15.0, (seconds, out[-3000:])


def _row(layout: str, how: str, launcher: str) -> str:
    """One line of the table: each survivor's seconds from the start of the faulty step, and who it named."""
    if launcher != "torchrun":
        reports = spawned(layout, how, None if launcher == "spawn" else launcher)
        named = {rank: headline(message) for rank, (message, _) in reports.items()}
        total = max(seconds for _, seconds in reports.values())
    else:
        reports, out, total = launched(layout, how)
        named = logged(out)
    per = ", ".join(f"{rank}: {seconds:.1f}" for rank, (_, seconds) in sorted(reports.items()) if rank != VICTIM)
    causes = "; ".join(sorted({" ".join(cause.split()[:3]).rstrip(":") for cause in named.values()}))
    return f"| {layout} | {how} | {launcher} | {total:.1f} ({per}) | {causes} |"


if __name__ == "__main__":  # the full product as a table
    print("| layout | fault | launcher | seconds to exit: job (each survivor that reported) | named |")
    print("|---|---|---|---|---|")
    for launcher in LAUNCHERS:
        for layout in LAYOUTS:
            for how in FAULTS:
                try:
                    print(_row(layout, how, launcher), flush=True)
                except Exception as error:  # noqa: BLE001 - the table goes on
                    print(f"| {layout} | {how} | {launcher} | FAILED | {str(error).splitlines()[0][:200]} |", flush=True)
