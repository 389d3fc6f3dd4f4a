"""Sharded calls without custom_partitioning (partitioned._call): a mesh with explicit axes
runs the plan through shard_map on every platform; on TPU (whose XLA never calls the Python
partitioner back) a mesh with automatic axes runs it replicated through shard_map, saying so. Checked on
8 CPU devices with the TPU route forced (shard_map_route.py); tests/tpu/ compiles it for TPU."""
import functools

import pytest

from _spawn import run_script

TOL = 2e-5


@functools.cache
def _route():
    return run_script("shard_map_route.py")


@pytest.mark.parametrize("case,all_to_alls", [("batch_heads", False), ("ring", False),
                                              ("all_to_all", True)])
def test_explicit_axes_run_the_plan_through_shard_map(case, all_to_alls):
    """Batch/heads on data=2 x model=4 (GQA 8/4, causal) and the sequence over model=4 as a
    ring or an all-to-all: fwd+grad match torch_ref float64, no custom_partitioning call is
    lowered, 0 all-gathers; the ring sends with collective-permutes, Ulysses with all-to-alls."""
    result = _route()[case]
    assert max(result["errors"].values()) < TOL, result["errors"]
    assert not result["custom_partitioning"]
    assert result["all_gathers"] == 0 and result["warnings"] == []
    assert (result["all_to_alls"] > 0) == all_to_alls
    assert (result["collective_permutes"] > 0) == (case == "ring")


def test_automatic_axes_on_tpu_run_replicated_and_say_so():
    """A batch split on a mesh with automatic axes, lowered with the TPU route: the op is not
    custom-partitioned (shard_map, operands replicated), the answer matches torch_ref float64,
    and a ShardingWarning names the limitation and the two ways out."""
    result = _route()["auto_mesh"]
    assert max(result["errors"].values()) < TOL, result["errors"]
    assert not result["custom_partitioning"]
    assert result["warnings"] and all(
        "custom partitioning" in w and "explicit axes" in w and "shard_map" in w
        for w in result["warnings"]), result["warnings"]
