"""Shared test configuration: CUDA tests skip with a reason on machines without a GPU; the planner's
per-machine cache (the transport's and the thread runner's measured costs) lives in a folder of the test
session, so that measurements taken under the suite's load never land in the user's cache."""
import os
from typing import Iterator

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device, found none")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _planner_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    before = os.environ.get("PIPE_CACHE_DIR")
    os.environ["PIPE_CACHE_DIR"] = str(tmp_path_factory.mktemp("pipe-cache"))
    yield
    if before is None:
        os.environ.pop("PIPE_CACHE_DIR", None)
    else:
        os.environ["PIPE_CACHE_DIR"] = before
