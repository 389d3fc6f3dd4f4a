"""Sphinx configuration: the site is built from this folder, offline (no intersphinx).

    python3 -m pip install -e ".[docs]" && python3 -m sphinx -W --keep-going -b html docs docs/_build/html
"""
import os
import re
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


# A page links a file outside docs/ (a data file, a README beside the reports) by its plain
# relative path, as GitHub reads it; Sphinx would take a ``.md`` target for a page of the site,
# so such a link becomes a download of the file (MyST's ``path:`` form).
_RELATIVE_MD_LINK = re.compile(r"\]\((?![a-z]+:)([^)#\s]+\.md)\)")


def _outside_md_as_download(app, docname, source):
    page_dir = os.path.dirname(os.path.join(app.srcdir, docname))

    def link(match):
        target = os.path.normpath(os.path.join(page_dir, match.group(1)))
        inside = os.path.commonpath([target, str(app.srcdir)]) == str(app.srcdir)
        return match.group(0) if inside else f"](path:{match.group(1)})"

    source[0] = _RELATIVE_MD_LINK.sub(link, source[0])


def setup(app):
    app.connect("source-read", _outside_md_as_download)
