"""pipe.core.options: front-end argument checks word errors in the front end's arguments."""
from __future__ import annotations

import re

import pytest

from pipe.core.options import pipeline_schedule
from pipe.core.schedule import Schedule


@pytest.mark.parametrize(("args", "message"), [
    (("interleaved", 2, 3, 2),
     "schedule='interleaved' needs chunks divisible by the pipeline ranks (got chunks=3, 2 pipeline ranks): "
     "each rank takes the micro-batches in groups of 2; use chunks=2 or chunks=4"),
    (("interleaved", 4, 1, 2), "use chunks=4 or chunks=8"),
    (("round-robin", 2, 2, 1), "unknown schedule 'round-robin'; expected one of 'gpipe', '1f1b', 'interleaved'"),
    (("1f1b", 2, 4, 2), "virtual_stages=2 needs schedule='interleaved'"),
])
def test_schedule_errors_name_the_front_end_arguments(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        pipeline_schedule(*args)
    assert "microbatches" not in str(info.value)


def test_pipeline_schedule_is_the_core_schedule() -> None:
    assert pipeline_schedule("interleaved", 2, 4, 2) == Schedule("interleaved", ranks=2, microbatches=4,
                                                                 virtual_stages=2)
