"""implementation="mosaic_gpu" inside ``jax.shard_map`` with ``check_vma=True`` (jax >= 0.11):
its outputs and gradients vary over the manual axes as its operands do.

``plgpu.kernel`` (jax 0.11) returns its outputs unvarying whatever ``out_type`` says; unmarked,
the custom VJP refused the backward's gradients (their type did not match the operands') and
the forward's output claimed to be the same on every device. Traced only, on an abstract mesh
of 2 devices: the Mosaic GPU interpreter does not run two devices' kernels at once (in jax
0.11.2 it fails its own check that every barrier was freed, with or without this library's
kernels' fix). Imports no torch, so that the CUDA compile lane (jax 0.11.2) runs it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from jax_impl import mosaic_gpu, vma
from jax_impl.flash_attention import flash_attention
from jax_impl.mosaic_gpu.config import DQ_STRATEGIES, BackwardConfig, Config

pytestmark = pytest.mark.skipif(mosaic_gpu.unavailable() is not None,
                                reason=f"mosaic_gpu: {mosaic_gpu.unavailable()}")


MESH = AbstractMesh((2,), ("x",))
SPEC = PartitionSpec("x")


def _sharded(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(MESH, SPEC))


def _trace_per_device(local, args, num_outputs: int):
    """Traces ``local`` under jit in a shard_map over MESH (every operand and result split
    along its first axis), with check_vma."""
    sharded = jax.shard_map(local, mesh=MESH, in_specs=(SPEC,) * len(args),
                            out_specs=(SPEC,) * num_outputs, check_vma=True)
    jax.jit(sharded).trace(*args)


@pytest.mark.parametrize("dq", DQ_STRATEGIES)
@pytest.mark.parametrize("segments", [False, True], ids=["plain", "segment_ids"])
def test_outputs_and_gradients_vary_as_the_operands_do(dq, segments):
    config = Config(backward="mosaic_gpu", backward_config=BackwardConfig(dq=dq))
    seen = {}

    def local(q, k, v, ids):
        def loss(q, k, v):
            out = flash_attention(q, k, v, is_causal=True, implementation="mosaic_gpu",
                                  block_sizes=config, interpret=True,
                                  **(dict(q_segment_ids=ids, kv_segment_ids=ids) if segments
                                     else {}))
            seen["out"] = vma.axes_of(out)
            return jnp.sum(out.astype(jnp.float32))

        grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        seen["grads"] = [vma.axes_of(g) for g in grads]
        return grads

    qkv = _sharded((2, 128, 2, 64), jnp.bfloat16)
    _trace_per_device(local, (qkv, qkv, qkv, _sharded((2, 128), jnp.int32)), 3)
    assert seen == {"out": ("x",), "grads": [("x",)] * 3}


def test_dbias_varies_as_the_bias_does_with_a_mask():
    """The dQ kernel's dS goes to a zeroed float32 ``jax.new_ref`` (unvarying: jax 0.11's
    kernels refuse a varying Ref), marked varying once read, as the fused dQ's is."""
    config = Config(64, 64, 2, backward="mosaic_gpu")
    seen = {}

    def local(q, k, v, bias, mask):
        def loss(q, k, v, bias):
            out = flash_attention(q, k, v, bias, mask, is_causal=True,
                                  implementation="mosaic_gpu", block_sizes=config,
                                  interpret=True)
            return jnp.sum(out.astype(jnp.float32))

        grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)
        seen["grads"] = [vma.axes_of(g) for g in grads]
        return grads

    qkv = _sharded((2, 128, 2, 64), jnp.bfloat16)
    _trace_per_device(local, (qkv, qkv, qkv, _sharded((2, 2, 128, 128), jnp.float32),
                              _sharded((2, 1, 128, 128), jnp.bool_)), 4)
    assert seen == {"grads": [("x",)] * 4}
