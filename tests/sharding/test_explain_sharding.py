"""explain_implementation reports how sharded inputs will run, and why."""
from _spawn import run_script


def test_strategy_for_sharded_inputs():
    s = run_script("explain.py")
    assert s["batch_heads"].startswith("local") and "no collective" in s["batch_heads"]
    assert s["sequence"].startswith("ring over 'seq' in 8 steps")
    assert "all-gathered" in s["sequence_pallas"] and "implementation='xla'" in s["sequence_pallas"]
    assert "head_dim" in s["head_dim"] and "all-gathered" in s["head_dim"]
    assert s["unsharded"] is None
