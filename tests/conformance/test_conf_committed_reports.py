"""The committed reference reports hold what a fresh run gives (today's cases and implementations,
their summary that of their results) and are portable: no absolute path of the machine that
wrote them."""
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REPORTS = sorted(p for folder in ("conformance/results", "benchmarks/results", "examples/results")
                 for p in (REPO / folder).rglob("*") if p.suffix in (".md", ".json", ".csv"))
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|root|home|tmp|usr|opt|Users)/|site-packages|[A-Z]:\\\\")


CPU_REFERENCE = REPO / "conformance/results/cpu/conformance_quick.json"


def test_the_cpu_reference_report_runs_todays_cases_and_implementations():
    """What --update-reference writes on a CPU: every case of the quick suite as it is now, and
    every implementation a default CPU run attempts (those not installed where it ran are
    listed as such). A new case or implementation fails this until the report is regenerated."""
    from conformance import registry
    from conformance.cases import get_suite
    committed = json.loads(CPU_REFERENCE.read_text())
    assert [(c["name"], c["description"]) for c in committed["cases"]] == \
        [(c.name, c.describe()) for c in get_suite("quick")]
    attempted = [a.name for a in registry.adapters("cpu").values()
                 if "cpu" in a.devices and "cpu" not in a.on_request_only]
    not_installed = {name for name, why in committed["skipped_implementations"].items()
                     if why.startswith("not installed")}
    assert [name for name in attempted if name not in not_installed] == list(committed["summary"])


def test_a_committed_reports_summary_is_the_summary_of_its_results():
    from conformance import report
    from conformance.harness import Result
    from conformance.tolerance import Verdict
    for path in sorted((REPO / "conformance/results").rglob("conformance_*.json")):
        committed = json.loads(path.read_text())
        results = [Result(r["case"], r["impl"], r["status"], r["reason"],
                          [Verdict(v["name"], float(v["error"]), float(v["baseline_error"]), float(v["tolerance"]),
                                   float(v["relative_norm"]), v["passed"]) for v in r["verdicts"]], note=r["note"])
                   for r in committed["results"]]
        fresh = report.summary(results, list(committed["summary"]))
        for impl, counts in committed["summary"].items():
            assert {k: counts[k] for k in ("pass", "FAIL", "n.s.", "error", "worst_case")} == \
                {k: fresh[impl][k] for k in ("pass", "FAIL", "n.s.", "error", "worst_case")}, (path.name, impl)
            assert counts["worst_ratio"] == pytest.approx(fresh[impl]["worst_ratio"]), (path.name, impl)


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
