"""Tests for pipe.viz.cli: the pipe-viz command, its output formats, exit codes and messages."""
from __future__ import annotations

import configparser
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipe import trace
from pipe.viz.cli import main


def run_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_plan_prints_text_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1F1B · 2 stages · 3 micro-batches · checkpoint=never · bubble 25.0%")
    assert "stage 0 | F0 F1 .  .  B0--- F2 B1--- .  B2---" in out


@pytest.mark.parametrize("suffix, marker", [(".svg", "<svg"), (".html", "<!DOCTYPE html>"),
                                            (".txt", "stage 3 |"), (".json", '"traceEvents"')])
def test_plan_format_follows_the_extension(tmp_path: Path, suffix: str, marker: str) -> None:
    out = tmp_path / f"plan{suffix}"
    assert main(["plan", "--schedule", "interleaved", "--ranks", "4", "--microbatches", "8",
                 "--virtual-stages", "2", "--checkpoint", "always", "-o", str(out)]) == 0
    text = out.read_text()
    assert marker in text
    if suffix == ".json":
        trace.validate(json.loads(text))


def test_trace_renders_a_recording_with_its_plan(tmp_path: Path, pipe_trace: dict[str, Any],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run.json"
    run.write_text(json.dumps(pipe_trace))
    assert main(["trace", str(run), "--step", "0", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "measured GPipe · 2 stages · 4 micro-batches · step 0 of 2" in out
    assert "plan for the same configuration" in out
    page = tmp_path / "run.html"
    assert main(["trace", str(run), "--plan", "-o", str(page)]) == 0
    assert page.read_text().count("<svg") == 2
    assert "pipe-viz: wrote" in capsys.readouterr().err


def test_trace_merges_one_file_per_rank(tmp_path: Path) -> None:
    files = []
    for rank in range(2):
        with trace.record(tmp_path / "run.{rank}.json", rank=rank) as recorder:
            recorder.add("forward", (0, rank), 0, 1000)
            recorder.add("backward", (0, rank), 2000, 4000)
        files.append(str(tmp_path / f"run.{rank}.json"))
    merged = tmp_path / "merged.json"
    assert main(["trace", *files, "-o", str(merged)]) == 0
    data = trace.load(merged)
    assert sorted({e["pid"] for e in data["traceEvents"] if e["ph"] == "X"}) == [0, 1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--ranks", "0"], r"argument --ranks: expected a positive integer, got 0"),
        (["plan", "--microbatches", "many"], r"argument --microbatches: expected a positive integer, got 'many'"),
        (["plan", "--schedule", "zigzag"], r"argument --schedule: invalid choice: 'zigzag'"),
        (["plan", "--virtual-stages", "2"], r"--virtual-stages 2 needs --schedule interleaved"),
        (["plan", "--schedule", "interleaved", "--ranks", "4", "--microbatches", "6"],
         r"needs microbatches divisible by ranks .*"),
        (["plan", "-o", "out.png"], r"cannot tell the format of 'out.png' from its extension; use one of .svg"),
        (["plan", "--backward", "-1"], r"argument --backward: expected a positive finite number, got '-1'"),
        (["trace", "missing.json"], r"cannot read trace 'missing.json': No such file or directory"),
        ([], r"the following arguments are required"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv: list[str], message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert re.search(message, run_error(argv, capsys))


def test_unreadable_traces_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    assert "is not JSON" in run_error(["trace", str(bad)], capsys)
    bad.write_text('{"events": []}')
    assert "is not a Chrome trace" in run_error(["trace", str(bad)], capsys)
    bad.write_text('{"traceEvents": []}')
    assert "has no spans to draw" in run_error(["trace", str(bad)], capsys)


def test_console_script_and_module_entry_point() -> None:
    setup = configparser.ConfigParser()
    setup.read(Path(__file__).resolve().parents[2] / "setup.cfg")
    assert "pipe-viz = pipe.viz.cli:main" in setup["options.entry_points"]["console_scripts"]
    done = subprocess.run([sys.executable, "-m", "pipe.viz", "plan", "--ranks", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "expected a positive integer, got 0" in done.stderr


@pytest.mark.parametrize("command", [["plan"], ["trace", "TRACE"]])
def test_unwritable_output_exits_2_naming_the_path(tmp_path: Path, pipe_trace: dict[str, Any], command: list[str],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # A folder that cannot be created (a file is in the way): as `-o /unwritable/x.svg` is for a user.
    (tmp_path / "a-file").write_text("")
    output = tmp_path / "a-file" / "x.svg"
    recorded = tmp_path / "run.json"
    recorded.write_text(json.dumps(pipe_trace))
    argv = [str(recorded) if arg == "TRACE" else arg for arg in command] + ["-o", str(output)]
    error = run_error(argv, capsys)
    assert f"cannot write {str(output)!r}" in error and "pass -o a path in a writable folder" in error
    assert "Traceback" not in error


def test_garbage_collection_is_back_on_after_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    import gc

    assert gc.isenabled()
    main(["plan", "--ranks", "2", "--microbatches", "2"])
    run_error(["plan", "--ranks", "0"], capsys)
    assert gc.isenabled()
