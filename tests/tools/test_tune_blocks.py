"""The tile sweep writes the table that the heuristics read (table -> heuristics round trip)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from tools import tune_blocks
from jax_impl.config import BlockSizes
from jax_impl.pallas_triton import heuristics
from jax_impl.pallas_triton.layout import Layout


def _row(head_dim, causal, blocks, median_ms, status="ok"):
    return dict(head_dim=head_dim, dtype="bfloat16", causal=causal, block_sizes=dataclasses.asdict(blocks),
                status=status, reason="", median_ms=median_ms, q1_ms=median_ms, q3_ms=median_ms, repeats=5,
                tflops=1.0)


@pytest.fixture
def use_table(monkeypatch):
    """Point the heuristics at another tuned_blocks.json for one test."""
    def use(path):
        monkeypatch.setattr(heuristics, "TUNED_BLOCKS_FILE", path)
        heuristics.tuned_block_sizes.cache_clear()
    yield use
    heuristics.tuned_block_sizes.cache_clear()


def test_fastest_correct_candidate_becomes_the_default(tmp_path, use_table):
    rule = heuristics.rule_block_sizes(64, "bfloat16")
    fast, wrong = tune_blocks.ALTERNATIVES[64][:2]
    rows = [_row(64, True, rule, 2.0), _row(64, True, fast, 1.5), _row(64, True, wrong, 0.5, status="WRONG")]
    path = tmp_path / "tuned_blocks.json"
    tune_blocks.write_table(path, rows, 4096, 8, "a GPU")
    assert heuristics.read_tuned_table(path) == {(64, "bfloat16", True): fast}
    use_table(path)
    assert heuristics.default_block_sizes(64, "bfloat16", causal=True) == fast
    assert heuristics.default_block_sizes(40, "bfloat16", causal=True) == fast  # same head-dim class
    # No entry: the rule (not causal; fp16; another head-dim class).
    assert heuristics.default_block_sizes(64, "bfloat16", causal=False) == rule
    assert heuristics.default_block_sizes(64, "float16", causal=True) == rule
    assert heuristics.default_block_sizes(128, "bfloat16", causal=True) == heuristics.rule_block_sizes(128, "bfloat16")
    # The kernels' layout takes it, clipped to the sequence as before.
    assert Layout.create(4096, 4096, 64, "bfloat16", None, causal=True).blocks == fast
    assert Layout.create(40, 4096, 64, "bfloat16", None, causal=True).blocks.block_q == 64


def test_candidates_start_with_the_rule_and_fit_shared_memory():
    for head_dim in tune_blocks.HEAD_DIMS:
        found = tune_blocks.candidates(head_dim, "bfloat16")
        assert found[0] == heuristics.rule_block_sizes(head_dim, "bfloat16") and len(found) >= 2
        for blocks in found:
            heuristics.check_shared_memory(head_dim, "bfloat16", blocks, blocks)


def test_dry_run_sweeps_on_cpu_and_writes_a_table_the_heuristics_read(tmp_path, use_table):
    out, report = tmp_path / "tuned.json", tmp_path / "tuning.md"
    rc = tune_blocks.main(["--dry-run", "--head-dims", "64", "--causal", "yes", "--repeats", "1",
                           "--seq-len", "32", "--out", str(out), "--report", str(report), "--no-compile-facts"])
    assert rc == 0
    entries = json.loads(out.read_text())["entries"]
    assert [(e["head_dim"], e["dtype"], e["causal"]) for e in entries] == [(64, "bfloat16", True)]
    winner = BlockSizes(**entries[0]["block_sizes"])
    assert winner in tune_blocks.candidates(64, "bfloat16")
    assert entries[0]["candidates"] == len(tune_blocks.candidates(64, "bfloat16"))
    use_table(out)
    assert heuristics.default_block_sizes(64, "bfloat16", causal=True) == winner
    assert report.read_text().count("| 64 | bfloat16 | yes |") == entries[0]["candidates"]
    assert "**yes**" in report.read_text()
    # every row is kept beside the report, and --from-rows renders the same table from it (a GPU
    # machine without pip triton times; compiled facts are added where triton is)
    rendered = tmp_path / "rendered.md"
    facts = {}
    monkey = pytest.MonkeyPatch()
    monkey.setattr(tune_blocks, "compile_facts", lambda rows: facts)
    try:
        assert tune_blocks.main(["--from-rows", str(report.with_suffix(".json")), "--report", str(rendered)]) == 0
    finally:
        monkey.undo()
    assert rendered.read_text() == report.read_text()


def test_a_spent_time_budget_skips_every_candidate_and_writes_no_table(tmp_path, capsys):
    out = tmp_path / "tuned.json"
    rc = tune_blocks.main(["--dry-run", "--head-dims", "64", "--causal", "yes", "--time-budget", "0",
                           "--out", str(out), "--no-compile-facts"])
    assert rc == 1 and not out.exists()
    printed = capsys.readouterr()
    assert "skipped" in printed.out and "no candidate ran correctly" in printed.err
