"""The all-to-all (Ulysses) strategy and the cost model that picks ring / all-to-all / gather."""
import numpy as np
import pytest

from _spawn import run_script

TOL = 2e-5


def _abstract(shape, mesh, spec):
    """A float32 ShapeDtypeStruct sharded over an abstract mesh (jax 0.11's shard_map checks it)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
A2A = ("a2a_causal_gqa_dropout_sinks", "a2a_bottom_right_window_lengths_segments",
       "a2a_dropout_pattern_causal")


@pytest.mark.parametrize("mode", ["jit_a2a", "shard_map_a2a"])
def test_all_to_all_is_exact_and_gathers_nothing(mode):
    """flash_attention(context_parallel_strategy="all_to_all") on P(None, "seq") inputs, and
    ulysses_attention in shard_map: GQA (kv heads resharded with their groups), dropout (global
    head index in the hash: the one-device pattern bit for bit), sinks (dsinks), bottom-right
    causal with a window, lengths and segment ids; vs torch_ref float64 and the one-device call."""
    results = run_script("ring_features.py", mode, *A2A)
    for name, r in results.items():
        assert r["all_gathers"] == 0 and r["permutes"] == 0, (name, r)
        assert r["all_to_alls"] > 0, name
        expected = {"out", "dq", "dk", "dv"} | ({"dsinks"} if "sinks" in name else set())
        assert set(r["errors"]) == expected, name
        assert max(r["errors"].values()) < TOL, (name, r["errors"])
        assert r["single"] < TOL, (name, r["single"])
    pattern = results["a2a_dropout_pattern_causal"]["pattern"]
    assert pattern["same_as_single"] and pattern["same_as_mask"], pattern


def _assert_hybrid_exact(name, r):
    assert r["all_gathers"] == 0 and r["all_to_alls"] > 0 and r["permutes"] > 0, (name, r)
    assert max(r["errors"].values()) < TOL, (name, r["errors"])
    assert r["single"] < TOL, (name, r["single"])


def test_hybrid_on_a_2x4_mesh_draws_the_one_device_dropout_pattern():
    """The sequence over both axes of a (host=2, chip=4) mesh under plain jit: all-to-all over
    "chip", ring over "host"; the dropout pattern bit for bit (the other features: the test
    below, which runs the plain-jit hybrid beside hybrid_attention)."""
    (r,) = run_script("ring_features.py", "jit_hybrid", "a2a_dropout_pattern_causal").values()
    _assert_hybrid_exact("a2a_dropout_pattern_causal", r)
    assert r["pattern"]["same_as_single"] and r["pattern"]["same_as_mask"], r["pattern"]


def test_hybrid_attention_in_shard_map_and_under_jit_is_exact_and_agrees():
    """hybrid_attention inside shard_map on a (host=2, chip=4) mesh, the sequence over both
    axes in natural order, and flash_attention's hybrid under plain jit on the same arrays:
    GQA, dropout, sinks, lengths, segment ids, window; fwd+bwd vs torch_ref float64, the
    one-device call (dropout: its pattern), no gathers, and each other."""
    names = ("hybrid_causal_gqa_dropout_sinks", "a2a_bottom_right_window_lengths_segments")
    results = run_script("ring_features.py", "shard_map_hybrid", *names)
    for name, r in results.items():
        _assert_hybrid_exact(name, r)
        _assert_hybrid_exact(name, r["jit"])
        assert r["jit_agreement"] < TOL, (name, r["jit_agreement"])
    sinks = results["hybrid_causal_gqa_dropout_sinks"]
    assert "dsinks" in sinks["errors"] and "dsinks" in sinks["jit"]["errors"]


def _hybrid_shapes(hq, hkv, length=64, mesh=((2, 4), ("host", "chip")),
                   axes=dict(all_to_all_axis="chip", ring_axis="host")):
    """eval_shape of hybrid_attention inside shard_map on an abstract mesh (no devices)."""
    import jax
    from jax.sharding import AbstractMesh, PartitionSpec as P
    from jax_impl import hybrid_attention
    seq, mesh = P(None, mesh[1]), AbstractMesh(*mesh)
    mapped = jax.shard_map(lambda q, k: hybrid_attention(q, k, k, **axes),
                           mesh=mesh, in_specs=(seq, seq), out_specs=seq)
    return jax.eval_shape(mapped, _abstract((1, length, hq, 16), mesh, seq),
                          _abstract((1, length, hkv, 16), mesh, seq))


def test_hybrid_attention_refuses_what_it_cannot_run_by_name():
    assert _hybrid_shapes(8, 4).shape == (1, 64, 8, 16)
    with pytest.raises(ValueError, match="all-to-all over 'chip': 8 query / 2 kv heads do not "
                                         "divide over 4 devices.*ring_attention"):
        _hybrid_shapes(8, 2)
    with pytest.raises(ValueError, match="global sequence length 40 must divide into 2 \\* 8 chunks"):
        _hybrid_shapes(8, 4, length=40, mesh=((8, 1), ("host", "chip")))
    one_axis = ((8,), ("seq",))
    with pytest.raises(ValueError, match="must be two different mesh axes"):
        _hybrid_shapes(8, 8, mesh=one_axis, axes=dict(all_to_all_axis="seq", ring_axis="seq"))
    with pytest.raises(ValueError, match="ring_axis='nope' is not a mesh axis bound here"):
        _hybrid_shapes(8, 8, mesh=one_axis, axes=dict(all_to_all_axis="seq", ring_axis="nope"))
    with pytest.raises(ValueError, match="implementation='reference' must be one of"):
        _hybrid_shapes(8, 4, axes=dict(all_to_all_axis="chip", ring_axis="host",
                                       implementation="reference"))


def test_all_to_all_memory_per_device_at_8_devices():
    """L=32768, H=8, D=64 fp32 causal fwd+bwd, compiled: arguments + temporaries per device
    <= 0.3x one device, with all-to-alls and no all-gather (the ring's figure beside it)."""
    f = run_script("strategy_memory.py", "32768", "ring", "all_to_all")
    one, a2a, ring = f["one_1"], f["all_to_all_8"], f["ring_8"]
    assert a2a["all_gathers"] == 0 and a2a["all_to_alls"] > 0 and a2a["permutes"] == 0
    assert a2a["bytes"] <= 0.3 * one["bytes"], a2a["bytes"] / one["bytes"]
    assert ring["all_gathers"] == 0 and ring["bytes"] <= 0.3 * one["bytes"]


def test_cost_model_picks_by_bytes_and_names_why_not():
    from jax_impl import cp_cost
    mha = (1, 32768, 32768, 8, 8, 64, 2)
    choice = cp_cost.choose(8, mha, ring_unavailable=None, all_to_all_unavailable=None)
    assert choice.strategy == "all_to_all"  # 2/N of the ring's bytes for MHA
    ring, a2a = choice.bytes_per_device["ring"], choice.bytes_per_device["all_to_all"]
    assert a2a < ring
    # The estimates in closed form: ring sends K, V N times forward, K, V, dK, dV (f32) N times
    # backward, and dK, dV once more (home, in their dtype).
    kv_block = 32768 // 8 * 8 * 64 * 2
    assert ring == 8 * 2 * kv_block + 8 * (2 * kv_block + 2 * kv_block * 2) + 2 * kv_block
    gqa = (1, 32768, 32768, 32, 1, 64, 2)  # one kv head: the ring moves little
    assert cp_cost.choose(8, gqa, ring_unavailable=None, all_to_all_unavailable=None).strategy == "ring"
    fallback = cp_cost.choose(8, mha, ring_unavailable="x", all_to_all_unavailable="y")
    assert fallback.strategy == "all_gather" and fallback.unavailable == {"ring": "x", "all_to_all": "y"}
    assert cp_cost.choose(8, mha, ring_unavailable=None, all_to_all_unavailable=None,
                          requested="ring").strategy == "ring"
    with pytest.raises(ValueError, match="context_parallel_strategy='all_to_all' cannot run.*heads"):
        cp_cost.choose(8, gqa, ring_unavailable=None, requested="all_to_all",
                       all_to_all_unavailable="32 query / 1 kv heads do not divide")
    text = choice.describe(8, "seq")
    assert "all_to_all over 'seq'" in text and "MiB" in text and "ring" in text


def test_context_parallel_strategy_is_validated_by_name():
    from jax_impl import flash_attention
    x = np.random.default_rng().standard_normal((1, 8, 1, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="context_parallel_strategy='ulysses' must be None.*'all_to_all'"):
        flash_attention(x, x, x, context_parallel_strategy="ulysses")


def test_ulysses_refuses_kv_heads_that_do_not_divide_the_axis():
    import jax
    from jax.sharding import AbstractMesh, PartitionSpec as P
    from jax_impl.context_parallel import ulysses_attention
    mesh = AbstractMesh((8,), ("seq",))
    q, kv = (_abstract((1, 64, h, 16), mesh, P(None, "seq")) for h in (8, 2))
    mapped = jax.shard_map(lambda q, k: ulysses_attention(q, k, k, axis_name="seq"),
                           mesh=mesh, in_specs=(P(None, "seq"),) * 2, out_specs=P(None, "seq"))
    with pytest.raises(ValueError, match="8 query / 2 kv heads do not divide over 8 devices.*ring_attention"):
        jax.eval_shape(mapped, q, kv)


@pytest.fixture(scope="module")
def sequence_a2a_run():
    """One run of partition_sequence.py's all-to-all configurations and strategy refusals."""
    return run_script("partition_sequence.py", "exact_a2a")


def test_all_to_all_reshards_a_per_head_bias_and_mask_by_head(sequence_a2a_run):
    """context_parallel_strategy="all_to_all" with a per-head bias (differentiated) and dense
    mask, sharded along their query rows: resharded by head with the operands, dbias back along
    the rows; fwd+bwd vs torch_ref float64, no permute, no all-gather."""
    results = {name: r for name, r in sequence_a2a_run.items() if name != "refused"}
    assert len(results) == 2
    for name, r in results.items():
        assert r["all_gathers"] == 0 and r["permutes"] == 0 and r["all_to_alls"] > 0, (name, r)
        assert r["warnings"] == [] and r["dbias_spec"] == "(None, None, 'seq')", (name, r)
        assert set(r["errors"]) == {"out", "dq", "dk", "dv", "dbias"}, name
        assert max(r["errors"].values()) < TOL, (name, r["errors"])


def test_cost_model_counts_the_bias_the_all_to_all_moves_and_refuses_a_shared_one():
    import dataclasses
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh, PartitionSpec as P
    from jax_impl import partitioned
    mesh, shape = AbstractMesh((8,), ("seq",)), (1, 4096, 8, 64)

    def plan(pairwise, requested=None):
        call = partitioned.sequence_call(None, ("q", "k", "v") + tuple(pairwise), jnp.float32,
                                         pairwise, hq=8)
        return partitioned.sharding_plan(mesh, P(None, "seq"), shape, shape, ring_unavailable=None,
                                         call=dataclasses.replace(call, requested=requested))
    bias = jax.ShapeDtypeStruct((1, 8, 4096, 4096), jnp.float32)
    plain, with_bias = plan({}), plan({"bias": bias})
    assert plain.strategy == "all_to_all" and with_bias.strategy == "ring"  # the ring moves no bias
    a2a = lambda p: p.choice.bytes_per_device["all_to_all"]
    # Forward, backward and dbias: 3 passes of the whole bias, (N-1)/N of each device's 1/N.
    assert a2a(with_bias) - a2a(plain) == 7 / 8 * 3 * bias.size * 4 / 8
    assert with_bias.choice.bytes_per_device["ring"] == plain.choice.bytes_per_device["ring"]
    assert plan({"bias": bias}, "all_to_all").strategy == "all_to_all"
    shared = jax.ShapeDtypeStruct((1, 1, 4096, 4096), jnp.float32)
    with pytest.raises(ValueError, match="all_to_all.*cannot run.*shared by every head"):
        plan({"bias": shared}, "all_to_all")


def test_ulysses_attention_takes_a_per_head_bias_and_mask():
    """ulysses_attention in shard_map with a bias broadcast over the batch (differentiated) and
    a dense mask, each this device's query rows with every key column, one slice per head; GQA,
    bottom-right causal, lengths, segment ids; fwd+bwd vs torch_ref float64."""
    errors = run_script("ring_exact.py", "ulysses", "a2a_bias_mask_causal_gqa_lengths_segments")
    errors = errors["a2a_bias_mask_causal_gqa_lengths_segments"]
    assert set(errors) == {"out", "dq", "dk", "dv", "dbias"}
    assert max(errors.values()) < TOL, errors


def test_ulysses_attention_refuses_a_bias_shared_by_every_head():
    import jax
    from jax.sharding import AbstractMesh, PartitionSpec as P
    from jax_impl import ulysses_attention
    mesh, rows = AbstractMesh((8,), ("seq",)), P(None, None, "seq", None)
    q = _abstract((1, 64, 8, 16), mesh, P(None, "seq"))
    for heads, ok in ((8, True), (1, False)):
        bias = _abstract((1, heads, 64, 64), mesh, rows)
        mapped = jax.shard_map(lambda q, b: ulysses_attention(q, q, q, b, axis_name="seq"),
                               mesh=mesh, in_specs=(P(None, "seq"), rows), out_specs=P(None, "seq"))
        if ok:
            assert jax.eval_shape(mapped, q, bias).shape == (1, 64, 8, 16)
        else:
            with pytest.raises(ValueError, match="shared by every head.*use ring_attention"):
                jax.eval_shape(mapped, q, bias)


RING_72_OVER_8 = ("context_parallel_strategy='ring' cannot run this call: 72 queries and 72 keys "
                  "do not divide into 16 chunks (the zigzag ring: 2 on each of 8 devices)")


def test_a_refused_strategy_names_the_failing_condition_before_lowering(sequence_a2a_run):
    """A sharded array (eager) or a mesh with explicit axes (under jit): a ValueError at trace
    time that names the one condition that failed, with its numbers. Under plain jit only the
    partitioner sees the sharding: XLA wraps the same message, which comes first in its text."""
    import jax
    from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P
    from jax_impl import flash_attention
    refused = sequence_a2a_run["refused"]
    assert refused["eager"] == ["ValueError", RING_72_OVER_8]
    assert RING_72_OVER_8 in refused["jit"][1]
    mesh = AbstractMesh((8,), ("seq",), axis_types=(AxisType.Explicit,))
    q = _abstract((1, 72, 8, 16), mesh, P(None, "seq"))
    with pytest.raises(ValueError) as caught:
        jax.eval_shape(lambda q: flash_attention(q, q, q, context_parallel_strategy="ring"), q)
    assert str(caught.value) == RING_72_OVER_8


def test_the_rings_refusal_names_only_the_condition_that_failed():
    """What the partitioner raises for a requested ring: the uneven sequence alone, or the
    kernel's reason alone."""
    import dataclasses
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh, PartitionSpec as P
    from jax_impl import implementations, partitioned
    mesh = AbstractMesh((8,), ("seq",))

    def refusal(lk, names=("q", "k", "v"), kernel="xla"):
        call = dataclasses.replace(partitioned.sequence_call(None, names, jnp.float32, hq=8),
                                   requested="ring")
        why_not = partitioned.ring_unavailable(implementations.get(kernel), names)
        with pytest.raises(ValueError) as caught:
            partitioned.sharding_plan(mesh, P(None, "seq"), (1, 64, 8, 16), (1, lk, 8, 16),
                                      ring_unavailable=why_not, call=call)
        return str(caught.value)

    assert refusal(72) == ("context_parallel_strategy='ring' cannot run this call: 72 keys do not "
                           "divide into 16 chunks (the zigzag ring: 2 on each of 8 devices)")
    assert refusal(64, ("q", "k", "v", "seeds"), "cpu") == (
        "context_parallel_strategy='ring' cannot run this call: the local kernel cpu hashes "
        "dropout at local positions (dropout in a ring needs one that hashes its global positions)")
