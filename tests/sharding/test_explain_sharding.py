"""explain_implementation reports how sharded inputs will run, and why."""
from _spawn import run_script


def test_strategy_for_sharded_inputs():
    s = run_script("explain.py")
    assert s["batch_heads"].startswith("local") and "no collective" in s["batch_heads"]
    # 8 heads over 8 devices: the all-to-all moves fewer bytes than the ring (cp_cost.py).
    assert s["sequence"].startswith("all_to_all over 'seq'") and "local kernel xla" in s["sequence"]
    assert "fewest bytes" in s["sequence"] and "ring " in s["sequence"] and "MiB" in s["sequence"]
    assert s["sequence_ring"].startswith("ring over 'seq' in 8 steps")
    assert "requested (context_parallel_strategy)" in s["sequence_ring"]
    assert s["sequence_pallas"].startswith("ring over 'seq' in 8 steps")
    assert "local kernel pallas_triton" in s["sequence_pallas"]
    assert s["sequence_bias"].startswith("ring over 'seq'") and "query rows sharded" in s["sequence_bias"]
    assert "all_to_all unavailable: a bias or dense mask shared by every head" in s["sequence_bias"]
    # A per-head bias is resharded by head; at L=64 it is small, and the all-to-all still wins.
    assert s["sequence_bias_per_head"].startswith("all_to_all over 'seq'")
    assert "bias/mask: resharded by head" in s["sequence_bias_per_head"]
    assert s["sequence_two_axes"].startswith("hybrid over ('data', 'model')")
    assert "all-to-all over 'model', then a ring over 'data' in 2 steps" in s["sequence_two_axes"]
    assert "head_dim" in s["head_dim"] and "all-gathered" in s["head_dim"]
    assert s["unsharded"] is None
