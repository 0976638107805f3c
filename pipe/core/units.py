"""Sizes in bytes as people write them (``"2GiB"``, ``"512MB"``, ``1.5e9``) and as the planner prints them."""
from __future__ import annotations

import math
import re
from typing import Union

__all__: list[str] = []  # public through pipe.plan (format_bytes, parse_bytes)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}



def parse_bytes(value: Union[int, float, str]) -> int:
    """Bytes from ``2GiB``, ``512MB``, ``1.5e9`` or a number.

    Raises:
        ValueError: not a positive size; the message shows the accepted forms.
    """
    if isinstance(value, bool):
        raise ValueError(f"memory budget must be a size such as '2GiB' or a number of bytes, got {value!r}")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise ValueError(f"cannot read memory budget {value!r}; write a number of bytes or a size "
                             f"such as '2GiB', '512MiB' or '1.5GB'")
        number = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"memory budget must be positive and finite, got {value!r}")
    return int(number)


def format_bytes(value: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{int(value)} B"
