"""The package type-checks: pipe/ is annotated and mypy (setup.cfg [mypy]) holds it to that."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_mypy_passes_on_the_package(tmp_path):
    pytest.importorskip("mypy", reason="mypy is not installed (pip install -e .[test] installs it)")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "pipe"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
