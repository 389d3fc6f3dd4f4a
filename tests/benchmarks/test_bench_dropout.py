"""python -m benchmarks --suite dropout: dropout 0.1 beside 0.0, ratios with their spread."""
import json

from benchmarks.__main__ import main


def test_dropout_suite_writes_ratios_with_quartiles(tmp_path):
    assert main(["--suite", "dropout", "--device", "cpu", "--seq-lens", "64", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_dropout.json").read_text())
    assert report["shape"]["length"] == 64
    rows = {(r["mode"], r["variant"]): r for r in report["rows"]}
    assert {mode for mode, _ in rows} == {"fwd", "fwd+bwd"} and len(rows) == 6
    for row in rows.values():
        assert 0 < row["ratio_q1"] <= row["ratio_median"] <= row["ratio_q3"]
        assert row["median_ms"] > 0
    assert all(rows[mode, "dropout 0.0"]["ratio_median"] == 1.0 for mode in ("fwd", "fwd+bwd"))
    assert "| fwd+bwd | dropout 0.1 |" in (tmp_path / "bench_dropout.md").read_text()
