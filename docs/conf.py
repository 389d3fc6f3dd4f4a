"""Sphinx configuration: the site is built from this folder, offline (no intersphinx).

    python3 -m pip install -e ".[docs]" && python3 -m sphinx -W --keep-going -b html docs docs/_build/html
"""
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)  # document this checkout, not an installed copy

project = "jax-flash-attention-ref"
author = "jax-flash-attention-ref authors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3  # "page.md#a-heading" links resolve, as on GitHub

# The docstrings are Google style; their argument groups are sections of their own.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_param = False
napoleon_use_rtype = False
napoleon_custom_sections = [(name, "params_style") for name in (
    "Additions", "Programmable attention", "Paged KV cache", "Flax keywords")]
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the docstrings say each argument's type and shape

html_theme = "furo"
html_title = "jax-flash-attention-ref"
html_static_path: list[str] = []
