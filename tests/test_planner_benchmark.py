"""benchmarks/planner.py: one planner benchmark, its subcommands dispatched (their figures are not run here)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "planner.py"


def test_every_subcommand_parses_its_options() -> None:
    code = ("import sys; sys.argv = ['planner.py']; sys.path.insert(0, 'benchmarks'); import planner\n"
            "for command in planner.COMMANDS:\n"
            "    try:\n"
            "        planner.main([command, '--help'])\n"
            "    except SystemExit as done:\n"
            "        assert done.code == 0, (command, done.code)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for command in ("budget", "split", "threads", "fidelity", "machine", "repeatability"):
        assert f"usage: planner.py {command}" in done.stdout, (command, done.stdout)


def test_a_missing_or_unknown_subcommand_names_the_choices() -> None:
    for argv, code in (([], 2), (["sweep"], 2), (["--help"], 0)):
        done = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == code, (argv, done)
        assert "usage: python benchmarks/planner.py {budget,split,threads,fidelity,machine,repeatability}" in (
            done.stdout + done.stderr), (argv, done)
    unknown = subprocess.run([sys.executable, str(SCRIPT), "sweep"], capture_output=True, text=True, timeout=60)
    assert "got 'sweep'; choose a subcommand" in unknown.stderr, unknown.stderr
