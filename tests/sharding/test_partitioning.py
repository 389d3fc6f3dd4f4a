"""flash_attention partitions itself under plain jax.jit (custom_partitioning), fwd and bwd."""
import pytest

from _spawn import run_script

TOL = 2e-5


@pytest.mark.parametrize("implementation,partitioner", [
    ("xla", "shardy"), ("pallas_triton", "shardy"), ("pallas_triton", "gspmd")])
def test_batch_head_sharding_runs_locally(implementation, partitioner):
    """P("data", None, "model", None) on data=2 x model=4, GQA 8/4 heads, causal bottom-right,
    lengths, segment ids, a bias broadcast over batch: 0 all-gathers in the compiled fwd+bwd,
    outputs keep the sharding, values match the float64 oracle."""
    result = run_script("partition_local.py", implementation, partitioner)
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
