"""The heat map beside a conformance report: a cell's colour follows its worst error / tolerance
on a log scale around the bar; without matplotlib the run says so and leaves no picture."""
import math
import random
import sys

import pytest

from conformance import heatmap, report
from conformance.cases import get_suite
from conformance.harness import ERROR, FAIL, NOT_SUPPORTED, PASS, Result
from conformance.tolerance import Verdict

CASES = get_suite("quick")[:3]
IMPLS = ["jax_impl.cpu", "torch.sdpa.math", "tokamax"]
PNG = b"\x89PNG\r\n\x1a\n"


def judged(case: str, impl: str, ratio: float) -> Result:
    tolerance = random.uniform(1e-6, 1e-2)
    verdict = Verdict("out", ratio * tolerance, tolerance / 3, tolerance, ratio * 1e-3, ratio <= 1)
    return Result(case, impl, PASS if ratio <= 1 else FAIL, verdicts=[verdict])


def test_a_cells_place_on_the_scale_is_its_log_ratio_around_the_bar():
    at = lambda ratio: heatmap.position(judged("c", "i", ratio))
    assert at(1.0) == pytest.approx(0.5)
    assert at(10 ** heatmap.SPAN) == pytest.approx(1.0) and at(10 ** (heatmap.SPAN + 3)) == 1.0 and at(math.inf) == 1.0
    assert at(10 ** -heatmap.SPAN) == pytest.approx(0.0) and at(1e-12) == 0.0 and at(0.0) == 0.0
    ratios = sorted(10 ** random.uniform(-heatmap.SPAN, heatmap.SPAN) for _ in range(20))
    assert [at(r) for r in ratios] == sorted(at(r) for r in ratios)
    for status in (NOT_SUPPORTED, ERROR):
        assert heatmap.position(Result("c", "i", status, "why")) is None
    assert heatmap.position(None) is None


def test_a_failing_cell_is_red_a_passing_one_green_and_one_without_verdict_grey():
    pytest.importorskip("matplotlib")
    results = [judged(CASES[0].name, IMPLS[0], random.uniform(0.01, 0.2)),
               judged(CASES[0].name, IMPLS[1], random.uniform(5, 1e4)),
               Result(CASES[0].name, IMPLS[2], NOT_SUPPORTED, "no soft cap")]
    (green, red, grey), = heatmap.colours(results, [CASES[0].name], IMPLS)
    assert green[1] > green[0] and red[0] > red[1]
    assert grey == heatmap.NO_VERDICT


def _write(folder):
    results = [judged(c.name, i, 10 ** random.uniform(-2, 0.5)) for c in CASES for i in IMPLS[:2]]
    results += [Result(c.name, IMPLS[2], NOT_SUPPORTED, "no paged cache") for c in CASES]
    env = {"device": "cpu", "command": "python -m conformance"}
    return report.write(folder, results, [], CASES, IMPLS, env, "quick", 1.0, {}, 0)


def test_the_report_folder_gets_the_heat_map_and_the_report_shows_it(tmp_path):
    pytest.importorskip("matplotlib")
    md, _, picture = _write(tmp_path)
    assert picture == tmp_path / "conformance_quick_heatmap.png"
    assert picture.read_bytes()[:8] == PNG
    assert f"]({picture.name})" in md.read_text()


def test_without_matplotlib_the_run_says_so_and_leaves_no_picture(tmp_path, monkeypatch):
    (tmp_path / "conformance_quick_heatmap.png").write_bytes(PNG)  # an earlier run's
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    md, _, picture = _write(tmp_path)
    assert picture == heatmap.MISSING_MATPLOTLIB
    assert not (tmp_path / "conformance_quick_heatmap.png").exists()
    assert "heatmap" not in md.read_text()
