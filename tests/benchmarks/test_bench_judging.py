"""A fast wrong implementation cannot win: it is flagged in every table and gets no speedup.
The correctness check runs on an exact (batch, head) slice of the oracle."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # bench_test_plugins, for module:function

from benchmarks import measure, report, suites  # noqa: E402
from benchmarks.__main__ import run  # noqa: E402
from conformance.cases import Case, Shape, make_inputs  # noqa: E402
from conformance.oracle import oracle  # noqa: E402
from conformance.registry import get_adapter, load_plugin  # noqa: E402


def _suite(seq_lens=(32, 48), heads=2, head_dim=16, modes=("fwd", "fwd+bwd"), seed_shift=0):
    return suites.Suite("test", "tiny", tuple(suites.grid(seq_lens, heads=heads, head_dims=(head_dim,), modes=modes)),
                        max_repeats=3, min_repeats=3, measure_budget_s=0.0, input_sets=2)


@pytest.fixture(scope="module")
def rows():
    adapters = [load_plugin("bench_test_plugins:forgotten_scale", device="cpu"),
                load_plugin("bench_test_plugins:correct", device="cpu"),
                get_adapter("torch.manual", "cpu")]
    rows, _, _ = run(_suite(), adapters, "cpu", progress=False)
    return rows


def test_forgotten_scale_is_wrong_and_has_no_speedup(rows):
    wrong = [r for r in rows if r.impl.endswith("forgotten_scale")]
    assert wrong and all(r.status == measure.WRONG for r in wrong)
    assert all(r.speedup_vs_manual is None for r in wrong)
    assert all(r.check_worst_ratio > 1 for r in wrong)
    assert all(r.median_ms is not None for r in wrong)  # timed, but flagged
    assert all("float64-oracle" in r.reason for r in wrong)


def test_correct_plugin_passes_and_gets_a_speedup(rows):
    good = [r for r in rows if r.impl.endswith(":correct")]
    assert good and all(r.status == measure.OK for r in good)
    assert all(r.speedup_vs_manual is not None and r.speedup_vs_manual > 0 for r in good)
    assert all(r.check_worst_ratio < 1 for r in good)
    manual = [r for r in rows if r.impl == "torch.manual"]
    assert all(r.speedup_vs_manual == pytest.approx(1.0) for r in manual)


def test_wrong_is_flagged_in_every_table(rows):
    terminal = report.terminal(rows, "cpu")
    assert "WRONG" in terminal
    for g, rs in report.groups(rows).items():
        pivot = report.pivot(rs, "cpu")
        col = pivot[0].index("bench_test_plugins:forgotten_scale")
        assert all("WRONG" in line[col] for line in pivot[1:])
        long = report.long_rows(rs, "cpu")
        wrong_lines = [line for line in long[1:] if line[1].endswith("forgotten_scale")]
        assert all(line[2] == "WRONG" and line[8] == "excluded" for line in wrong_lines)


def test_check_slice_is_an_exact_subproblem():
    # GQA, bias and a bool mask: the slice's oracle equals the full oracle's slice
    case = Case("slice", batch=2, q_heads=4, kv_heads=2, q_len=24, kv_len=40, head_dim=16, bias=True,
                mask="bool", causal="bottom_right", seed=11)
    inputs = make_inputs(case)
    assert np.abs(inputs.q).min() > 0
    full = oracle(inputs)
    sub = measure.check_slice(inputs)
    assert (sub.case.batch, sub.case.q_heads, sub.case.kv_heads) == (1, 2, 1)
    part = oracle(sub)
    sliced = measure.slice_values(full, case)
    for name in ("out", "dq", "dk", "dv", "dbias"):
        np.testing.assert_allclose(part[name], sliced[name], rtol=1e-12, atol=1e-12)


def test_pallas_interpret_is_not_timed_on_cpu_by_default():
    config = suites.Config(Shape(1, 1, 32, 16), None, "fwd")
    row = measure.measure(get_adapter("jax_impl.pallas_triton", "cpu"), config, None, measure.Options())
    assert row.status == measure.SKIPPED and "interpret" in row.reason
