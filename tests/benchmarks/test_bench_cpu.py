"""python -m benchmarks --suite cpu: jax_impl's cpu kernel and xla path against torch SDPA,
ratios with their spread."""
import json

from benchmarks.__main__ import main


def test_cpu_suite_writes_ratios_against_torch_for_every_configuration(tmp_path):
    assert main(["--suite", "cpu", "--device", "cpu", "--seq-lens", "64", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_cpu.json").read_text())
    rows = {(r["implementation"], r["feature"], r["dtype"], r["causal"], r["length"], r["mode"]): r
            for r in report["rows"] if not r.get("matrix")}
    matrix = {(r["dtype"], r["head_dim"], r["mode"]): r for r in report["rows"] if r.get("matrix")}
    assert set(matrix) == {(dt, d, m) for dt in ("float32", "bfloat16") for d in (64, 128)
                           for m in ("fwd", "fwd+bwd")}
    for row in matrix.values():  # the fused kernel beside torch, with its FLOP rate
        assert row["implementation"] == "cpu" and row["causal"] and row["length"] == 64
        assert row["gflops"] > 0 and row["torch_gflops"] > 0
        assert abs(row["gflops"] / row["torch_gflops"] - row["torch_ms"] / row["jax_ms"]) < 1e-6
    assert set(report["features"]) >= {"avx512_bf16", "amx_bf16", "avx512_fp16"}
    plain = {(impl, None, dt, c, 64, m) for impl in ("cpu", "xla") for dt in ("float32", "bfloat16")
             for c in (False, True) for m in ("fwd", "fwd+bwd")}
    features = {(impl, f, "float32", False, 64, m) for impl in ("cpu", "xla")
                for f in ("bias", "mask", "dropout", "soft_cap", "sinks") for m in ("fwd", "fwd+bwd")}
    assert set(rows) == plain | features
    for (_, feature, dtype, _, _, _), row in rows.items():
        assert 0 < row["ratio_q1"] <= row["ratio_median"] <= row["ratio_q3"]
        assert row["jax_ms"] > 0 and row["torch_ms"] > 0 and row["repeats"] >= 5
        assert row["torch_has_feature"] == (feature not in ("soft_cap", "sinks"))
        if feature in (None, "bias", "mask"):
            # the same attention as torch computes: a wrong call (no mask, no scale) is off by O(1)
            assert row["max_abs_diff_vs_torch"] < (1e-4 if dtype == "float32" else 0.1)
    assert len(report["load_average_start"]) == 3 and len(report["load_average_end"]) == 3
    markdown = (tmp_path / "bench_cpu.md").read_text()
    assert "| cpu | - | bfloat16 | yes | 64 | fwd+bwd |" in markdown
    assert "| cpu | bias | float32 | no | 64 | fwd |" in markdown
    assert "| xla | sinks (torch: plain call) | float32 | no | 64 | fwd |" in markdown
    assert "## The fused kernel on the matrix units (B=1 H=8 L=64, causal)" in markdown
    assert "| bfloat16 | 128 | fwd+bwd |" in markdown
