"""explain_implementation reports how sharded inputs will run: the plan as data (which
strategy, over which mesh axes, in how many ring steps, with which local kernel, what is
gathered) and the cost model's numbers behind the choice."""
from _spawn import run_script


def test_strategy_for_sharded_inputs():
    s = run_script("explain.py")
    # batch and heads split: each device runs its share, nothing moves
    assert s["batch_heads"] | {"bytes_per_device": {}, "unavailable": {}} == {
        "kind": "local", "batch_axes": ["data"], "head_axes": ["model"], "sequence_axes": [], "gathered": [],
        "ring_steps": 0, "local_kernel": None, "pairwise": None, "requested": False, "bytes_per_device": {},
        "unavailable": {}}
    # a sharded sequence: the cost model takes the strategy that sends the fewest bytes
    # (8 heads over 8 devices: the all-to-all)
    chosen = s["sequence"]
    assert (chosen["kind"], chosen["sequence_axes"], chosen["local_kernel"]) == ("all_to_all", ["seq"], "xla")
    assert not chosen["requested"] and chosen["gathered"] == []
    assert min(chosen["bytes_per_device"], key=chosen["bytes_per_device"].get) == "all_to_all"
    assert {"ring", "all_to_all"} <= set(chosen["bytes_per_device"])
    # the ring when asked for, though it sends more; 8 steps over 8 devices
    ring = s["sequence_ring"]
    assert (ring["kind"], ring["ring_steps"], ring["requested"]) == ("ring", 8, True)
    assert ring["bytes_per_device"]["ring"] > ring["bytes_per_device"]["all_to_all"]
    assert (s["sequence_pallas"]["kind"], s["sequence_pallas"]["local_kernel"]) == ("ring", "pallas_triton")
    # a bias shared by every head cannot go by head: the ring carries it by query rows
    shared = s["sequence_bias"]
    assert (shared["kind"], shared["pairwise"]) == ("ring", "query_rows") and "all_to_all" in shared["unavailable"]
    # a per-head bias travels with its heads, and the all-to-all still sends the fewest bytes
    per_head = s["sequence_bias_per_head"]
    assert (per_head["kind"], per_head["pairwise"]) == ("all_to_all", "by_head")
    assert min(per_head["bytes_per_device"], key=per_head["bytes_per_device"].get) == "all_to_all"
    # the sequence over two axes: all-to-all over 'model' (4), then a ring over 'data' in 2 steps
    hybrid = s["sequence_two_axes"]
    assert (hybrid["kind"], hybrid["sequence_axes"], hybrid["ring_steps"]) == ("hybrid", ["data", "model"], 2)
    # head_dim cannot be split (each dot product needs the whole head): gathered
    assert (s["head_dim"]["kind"], s["head_dim"]["gathered"]) == ("replicated", ["head_dim"])
    assert s["unsharded"] is None
