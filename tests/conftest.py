"""Shared test configuration: CUDA tests skip with a reason on machines without a GPU."""
import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device, found none")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
