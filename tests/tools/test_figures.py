"""The conformance figures of README.md and docs/results.md are the committed reports' counts
(tools/figures.py writes them), and the pages outside docs/ link files that exist."""
import random
import re
from pathlib import Path

import pytest

from tools import figures

ROOT = Path(__file__).resolve().parents[2]


def test_every_published_block_holds_what_the_committed_reports_give():
    assert figures.stale() == []


def test_a_count_the_reports_do_not_hold_is_stale(tmp_path):
    wanted = figures.blocks()
    (page, name), body = random.choice(list(wanted.items()))
    copy = tmp_path / page.name
    copy.write_text(figures.rewrite(page.read_text(), name, body))
    assert figures.stale({(copy, name): body}) == []
    numbers = [m for m in re.finditer(r"\b\d+\b", body)]
    m = random.choice(numbers)
    altered = body[:m.start()] + str(int(m.group()) + 1) + body[m.end():]
    copy.write_text(figures.rewrite(page.read_text(), name, altered))
    assert figures.stale({(copy, name): body}) == [f"{copy}: {name}"]


def test_the_cpu_table_counts_each_implementations_results():
    report = figures.load(figures.CPU_REPORT)
    rows = {line.split("|")[1].strip(" `"): line.split("|")[2].strip()
            for line in figures.cpu_table(report).splitlines() if line.startswith("| `")}
    for impl in figures.implementations(report):
        mine = [r["status"] for r in report["results"] if r["impl"] == impl]
        assert rows[impl] == f"{mine.count('pass')} / {mine.count('FAIL') + mine.count('error')} / {mine.count('n.s.')}"
    assert len(rows) == len(report["summary"])


def test_a_caption_names_no_date_though_its_report_has_one():
    assert "date" in figures.load(figures.CPU_REPORT)["environment"]
    text = "".join(figures.blocks().values())
    assert "Data:" in text and re.search(r"\b20\d\d-\d\d-\d\d\b", text) is None


def test_a_page_without_its_block_is_refused():
    with pytest.raises(ValueError, match="conformance-cpu"):
        figures.rewrite("no block here\n", "conformance-cpu", "x")


LINK = re.compile(r"\]\((?![a-z]+:)([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", ["README.md", "benchmarks/README.md", "benchmarks/results/README.md",
                                  "conformance/README.md", "CHANGELOG.md"])
def test_every_relative_link_names_a_file(page):
    path = ROOT / page
    missing = [target for target in LINK.findall(path.read_text()) if not (path.parent / target).exists()]
    assert missing == []
