"""The entry point of :func:`pipe.plan.link.measure_link`'s two processes (``python -m pipe.plan.link_peer``).

Usage: ``python -m pipe.plan.link_peer RANK PORT SIZES REPEATS OUT``: runs
:func:`pipe.plan.link.peer` and pickles its result (timings, or an error
message) into the file ``OUT``.
"""
from __future__ import annotations

import pickle
import sys

from pipe.plan.link import peer

__all__: list[str] = []


def main(argv: list[str]) -> None:
    rank, port, sizes, repeats, out = argv
    result = peer(int(rank), int(port), [int(size) for size in sizes.split(",")], int(repeats))
    with open(out + ".tmp", "wb") as file:
        pickle.dump(result, file)
    import os

    os.replace(out + ".tmp", out)  # whole or absent: the parent reads it only once the process has ended


if __name__ == "__main__":
    main(sys.argv[1:])
