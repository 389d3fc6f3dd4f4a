"""flash_attention under plain jax.jit with sequence-sharded inputs: routed to the ring.

argv: "exact" -> 8 devices, L=64, errors vs the float64 oracle and collective counts;
      "memory" -> L=32768, H=8, D=64 fp32 causal: compiled per-device arguments + temporaries
      on 8 devices vs 1 (compiled only, never run).
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


def exact():
    mesh = Mesh(np.array(jax.devices()), ("seq",))
    results = {}
    configs = {
        "causal_top_left_gqa": (64, 64, 4, 2, dict(is_causal=True)),
        "bottom_right_lengths_segments_window": (32, 64, 2, 2, dict(
            is_causal=True, causal_alignment="bottom_right", local_window_size=(17, None))),
    }
    for name, (lq, lk, hq, hkv, kwargs) in configs.items():
        arrays, rng = problem(np.random.SeedSequence().entropy % 2**31, 2, lq, lk, hq, hkv, 16)
        if "lengths" in name:
            kwargs = dict(kwargs, query_seq_lengths=np.array([lq, 20], np.int32),
                          key_value_seq_lengths=np.array([41, 0], np.int32),
                          q_segment_ids=np.sort(rng.integers(0, 3, (2, lq)), 1).astype(np.int32),
                          kv_segment_ids=np.sort(rng.integers(0, 3, (2, lk)), 1).astype(np.int32))
        ref_out, ref_grads = oracle(arrays, **kwargs)
        put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "seq")))
        kwargs = {key: put(val) if "segment" in key else val for key, val in kwargs.items()}

        def loss(q, k, v, ct):
            out = flash_attention(q, k, v, implementation="xla", **kwargs)
            return jnp.sum(out * ct), out

        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        args = [put(arrays[n]) for n in ("q", "k", "v", "ct")]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hlo = grad.lower(*args).compile().as_text()
        (_, out), (dq, dk, dv) = grad(*args)
        results[name] = dict(
            all_gathers=hlo.count("all-gather"), permutes=hlo.count("collective-permute"),
            out_spec=str(tuple(out.sharding.spec)[:2]), warnings=[str(w.message) for w in caught],
            errors=max_errors(out, dict(q=dq, k=dk, v=dv), ref_out, ref_grads))
    return results


def memory():
    shape = (1, 32768, 8, 64)

    def grad(q, k, v):
        f = lambda q, k, v: jnp.sum(flash_attention(q, k, v, is_causal=True, implementation="xla"))
        return jax.grad(f, argnums=(0, 1, 2))(q, k, v)

    figures = {}
    for n in (1, 8):
        mesh = Mesh(np.array(jax.devices()[:n]), ("seq",))
        arg = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P(None, "seq")))
        for name, fn in (("forward", lambda q, k, v: flash_attention(q, k, v, is_causal=True,
                                                                      implementation="xla")),
                         ("forward_backward", grad)):
            compiled = jax.jit(fn).lower(arg, arg, arg).compile()
            m = compiled.memory_analysis()
            figures[f"{name}_{n}"] = dict(bytes=m.argument_size_in_bytes + m.temp_size_in_bytes,
                                          all_gathers=compiled.as_text().count("all-gather"))
    return figures


if __name__ == "__main__":
    print(json.dumps(exact() if sys.argv[1] == "exact" else memory()))
