"""The shard_map route (partitioned.SHARD_MAP_PLATFORMS, TPU's) forced onto 8 CPU devices.

Batch/head sharding (data=2 x model=4, GQA 8/4, causal, segment ids) and sequence sharding
over model=4 (ring; all_to_all) on a mesh with explicit axes, and a batch sharding on a mesh
with automatic axes: per case, fwd+grad under jax.jit against torch_ref's float64
manual_attention, the all-gathers and all-to-alls in the compiled program, whether the lowered
program still holds custom_partitioning's custom call, and the flash_attention warnings.
"""
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from _common import max_errors, problem, torch_oracle
from jax_impl import partitioned
from jax_impl.flash_attention import flash_attention

partitioned.NO_CUSTOM_PARTITIONING = ("tpu", "cpu")
B, L, HQ, HKV, D = 2, 32, 8, 4, 16
arrays, rng = problem(np.random.SeedSequence().entropy % 2**31, B, L, L, HQ, HKV, D)
ref_out, ref_grads = torch_oracle(arrays, is_causal=True)


def run(mesh, spec, **kwargs):
    def loss(q, k, v, ct):
        out = flash_attention(q, k, v, implementation="xla", is_causal=True, **kwargs)
        return jnp.sum(out * ct), out

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    args = [jax.device_put(arrays[n], NamedSharding(mesh, spec)) for n in ("q", "k", "v", "ct")]
    with warnings.catch_warnings(record=True) as caught, jax.set_mesh(mesh):
        warnings.simplefilter("always")
        lowered = grad.lower(*args)
        hlo = lowered.compile().as_text()
        (_, out), (dq, dk, dv) = grad(*args)
    return dict(errors=max_errors(out, dict(q=dq, k=dk, v=dv), ref_out, ref_grads),
                all_gathers=hlo.count("all-gather("), all_to_alls=hlo.count("all-to-all("),
                collective_permutes=hlo.count("collective-permute"),
                custom_partitioning="CustomSPMDPartitioning" in lowered.as_text(),
                warnings=[str(w.message) for w in caught if "flash_attention" in str(w.message)])


explicit = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
auto = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
print(json.dumps(dict(
    batch_heads=run(explicit, P("data", None, "model", None)),
    ring=run(explicit, P(None, "model"), context_parallel_strategy="ring"),
    all_to_all=run(explicit, P(None, "model"), context_parallel_strategy="all_to_all"),
    auto_mesh=run(auto, P("data")))))
