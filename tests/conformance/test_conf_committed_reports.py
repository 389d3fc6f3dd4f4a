"""The committed reference reports are portable: no absolute path of the machine that wrote them."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REPORTS = sorted(p for folder in ("conformance/results", "benchmarks/results", "examples/results")
                 for p in (REPO / folder).rglob("*") if p.suffix in (".md", ".json", ".csv"))
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|root|home|tmp|usr|opt|Users)/|site-packages|[A-Z]:\\\\")


def test_there_are_committed_reports():
    assert {p.relative_to(REPO).parts[0] for p in REPORTS} == {"conformance", "benchmarks", "examples"}


@pytest.mark.parametrize("report", REPORTS, ids=lambda p: str(p.relative_to(REPO)))
def test_a_committed_report_holds_no_machine_paths(report):
    found = MACHINE_PATH.findall(report.read_text())
    assert not found, found[:3]


def test_report_writers_replace_this_machines_folders(tmp_path):
    """A report's command line names --out folders; the temporary folder is one (it leaked into
    the first GPU report before the writers replaced it)."""
    import os
    import tempfile
    from conformance.report import without_machine_paths
    command = f"python -m benchmarks --out {tempfile.gettempdir()}{os.sep}run1/benchmarks --out {Path.home()}/x"
    cleaned = without_machine_paths(command)
    assert not MACHINE_PATH.findall(cleaned), cleaned
    assert "<tmp>/run1/benchmarks" in cleaned
