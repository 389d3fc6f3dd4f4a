"""score_mod / mask_mod / block_mask calls on sharded inputs (scripts/mods_sharded.py)."""
from _spawn import run_script


def test_mods_on_sharded_inputs_give_the_one_device_answer():
    s = run_script("mods_sharded.py")
    assert s["batch"] < 1e-5 and s["sequence"] < 1e-5
    assert s["sequence_explain"].startswith("one program: ") and "global indices" in s["sequence_explain"]
    assert s["ring"].startswith("context_parallel_strategy='ring' cannot run a call with score_mod")
    # Inside shard_map the strategies give the mods global indices: out, dq and d(slopes).
    assert max(s[f] for f in ("ring_attention", "ulysses_attention", "hybrid_attention")) < 1e-5
