"""python -m benchmarks writes the table, CSV, JSON, Markdown and plots with the expected columns."""
import csv
import json

import pytest

from benchmarks.__main__ import main

EXPECTED_COLUMNS = {
    "impl", "framework", "device", "mode", "dtype", "batch", "heads", "q_len", "kv_len", "head_dim", "causal",
    "status", "reason", "flops", "median_ms", "q1_ms", "q3_ms", "min_ms", "max_ms", "repeats", "input_sets",
    "first_call_ms", "prepare_s", "flop_per_s", "speedup_vs_manual", "check_worst_ratio", "score_tensor_bytes",
    "jax_temp_bytes", "jax_peak_extra_bytes", "torch_peak_extra_bytes", "rss_peak_extra_bytes", "sdpa_backend",
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = main(["--suite", "quick", "--device", "cpu", "--seq-lens", "32,64", "--heads", "1", "--repeats", "3",
                 "--impl", "jax_impl.xla", "--impl", "jax.dense", "--impl", "torch.manual", "--out", str(out)])
    assert code == 0
    return out


def test_files_are_written(outputs):
    names = {p.name for p in outputs.iterdir()}
    for n in ("bench_quick.csv", "bench_quick.json", "bench_quick.md", "bench_quick_time.png",
              "bench_quick_speedup.png", "bench_quick_memory.png"):
        assert n in names
        assert (outputs / n).stat().st_size > 0


def test_csv_has_the_columns_and_one_row_per_measurement(outputs):
    with open(outputs / "bench_quick.csv") as f:
        rows = list(csv.DictReader(f))
    assert EXPECTED_COLUMNS <= set(rows[0])
    assert len(rows) == 2 * 2 * 3  # L x modes x implementations
    assert {r["mode"] for r in rows} == {"fwd", "fwd+bwd"}
    for r in rows:
        assert r["status"] == "ok", r
        assert float(r["q1_ms"]) <= float(r["median_ms"]) <= float(r["q3_ms"])
        assert float(r["min_ms"]) <= float(r["q1_ms"]) and float(r["q3_ms"]) <= float(r["max_ms"])
        assert float(r["flops"]) == pytest.approx(4 * 1 * 1 * int(r["q_len"]) ** 2 * 64 *
                                                  (3.5 if r["mode"] == "fwd+bwd" else 1))
        if r["framework"] == "jax":
            assert int(r["jax_temp_bytes"]) >= 0
        else:
            assert r["jax_temp_bytes"] == ""


def test_json_has_environment_and_every_figure(outputs):
    doc = json.loads((outputs / "bench_quick.json").read_text())
    env = doc["environment"]
    for key in ("python", "jax", "torch", "numpy", "device_name", "cpu_model", "cpu_count", "torch_threads"):
        assert key in env
    assert len(doc["rows"]) == 12
    assert EXPECTED_COLUMNS <= set(doc["rows"][0])
    manual = [r for r in doc["rows"] if r["impl"] == "torch.manual"]
    assert all(r["speedup_vs_manual"] == pytest.approx(1.0) for r in manual)
    assert doc["theory_score_tensor_course"][0]["float16"] == 32 * 2 ** 20


def test_markdown_has_tables_and_plot_links(outputs):
    md = (outputs / "bench_quick.md").read_text()
    assert "| L " in md and "torch.manual" in md and "jax_impl.xla" in md
    assert "bench_quick_time.png" in md
    assert "32 MiB" in md and "1 GiB" in md  # theory table
