"""Planner validation, one benchmark with subcommands; each writes its JSON under benchmarks/results/.

Usage::

    python benchmarks/planner.py budget [--quick]       # predicted vs measured, chosen vs best: planner.json
    python benchmarks/planner.py split [--quick] [--ranks 2]  # pp x dp_replicate x dp_shard: planner_split.json
    python benchmarks/planner.py threads [--quick]      # Pipe's (thread runner's) plans: planner_threads.json
    python benchmarks/planner.py fidelity [--quick]     # layer profile vs a stage's time: profile_fidelity.json
    python benchmarks/planner.py machine                # this machine's speeds: machine_speed.json
    python benchmarks/planner.py repeatability          # one plan's step across committed runs: planner_repeatability.json
    python benchmarks/planner.py COMMAND --help         # a subcommand's options

The code of each is ``benchmarks/planner_bench/COMMAND.py``.
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = ("budget", "split", "threads", "fidelity", "machine", "repeatability")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        given = f"got {argv[0]!r}; " if argv and argv[0] not in ("-h", "--help") else ""
        print(f"usage: python benchmarks/planner.py {{{','.join(COMMANDS)}}} [options]\n{given}"
              f"choose a subcommand (python benchmarks/planner.py COMMAND --help for its options)",
              file=sys.stderr if given or not argv else sys.stdout)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    importlib.import_module(f"planner_bench.{argv[0]}").main(argv[1:], prog=f"planner.py {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
