"""flash_attention partitions itself under plain jax.jit (custom_partitioning), fwd and bwd."""
import functools

import pytest

from _spawn import run_script

TOL = 2e-5
RUNS = pytest.mark.parametrize("implementation,partitioner", [
    ("xla", "shardy"), ("pallas_triton", "shardy"), ("pallas_triton", "gspmd")])


@functools.cache
def _partition_local(implementation, partitioner):
    """One run of the script per configuration, shared by the tests below."""
    return run_script("partition_local.py", implementation, partitioner)


@RUNS
def test_batch_head_sharding_runs_locally(implementation, partitioner):
    """P("data", None, "model", None) on data=2 x model=4, GQA 8/4 heads, causal bottom-right,
    lengths, segment ids, a bias broadcast over batch: 0 all-gathers in the compiled fwd+bwd,
    outputs keep the sharding, values match the float64 oracle."""
    result = _partition_local(implementation, partitioner)
    local = result["batch_heads"]
    assert local["all_gathers"] == 0
    assert local["out_spec"] == local["dq_spec"] == "('data', None, 'model', None)"
    assert local["warnings"] == []
    assert set(local["errors"]) == {"out", "dq", "dk", "dv", "dbias"}
    assert max(local["errors"].values()) < TOL, local["errors"]
    # A constant bias: the backward op returns no dbias; still local and exact.
    constant = result["batch_heads_constant_bias"]
    assert constant["all_gathers"] == 0 and constant["warnings"] == []
    assert set(constant["errors"]) == {"out", "dq", "dk", "dv"}
    assert max(constant["errors"].values()) < TOL, constant["errors"]

    # head_dim sharded cannot be honoured: resharded, said so, still exact.
    gathered = result["head_dim"]
    assert gathered["warnings"] and all("head_dim" in w for w in gathered["warnings"])
    assert gathered["all_gathers"] > 0
    assert max(gathered["errors"].values()) < TOL, gathered["errors"]


@RUNS
def test_paged_decode_keeps_the_batch_and_heads_local(implementation, partitioner):
    """A paged KV cache call (decode step, GQA, bottom-right causal, lengths, sinks, shuffled
    table) with q, table, lengths and sinks batch-sharded on data=2 x model=4: 0 all-gathers,
    the output stays P("data") (and heads on "model" with the pool's kv heads), equal to the
    unsharded call and to torch_ref float64; a pool split along its pages cannot be read
    without gathering it: a ShardingWarning says so. implementation=None (the fused C++
    kernel on a CPU), and xla in the xla run."""
    paged = _partition_local(implementation, partitioner)["paged"]
    assert set(paged) == ({"None", "xla"} if implementation == "xla" else {"None"})
    for implementation, results in paged.items():
        for layout, r in results.items():
            assert r["error"] < TOL and r["vs_unsharded"] < 1e-6, (implementation, layout, r)
        local = (results["batch"], results["batch_heads"])
        assert [r["out_spec"] for r in local] == ["('data', None, None, None)",
                                                  "('data', None, 'model', None)"]
        assert all(r["all_gathers"] == 0 and r["warnings"] == [] for r in local), local
        gathered = results["pool_split_by_pages"]
        assert gathered["all_gathers"] > 0 and gathered["out_spec"] == "('data', None, None, None)"
        assert len(gathered["warnings"]) == 2 and all(
            "page pool is shared by the whole batch" in w and "all-gathered" in w
            for w in gathered["warnings"]), gathered["warnings"]


def test_paged_decode_under_vmap_folds_the_batch_and_stacks_batched_pools():
    """vmap of a paged call (the partitioned op folds the mapped axis into the batch): one pool
    shared by every mapped call, or a pool per call (stacked, the table's ids moved up), each
    equal to the unmapped call on its own pool (in-process, one device)."""
    import jax
    import numpy as np
    from jax_impl import flash_attention

    rng = np.random.default_rng()
    q = rng.standard_normal((3, 2, 1, 4, 16)).astype(np.float32)      # [calls, B, 1, Hq, D]
    pools = rng.standard_normal((2, 3, 8, 16, 2, 16)).astype(np.float32)  # k, v: [calls, pages, ...]
    tables = np.stack([rng.permutation(8)[:6].reshape(2, 3) for _ in range(3)]).astype(np.int32)
    lengths = rng.integers(1, 49, (3, 2)).astype(np.int32)
    paged = lambda q, k, v, t, n: flash_attention(q, k, v, page_table=t, key_value_seq_lengths=n)
    per_pool = jax.jit(jax.vmap(paged))(q, pools[0], pools[1], tables, lengths)
    shared = jax.jit(jax.vmap(paged, in_axes=(0, None, None, 0, 0)))(
        q, pools[0, 0], pools[1, 0], tables, lengths)
    for i in range(3):
        np.testing.assert_allclose(per_pool[i], paged(q[i], pools[0, i], pools[1, i], tables[i],
                                                      lengths[i]), atol=1e-6, rtol=0)
        np.testing.assert_allclose(shared[i], paged(q[i], pools[0, 0], pools[1, 0], tables[i],
                                                    lengths[i]), atol=1e-6, rtol=0)
