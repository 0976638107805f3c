"""FSDP on the CPU says once when its gathers would take huge pages for the asking (THP_MEM_ALLOC_ENABLE)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pipe.distributed import fsdp

BIG = fsdp.HUGE_PAGE_UNIT_BYTES


@pytest.fixture()
def kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    monkeypatch.setattr(fsdp, "THP_MODE_FILE", str(mode))
    monkeypatch.setattr(fsdp, "_huge_pages_advised", False)
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    return mode


def test_large_cpu_units_without_huge_pages_are_named_once(kernel: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pipe.distributed.fsdp"):
        assert fsdp.advise_huge_pages("cpu", BIG)
        assert not fsdp.advise_huge_pages("cpu", 2 * BIG)  # once per process
    [record] = caplog.records
    assert "THP_MEM_ALLOC_ENABLE=1" in record.getMessage() and "32.00 MiB" in record.getMessage()


@pytest.mark.parametrize("case", ["asked", "always", "never", "no file", "small", "cuda"])
def test_nothing_is_said_where_huge_pages_are_in_use_or_of_no_help(kernel: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture,
                                                                     case: str) -> None:
    device, largest = "cpu", BIG
    if case == "asked":
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    elif case in ("always", "never"):
        kernel.write_text({"always": "[always] madvise never\n", "never": "always madvise [never]\n"}[case])
    elif case == "no file":
        kernel.unlink()
    elif case == "small":
        largest = BIG - 1
    else:
        device = "cuda"
    with caplog.at_level(logging.WARNING, logger="pipe.distributed.fsdp"):
        assert not fsdp.advise_huge_pages(device, largest)
    assert not caplog.records
