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


def test_interleaved_calls_are_spaced_by_the_settle_pause():
    """Each timed call starts at least ``settle_s`` after the previous one ended, so threads the
    previous call left spinning (torch's OpenMP pool) are idle by then; the pause is not timed."""
    import time

    from benchmarks import measure

    spans = []

    def call():
        start = time.perf_counter()
        sum(range(1000))
        spans.append((start, time.perf_counter()))

    settle = 0.01
    summary = measure.interleaved_ratios({"a": call, "b": call}, "a", 4, shuffle_seed=0, settle_s=settle)
    gaps = [later[0] - earlier[1] for earlier, later in zip(spans, spans[1:])]
    assert len(gaps) == 7 and min(gaps) >= settle, gaps
    assert max(row["median_ms"] for row in summary.values()) < 1e3 * settle  # the pause is not in the times


def test_the_settle_pause_is_for_cpu_runs_only(monkeypatch):
    """No pause by default on an accelerator (a device run's budget is minutes)."""
    import time

    import jax

    from benchmarks import measure

    pauses = []
    monkeypatch.setattr(time, "sleep", pauses.append)
    measure.interleaved_ratios({"a": lambda: None}, "a", 3)
    assert pauses == [measure.SETTLE_S] * 3
    pauses.clear()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    measure.interleaved_ratios({"a": lambda: None}, "a", 3)
    assert pauses == []
