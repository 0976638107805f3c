"""The fenced code blocks of README.md and docs/*.md, read by the docs' convention.

The convention (docs/index.md states it for readers):

* ```` ```python ````: a complete program that runs as written in a fresh directory;
* ```` ```python continued ````: runs appended to the earlier runnable blocks of the same file;
* ```` ```python torchrun ```` / ```` ```python torchrun=4 ````: a complete script run under
  ``torchrun --nproc-per-node 2`` (or 4), gloo on the CPU;
* ```` ```python fragment ````: not run (a signature, a sketch with placeholders).

Blocks in other languages (``bash``, ``yaml``, ``text``) and bare fences are not run.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
KINDS = ("run", "continued", "torchrun", "fragment")


@dataclass
class Block:
    path: Path
    line: int          # 1-based line of the opening fence
    lang: str
    kind: str          # one of KINDS for python blocks, "" otherwise
    nproc: int         # ranks for torchrun blocks
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    """README.md and every page under docs/ (new pages are picked up without a change here)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def _parse_info(info: str, where: str) -> tuple[str, str, int]:
    words = info.split()
    if not words:
        return "", "", 0
    lang, flags = words[0], words[1:]
    if lang != "python":
        return lang, "", 0
    if not flags:
        return lang, "run", 0
    if len(flags) > 1:
        raise ValueError(f"{where}: a python block takes one marker, got {flags}")
    flag = flags[0]
    if flag in ("continued", "fragment"):
        return lang, flag, 0
    match = re.fullmatch(r"torchrun(?:=(\d+))?", flag)
    if match:
        return lang, "torchrun", int(match.group(1) or 2)
    raise ValueError(f"{where}: unknown python block marker {flag!r}; use one of "
                     "continued, torchrun, torchrun=N, fragment")


def blocks(path: Path) -> list[Block]:
    """Every fenced block of one markdown file, with its indentation removed."""
    found: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence = match.group("indent"), match.group("fence")
        start = i
        lang, kind, nproc = _parse_info(match.group("info").strip(), f"{path}:{i + 1}")
        body: list[str] = []
        i += 1
        while i < len(lines):
            close = lines[i].strip()
            if close.startswith(fence[0] * len(fence)) and close.strip(fence[0]) == "":
                break
            line = lines[i]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            i += 1
        found.append(Block(path, start + 1, lang, kind, nproc, "\n".join(body) + "\n"))
        i += 1
    return found


def all_blocks() -> list[Block]:
    return [block for path in doc_files() for block in blocks(path)]


def program(block: Block, in_file: list[Block]) -> str:
    """The source that runs for a block: a ``continued`` block gets every earlier runnable block first."""
    if block.kind != "continued":
        return block.code
    parts = [f"# --- {b.name}\n{b.code}" for b in in_file
             if b.line < block.line and b.kind in ("run", "continued")]
    if not any(b.kind == "run" for b in in_file if b.line < block.line):
        raise ValueError(f"{block.name}: a 'continued' block with no runnable block before it")
    return "\n".join(parts + [f"# --- {block.name}\n{block.code}"])
