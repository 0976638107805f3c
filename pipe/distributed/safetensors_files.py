"""Reads and writes slices of tensors in safetensors files, in place, without the rest of the file.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{key: {"dtype", "shape", "data_offsets"}}``) and the tensors' bytes, each
contiguous in row-major order. The slice of a tensor that one rank holds (a
``DTensor``'s local shard, at its global offset) is therefore a set of
contiguous byte runs: one run for a shard along dimension 0, one per row for
a shard along dimension 1. :func:`read_into` reads exactly those bytes (into
the destination's own memory when the dtypes agree, with no copy), and
:func:`write_slice` writes them at their place in a file whose header
:func:`create` has written: every rank writes its own slices of one file,
nobody assembles a whole tensor (:mod:`pipe.distributed.hf`).
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import Tensor

__all__: list[str] = []

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass(frozen=True)
class Entry:
    """Where one tensor's bytes are: ``file``, from byte ``start``, of ``dtype`` and ``shape``."""

    file: str
    start: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_header(file: str) -> dict[str, Entry]:
    """The tensors of one safetensors file (its header only is read)."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    entries = {}
    for key, value in header.items():
        if key == "__metadata__":
            continue
        if value["dtype"] not in DTYPES:
            raise ValueError(f"{file}: tensor {key!r} has dtype {value['dtype']}, which this reader does not know "
                             f"(known: {', '.join(DTYPES)})")
        entries[key] = Entry(file, 8 + length + value["data_offsets"][0], DTYPES[value["dtype"]], tuple(value["shape"]))
    return entries


def directory(path: str) -> dict[str, Entry]:
    """Every tensor of a HuggingFace model directory: ``model.safetensors``, or the shards its index names.

    Raises:
        FileNotFoundError: no such directory, or no safetensors weights in it.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no HuggingFace model directory at {path!r}; pass the folder that "
                                f"save_pretrained (or pipe.distributed.hf.save) wrote")
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, SINGLE)):
        files = [SINGLE]
    else:
        present = sorted(os.listdir(path))
        raise FileNotFoundError(
            f"{path!r} has neither {SINGLE} nor {INDEX} (it holds {present[:8]}); pytorch_model.bin "
            "checkpoints are not read: convert them with save_pretrained(..., safe_serialization=True)")
    entries: dict[str, Entry] = {}
    for name in files:
        entries.update(read_header(os.path.join(path, name)))
    return entries


def runs(shape: Sequence[int], offset: Sequence[int], local: Sequence[int]) -> Iterator[tuple[int, int]]:
    """``(element offset in the whole tensor, elements)`` of the contiguous runs of a slice, in its order."""
    if math.prod(local) == 0:
        return
    # The trailing dimensions the slice covers whole are contiguous with the first one it cuts.
    cut = len(shape)
    while cut > 0 and local[cut - 1] == shape[cut - 1]:
        cut -= 1
    if cut == 0:
        yield 0, math.prod(shape)
        return
    inner = math.prod(shape[cut:])
    length = local[cut - 1] * inner
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    for index in _indices(local[:cut - 1]):
        start = sum((offset[d] + i) * strides[d] for d, i in enumerate(index)) + offset[cut - 1] * strides[cut - 1]
        yield start, length


def _indices(extents: Sequence[int]) -> Iterator[tuple[int, ...]]:
    if not extents:
        yield ()
        return
    for first in range(extents[0]):
        for rest in _indices(extents[1:]):
            yield (first, *rest)


def _bytes(tensor: Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor, as bytes."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def read_into(entry: Entry, offset: Sequence[int], target: Tensor) -> int:
    """Reads the slice of ``entry`` at ``offset`` (``target``'s shape) into ``target``; returns the bytes read.

    Converts the dtype; reads straight into ``target`` when it is a contiguous
    CPU tensor of the stored dtype.
    """
    direct = target.device.type == "cpu" and target.dtype == entry.dtype and target.is_contiguous()
    buffer = target if direct else torch.empty(target.shape, dtype=entry.dtype)
    memory = _bytes(buffer) if buffer.numel() else memoryview(b"")
    size = entry.dtype.itemsize
    done = 0
    with open(entry.file, "rb", buffering=0) as f:
        for start, count in runs(entry.shape, offset, tuple(target.shape)):
            view, position = memory[done:done + count * size], entry.start + start * size
            while len(view):
                got = os.preadv(f.fileno(), [view], position)
                if got <= 0:
                    raise OSError(f"{entry.file}: file ends before the tensor's bytes (truncated?)")
                view, position = view[got:], position + got
            done += count * size
    if not direct:
        with torch.no_grad():
            target.copy_(buffer)
    return done


def create(file: str, tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], write: bool = True
           ) -> dict[str, Entry]:
    """Where the tensors of a safetensors file holding ``tensors`` in this order are.

    With ``write``, writes the file's header and sizes the file; its data is left to fill.
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    position = 0
    for key, dtype, shape in tensors:
        size = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [position, position + size]}
        position += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    if write:
        with open(file, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)) + encoded)
            f.truncate(8 + len(encoded) + position)
    start = 8 + len(encoded)
    return {key: Entry(file, start + header[key]["data_offsets"][0], dtype, tuple(shape))  # type: ignore[index]
            for key, dtype, shape in tensors}


def write_slice(entry: Entry, offset: Sequence[int], local: Tensor, fd: int) -> int:
    """Writes ``local``, the slice of ``entry``'s tensor at ``offset``, into its file (open as ``fd``).

    Returns the bytes written. The caller syncs and closes the file.
    """
    data = local.detach().to("cpu", entry.dtype).contiguous()
    memory = _bytes(data) if data.numel() else memoryview(b"")
    size = entry.dtype.itemsize
    done = 0
    for start, count in runs(entry.shape, offset, tuple(local.shape)):
        view, position = memory[done:done + count * size], entry.start + start * size
        while len(view):
            written = os.pwrite(fd, view, position)
            view, position = view[written:], position + written
        done += count * size
    return done
