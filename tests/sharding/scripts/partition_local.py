"""flash_attention under plain jax.jit with batch/head-sharded inputs (mesh data=2 x model=4).

argv: implementation, partitioner ("shardy" | "gspmd"). Prints all-gather counts of the
compiled fwd+bwd, errors vs the float64 oracle, the output sharding, and what a head_dim
sharding does (warning text, errors); and the same for a paged KV cache call (forward only:
batch, batch + heads, a page pool sharded along its pages) with implementation=None (and
"xla" in the xla run).
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


def paged(paged_implementation):
    """A decode step (2 query rows, GQA 8/4, bottom-right causal, lengths, sinks) on a shuffled
    page table into a pool with spare pages: {layout: all-gathers, output spec, warnings, max
    |err| vs torch_ref float64 and vs the same call unsharded}."""
    import torch
    from torch_ref import manual_attention
    b, page_size, per_row, num_pages = 4, 16, 4, 24
    q = rng.standard_normal((b, 2, HQ, D)).astype(np.float32)
    pool = rng.standard_normal((2, num_pages, page_size, HKV, D)).astype(np.float32)
    table = rng.permutation(num_pages)[:b * per_row].reshape(b, per_row).astype(np.int32)
    lengths = rng.integers(2, per_row * page_size + 1, b).astype(np.int32)
    sinks = rng.standard_normal((b, HQ)).astype(np.float32)
    options = dict(is_causal=True, causal_alignment="bottom_right")
    dense = lambda x: torch.from_numpy(x[table].reshape(b, -1, HKV, D).transpose(0, 2, 1, 3))
    ref = manual_attention(torch.from_numpy(q.transpose(0, 2, 1, 3)).double(),
                           dense(pool[0]).double(), dense(pool[1]).double(),
                           key_value_seq_lengths=torch.from_numpy(lengths),
                           attention_sinks=torch.from_numpy(sinks).double(), **options)
    ref = ref.numpy().transpose(0, 2, 1, 3)
    f = jax.jit(lambda q, k, v, t, n, s: flash_attention(
        q, k, v, page_table=t, key_value_seq_lengths=n, attention_sinks=s,
        implementation=paged_implementation, **options))
    unsharded = np.asarray(f(q, pool[0], pool[1], table, lengths, sinks), np.float64)
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    layouts = {  # q's batch (and heads); the page pool's layout
        "batch": (("data",), (), ()),
        "batch_heads": (("data", None, "model"), (None, None, "model"), ("data", "model")),
        "pool_split_by_pages": (("data",), ("data",), ()),
    }
    results = {}
    for name, (q_spec, pool_spec, sinks_spec) in layouts.items():
        args = (put(q, *q_spec), put(pool[0], *pool_spec), put(pool[1], *pool_spec),
                put(table, "data"), put(lengths, "data"), put(sinks, *(sinks_spec or ("data",))))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hlo = f.lower(*args).compile().as_text()
        out = f(*args)
        results[name] = dict(
            all_gathers=hlo.count("all-gather"),
            out_spec=str(tuple(out.sharding.spec) + (None,) * (4 - len(out.sharding.spec))),
            warnings=[str(w.message) for w in caught if "flash_attention" in str(w.message)],
            error=float(np.max(np.abs(np.asarray(out, np.float64) - ref))),
            vs_unsharded=float(np.max(np.abs(np.asarray(out, np.float64) - unsharded))))
    return results


print(json.dumps({"batch_heads": run(P("data", None, "model", None)),
                  "batch_heads_constant_bias": run(P("data", None, "model", None), constant_bias=True),
                  "head_dim": run(P(None, None, None, "model")),
                  "paged": {str(name): paged(name)
                            for name in ((None, "xla") if implementation == "xla" else (None,))}}))
