"""``--suite decode`` on one tiny point: every row is timed, the paged and decode outputs agree
with the default path, and the report has its columns."""
from __future__ import annotations

import json

from benchmarks import decode, suites


def test_decode_suite_runs_one_point(tmp_path, monkeypatch):
    assert suites.get_suite("decode").runner == "benchmarks.decode"
    monkeypatch.setitem(decode.GRIDS, "cpu", ((1,), (512,), (1,), ("float32",)))
    monkeypatch.setattr(decode, "_repeats", lambda device, cache_bytes: 2)
    paths = decode.run_suite(tmp_path, "cpu")
    result = json.loads(paths[0].read_text())
    (point,) = result["points"]
    rows = {r["impl"]: r for r in point["rows"]}
    assert {"jax_impl default (dense)", "jax_impl xla decode (dense)", "jax_impl paged (16)",
            "jax_impl paged (64)", "streaming read of K and V"} <= set(rows)
    for name in ("jax_impl xla decode (dense)", "jax_impl paged (16)", "jax_impl paged (64)"):
        assert rows[name]["max_abs_diff_to_default"] < 1e-5
        assert rows[name]["gb_per_s"] > 0 and rows[name]["fraction_of_stream"] > 0
    assert "of stream" in paths[1].read_text()


def test_shuffled_interleaving_varies_each_calls_predecessor():
    """A fixed or rotated order makes one call always follow the same one (and pay for what it
    leaves behind); shuffled, every call follows several others, and the order is seeded."""
    from benchmarks import measure

    def run(seed):
        sequence = []
        calls = {name: (lambda name=name: sequence.append(name)) for name in "abcd"}
        summary = measure.interleaved_ratios(calls, "a", 12, shuffle_seed=seed)
        assert all(len(row["times_ms"]) == 12 for row in summary.values())
        return sequence

    sequence = run(3)
    predecessors = {name: {before for before, after in zip(sequence, sequence[1:]) if after == name}
                    for name in "abcd"}
    assert all(len(p) >= 2 for p in predecessors.values()), predecessors
    assert run(3) == sequence and run(4) != sequence
