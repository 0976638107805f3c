"""The API reference (docs/api, Sphinx autodoc + napoleon) lists the public surface and builds without warnings.

The public surface is ``pipe.__all__`` and the ``__all__`` of each public subpackage (plus the
checkpoint functions of ``pipe.distributed.state``). The build runs with ``-W``: a docstring that
docutils cannot read, or a reference page naming what does not exist, fails this test.
"""
from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api"
PUBLIC = ["pipe", "pipe.distributed", "pipe.balance", "pipe.skip", "pipe.recompute", "pipe.batchnorm",
          "pipe.trace", "pipe.viz", "pipe.plan", "pipe.distributed.hf"]
_DIRECTIVE = re.compile(r"^\.\. (?:auto(?:class|function|data|exception)|py:data)::\s+([\w.]+)", re.M)


def _documented() -> set[str]:
    return {name for page in API.glob("*.rst") for name in _DIRECTIVE.findall(page.read_text())}


def test_reference_lists_every_public_name() -> None:
    documented = _documented()
    pages = {page.stem for page in API.glob("*.rst")}
    missing = []
    for module_name in PUBLIC:
        assert module_name in pages, f"docs/api/{module_name}.rst is missing"
        module = importlib.import_module(module_name)
        for name in module.__all__:
            if inspect.ismodule(getattr(module, name)):
                assert f"{module_name}.{name}" in pages, f"subpackage {module_name}.{name} has no page"
            elif f"{module_name}.{name}" not in documented:
                missing.append(f"{module_name}.{name}")
    assert not missing, f"public names missing from docs/api/*.rst: {missing}"
    extra = [name for name in documented
             if name.rsplit(".", 1)[0] in PUBLIC
             and name.rsplit(".", 1)[1] not in importlib.import_module(name.rsplit(".", 1)[0]).__all__]
    assert not extra, f"docs/api lists names that are not in their module's __all__: {extra}"


@pytest.mark.slow
def test_reference_builds_without_warnings(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q", "-b", "html",
                           str(API), str(tmp_path / "html")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"sphinx-build -W failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    assert (tmp_path / "html" / "pipe.distributed.html").read_text().count("eval_step") > 0
