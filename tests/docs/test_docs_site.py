"""The documentation site: it builds with warnings as errors, its internal links resolve, and
its pages state the present once (no issue numbers, no dated figures, a size budget).

The built pages are checked by parsing their HTML with the standard library: every internal
``href``/``src`` must name a file of the build, and every ``#fragment`` an ``id`` on the target
page. No headless browser is available in CI, so scripts are not run; the site is static HTML
(the furo theme's JavaScript only adds navigation).
"""
from __future__ import annotations

import html.parser
import importlib.util
import re
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BUILD_TOOLS = ("sphinx", "myst_parser", "furo")


def hand_written_pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    missing = [name for name in BUILD_TOOLS if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"the docs build needs {', '.join(missing)}: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(out / "doctrees"), str(DOCS), str(out / "html")],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"sphinx-build -W failed:\n{proc.stderr[-6000:]}"
    return out / "html"


class _Page(html.parser.HTMLParser):
    """The ids a page defines and the internal links it makes."""

    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in ("id", "name"):
            if attrs.get(name):
                self.ids.add(attrs[name])
        for name in ("href", "src"):
            target = attrs.get(name)
            if target and not urllib.parse.urlsplit(target).scheme and not target.startswith("//"):
                self.links.append(target)


def parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def broken_links(html_root: Path) -> list[str]:
    """``page: link (why)`` for every internal link of the built site that does not resolve."""
    pages = {p: parse(p) for p in html_root.rglob("*.html")}
    broken = []
    for path, page in pages.items():
        for link in page.links:
            parts = urllib.parse.urlsplit(link)  # a query (?v=...) names no file
            target, fragment = urllib.parse.unquote(parts.path), urllib.parse.unquote(parts.fragment)
            file = (path.parent / target).resolve() if target else path
            if not file.is_file():
                broken.append(f"{path.relative_to(html_root)}: {link} (no such file)")
            elif fragment and file.suffix == ".html":
                ids = pages[file].ids if file in pages else parse(file).ids
                if fragment not in ids:
                    broken.append(f"{path.relative_to(html_root)}: {link} (no anchor)")
    return broken


def test_site_builds_and_every_internal_link_resolves(site):
    assert (site / "api.html").is_file() and (site / "results.html").is_file()
    assert broken_links(site) == []


def test_the_api_reference_documents_every_public_name(site):
    text = (site / "api.html").read_text(encoding="utf-8")
    for name in ("jax_impl.flash_attention.flash_attention", "jax_impl.flash_attention.explain_implementation",
                 "jax_impl.context_parallel.ring_attention", "jax_impl.context_parallel.ulysses_attention",
                 "jax_impl.context_parallel.hybrid_attention", "jax_impl.kv_cache.append",
                 "jax_impl.block_mask.create_block_mask", "jax_impl.block_mask.BlockMask",
                 "conformance.plugins.load_plugin", "conformance.NotSupported"):
        assert f'id="{name}"' in text, name


def test_flash_attention_docstring_names_every_argument():
    import inspect

    from jax_impl.flash_attention import flash_attention

    doc = inspect.getdoc(flash_attention)
    undocumented = [name for name in inspect.signature(flash_attention).parameters
                    if not re.search(rf"^\s+{name}:", doc, flags=re.M)]
    assert undocumented == []


def test_the_link_check_catches_a_missing_page_and_a_missing_anchor(tmp_path):
    (tmp_path / "a.html").write_text('<h1 id="top">A</h1><a href="b.html#gone">b</a>'
                                     '<a href="missing.html">m</a><a href="#top">t</a>'
                                     '<a href="https://example.com/x">x</a>')
    (tmp_path / "b.html").write_text('<p id="here">B</p>')
    assert broken_links(tmp_path) == ["a.html: b.html#gone (no anchor)",
                                      "a.html: missing.html (no such file)"]


ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+|(?<![\w&/#])#\d+\b", re.I)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
LINK_TARGET = re.compile(r"\]\([^)]*\)")


def history_lines(path: Path) -> list[str]:
    """Lines that name an issue number or a date, a figure's "Data:" caption included (the data
    file keeps its date); link targets (file names) are not read."""
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        prose = LINK_TARGET.sub("]()", line)
        if ISSUE_NUMBER.search(prose) or DATE.search(prose):
            found.append(f"{path.name}:{number}: {line.strip()}")
    return found


def test_pages_name_no_issue_number_and_no_dated_figure():
    assert [line for page in [*hand_written_pages(), ROOT / "README.md"]
            for line in history_lines(page)] == []


def test_history_check_catches_issue_numbers_and_dates(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("Fixed in issue 45.\nSee #41.\n12 bytes until 2026-12-02.\n"
                    "Data: [x](run_2026-12-01.json): an H200, measured 2026-11-30.\n"
                    "[file](decode_2026-12-01_run1.md) and `#include` and &#39;\n")
    assert [line.split(":")[1] for line in history_lines(page)] == ["1", "2", "3", "4"]


def test_hand_written_pages_stay_within_their_budget():
    sizes = {p.relative_to(DOCS).as_posix(): len(p.read_bytes()) for p in hand_written_pages()}
    assert sum(sizes.values()) <= 60_000, sizes
    assert sizes["limitations.md"] <= 12_000 and sizes["design.md"] <= 20_000, sizes
