"""flash_attention sharded over a 4-chip v5e mesh (v5e:2x2) under plain jax.jit compiles for
TPU: libtpu never calls custom_partitioning's Python partitioner back, so the plan runs through
shard_map (partitioned._call)."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jax_impl.flash_attention import flash_attention
from jax_impl.partitioned import ShardingWarning

SHAPE = (4, 512, 8, 128)  # [B, L, H, D]: 4 chips take the batch, the heads or the zigzag ring


def _mesh(axis_type):
    from jax.experimental import topologies
    devices = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices
    return Mesh(np.array(devices), ("x",), axis_types=(axis_type,))


def _fwd_and_grad(implementation, **kwargs):
    def loss(q, k, v):
        out = flash_attention(q, k, v, is_causal=True, implementation=implementation, **kwargs)
        return out.astype(jnp.float32).sum(), out
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.parametrize("spec,kwargs,gathers_allowed", [
    (P("x"), {}, False), (P(None, None, "x"), {}, False),
    (P(None, "x"), dict(context_parallel_strategy="ring"), True)],
    ids=["batch", "heads", "sequence_ring"])
def test_sharded_fwd_and_grad_compile_for_tpu(implementation, spec, kwargs, gathers_allowed):
    """Batch, heads and the sequence (a ring) sharded on a mesh with explicit axes: fwd+grad
    compile for v5e; the batch and head splits run locally (0 all-gathers), the ring passes
    k/v with collective-permutes."""
    mesh = _mesh(AxisType.Explicit)
    operand = jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    hlo = _fwd_and_grad(implementation, **kwargs).lower(operand, operand, operand).compile().as_text()
    if not gathers_allowed:
        assert hlo.count("all-gather") == 0
    else:
        assert "collective-permute" in hlo


def test_automatic_axes_warn_on_tpu(implementation):
    """On a mesh with automatic axes q's sharding is not known while tracing: the call runs
    replicated through shard_map (no custom_partitioning call, which libtpu cannot compile;
    a Mosaic kernel cannot be left to XLA's partitioner either) and compiles, and a
    ShardingWarning names the limitation and the ways out."""
    mesh = _mesh(AxisType.Auto)
    operand = jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowered = _fwd_and_grad(implementation).lower(operand, operand, operand)
    assert "CustomSPMDPartitioning" not in lowered.as_text()
    lowered.compile()
    messages = [str(w.message) for w in caught if w.category is ShardingWarning]
    assert messages and all("explicit axes" in m and "shard_map" in m for m in messages), messages


def test_the_kernels_run_inside_a_users_shard_map_with_vma_checks(implementation):
    """A user's own jax.shard_map (check_vma=True, the default): the kernels' outputs are typed
    as varying like their operands, so fwd+grad compile for v5e."""
    mesh = _mesh(AxisType.Explicit)
    operand = jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    attend = jax.shard_map(
        lambda q, k, v: flash_attention(q, k, v, is_causal=True, implementation=implementation),
        mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x"))
    loss = lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum()
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(operand, operand, operand).compile()


@pytest.mark.parametrize("causal", [True, False])
def test_a_call_traced_under_set_mesh_compiles_for_tpu(implementation, causal):
    """Under ``jax.sharding.set_mesh`` (explicit axes) a JAX computation run eagerly while
    tracing would be placed on the mesh's compile-only devices: the band's static tile count
    must not run one."""
    mesh = _mesh(AxisType.Explicit)
    operand = jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    attend = jax.jit(lambda q, k, v: flash_attention(q, k, v, is_causal=causal,
                                                     implementation=implementation))
    with jax.sharding.set_mesh(mesh):
        hlo = attend.lower(operand, operand, operand).compile().as_text()
    assert hlo.count("all-gather") == 0
