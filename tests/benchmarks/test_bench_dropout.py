"""python -m benchmarks --suite dropout: dropout 0.1 beside 0.0, ratios with their spread, each
variant running the dropout its name says."""
import json

import jax
import numpy as np
import pytest

from benchmarks import dropout_cost
from benchmarks.__main__ import main


def test_dropout_suite_writes_per_repeat_ratios_with_quartiles(tmp_path):
    assert main(["--suite", "dropout", "--device", "cpu", "--seq-lens", "64", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_dropout.json").read_text())
    assert report["shape"]["length"] == 64
    rows = {(r["mode"], r["variant"]): r for r in report["rows"]}
    assert set(rows) == {(mode, name) for mode in dropout_cost.MODES for name in dropout_cost.VARIANTS}
    for (mode, name), row in rows.items():
        # the ratio is the median of this variant's time over the dropout-free call's time of
        # the same repeat (not a ratio of medians): recomputed from the recorded times
        baseline = np.asarray(rows[mode, dropout_cost.BASELINE]["times_ms"])
        ratios = np.asarray(row["times_ms"]) / baseline
        assert len(ratios) == report["repeats"]
        rounding = 2 * 0.0005 / min(baseline.min(), min(row["times_ms"]))  # the times are kept to 1 us
        assert row["ratio_median"] == pytest.approx(np.median(ratios), rel=rounding)
        assert (row["ratio_q1"], row["ratio_q3"]) == pytest.approx(tuple(np.percentile(ratios, [25, 75])), rel=rounding)
        assert row["median_ms"] == pytest.approx(np.median(row["times_ms"]), rel=rounding)
    assert "| fwd+bwd | dropout 0.1 |" in (tmp_path / "bench_dropout.md").read_text()


def test_each_variant_runs_the_dropout_its_name_says():
    """Heads with equal inputs: without dropout their outputs are equal; Flax's default pattern
    (shared over batch and heads) keeps them equal and changes them; a pattern per head makes
    them differ."""
    rng = np.random.default_rng()
    q, k, v = (np.repeat(rng.standard_normal((1, 32, 1, 16)), 4, axis=2).astype(np.float32) for _ in range(3))
    key = jax.random.key(int(rng.integers(2 ** 31)))
    out = {name: np.asarray(dropout_cost._compiled(kw)["fwd"](q, k, v, key))
           for name, kw in dropout_cost.VARIANTS.items()}
    heads_equal = lambda x: all(np.array_equal(x[:, :, 0], x[:, :, h]) for h in range(1, x.shape[2]))
    plain, shared, per_head = out.values()
    assert heads_equal(plain) and heads_equal(shared) and not np.allclose(shared, plain)
    assert not heads_equal(per_head)
