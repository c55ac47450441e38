"""Sphinx configuration: `python -m sphinx -W -b html docs docs/_build` (tests/run.sh runs it)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # autodoc documents this checkout, whatever is installed

project = "slurmrun"
author = "the slurmrun authors"
copyright = "the slurmrun authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "requirements.txt"]

# MyST: `#` heading anchors for [text](page.md#anchor) links; `:::` fences for directives.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

# autodoc: signatures from the type hints, descriptions from Google docstrings.
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_class_signature = "separated"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True
nitpicky = False

html_theme = "furo"
html_title = "slurmrun"
html_static_path: list[str] = []
html_show_sourcelink = False
