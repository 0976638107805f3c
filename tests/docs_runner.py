"""Runs the runnable python blocks of one docs page in this process (used by tests/test_docs.py).

Usage: ``python docs_runner.py BLOCKS.json`` where the file lists ``{"path", "line", "kind", "code"}``
in page order. Each ``run`` block executes in a fresh namespace (so a name it does not define or
import fails); a ``continued`` block executes in the namespace of every earlier block of the page.
Under torchrun (``torchrun`` blocks, of any page), every rank runs each block in a fresh namespace
and a directory of its own, all ranks in step: the process group the first block's
``init_from_env()`` creates is reused by the next (``init_from_env`` describes an existing one),
which saves a launch per block.
The code is compiled under the page's path with its own line numbers, so a traceback points into
the markdown. Prints one line per block; exits 1 at the first failure.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any


def main(spec: str) -> int:
    with open(spec) as handle:
        entries = json.load(handle)
    chain: dict[str, Any] = {}
    home = os.getcwd()
    for k, entry in enumerate(entries):
        source = "\n" * entry["line"] + entry["code"]  # the code starts on the line after the fence
        code = compile(source, entry["path"], "exec")
        if entry["kind"] in ("run", "torchrun"):
            namespace: dict[str, Any] = {"__name__": "__main__"}
        else:
            namespace = chain
        if entry["kind"] == "torchrun":
            os.chdir(home)
            os.makedirs(f"block{k}", exist_ok=True)
            os.chdir(f"block{k}")
        sys.argv = [entry["path"]]
        start = time.perf_counter()
        try:
            exec(code, namespace)
        except BaseException:  # report which block failed, with its traceback
            print(f"FAILED {entry['path']}:{entry['line']} ({entry['kind']})", flush=True)
            traceback.print_exc()
            return 1
        if entry["kind"] == "torchrun":
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()  # every rank ends this block before any starts the next
        print(f"ok {entry['path']}:{entry['line']} ({entry['kind']}) {time.perf_counter() - start:.1f}s", flush=True)
        chain.update(namespace)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
