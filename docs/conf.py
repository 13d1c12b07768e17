"""Sphinx configuration: ``sphinx-build -W docs docs/_build`` (the ``docs`` extra)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "docs" / "_ext")]

project = "dask-lcicomm"
author = "the dask-lcicomm developers"
extensions = ["myst_parser", "lci_docs"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "results/*.json"]
myst_heading_anchors = 3
html_theme = "pydata_sphinx_theme"
html_title = "dask-lcicomm"
html_theme_options = {"navigation_depth": 2}
