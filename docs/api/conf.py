"""Sphinx configuration of the API reference (autodoc + napoleon over the docstrings).

Build: python -m sphinx -W -b html docs/api build/api   (then open build/api/index.html)
"""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import pipe  # noqa: E402

project = "pipe"
release = version = pipe.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"
exclude_patterns = ["_build"]
