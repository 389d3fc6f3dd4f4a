"""flash_attention under plain jax.jit with batch/head-sharded inputs (mesh data=2 x model=4).

argv: implementation, partitioner ("shardy" | "gspmd"). Prints all-gather counts of the
compiled fwd+bwd, errors vs the float64 oracle, the output sharding, and what a head_dim
sharding does (warning text, errors).
"""
import json
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from _common import max_errors, oracle, problem
from jax_impl.flash_attention import flash_attention

implementation, partitioner = sys.argv[1], sys.argv[2]
jax.config.update("jax_use_shardy_partitioner", partitioner == "shardy")
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
B, L, HQ, HKV, D = 2, 32, 8, 4, 16
arrays, rng = problem(np.random.SeedSequence().entropy % 2**31, B, L, L, HQ, HKV, D)
arrays["bias"] = rng.standard_normal((1, HQ, L, L)).astype(np.float32)  # broadcast over batch
kwargs = dict(is_causal=True, causal_alignment="bottom_right",
              query_seq_lengths=np.array([L, 23], np.int32), key_value_seq_lengths=np.array([29, L], np.int32),
              q_segment_ids=np.sort(rng.integers(0, 2, (B, L)), 1).astype(np.int32),
              kv_segment_ids=np.sort(rng.integers(0, 2, (B, L)), 1).astype(np.int32))
ref_out, ref_grads = oracle(arrays, **kwargs)


def loss_fn(q, k, v, bias, ct):
    out = flash_attention(q, k, v, bias, implementation=implementation,
                          interpret=implementation == "pallas_triton", **kwargs)
    return jnp.sum(out * ct), out


grad = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2, 3), has_aux=True))
# A constant bias (not differentiated): the backward op has no dbias result.
grad_constant_bias = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2), has_aux=True))


def run(spec, constant_bias=False):
    sharding = NamedSharding(mesh, spec)
    put = lambda x: jax.device_put(x, sharding)
    bias = jax.device_put(arrays["bias"], NamedSharding(mesh, P(None, "model")))
    args = (put(arrays["q"]), put(arrays["k"]), put(arrays["v"]), bias, put(arrays["ct"]))
    fn = grad_constant_bias if constant_bias else grad
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hlo = fn.lower(*args).compile().as_text()
    (_, out), (dq, dk, dv, *dbias) = fn(*args)
    grads = dict(q=dq, k=dk, v=dv, **({} if constant_bias else dict(bias=dbias[0])))
    full_spec = lambda x: str(tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec)))
    return dict(all_gathers=hlo.count("all-gather"), out_spec=full_spec(out), dq_spec=full_spec(dq),
                warnings=[str(w.message) for w in caught if "flash_attention" in str(w.message)],
                errors=max_errors(out, grads, ref_out, ref_grads))


print(json.dumps({"batch_heads": run(P("data", None, "model", None)),
                  "batch_heads_constant_bias": run(P("data", None, "model", None), constant_bias=True),
                  "head_dim": run(P(None, None, None, "model"))}))
