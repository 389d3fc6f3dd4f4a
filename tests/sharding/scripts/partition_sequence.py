"""flash_attention under plain jax.jit with sequence-sharded inputs: routed to the ring.

argv: "exact" [implementation] -> 8 devices, L<=64, errors vs torch_ref float64 and collective
      counts ("pallas_triton" runs in the Pallas interpreter); bias and mask arrive sharded along
      their query rows with every key column;
      "exact_a2a" -> the same for per-head bias/mask configs with
      context_parallel_strategy="all_to_all" (resharded by head);
      and what a refused context_parallel_strategy raises, eagerly and under jit ("refused");
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

from _common import max_errors, problem, torch_oracle
from jax_impl.flash_attention import flash_attention


A2A_CONFIGS = {  # heads divisible by the 8 devices; bias/mask per head
    "a2a_bias_mask_causal": (64, 64, 8, 8, dict(is_causal=True), (2, 8), (1, 8)),
    "a2a_broadcast_batch_bias_bottom_right_lengths_gqa": (32, 64, 16, 8, dict(
        is_causal=True, causal_alignment="bottom_right"), (1, 16), None),
}


PALLAS_CONFIGS = ("bottom_right_lengths_segments_window", "bias_mask_causal_gqa")


def exact(implementation="xla", strategy=None):
    mesh = Mesh(np.array(jax.devices()), ("seq",))
    results = {}
    configs = A2A_CONFIGS if strategy else {  # name: (lq, lk, hq, hkv, kwargs, bias (Bb, Hb) or None, mask (Bm, Hm) or None)
        "causal_top_left_gqa": (64, 64, 4, 2, dict(is_causal=True), None, None),
        "bottom_right_lengths_segments_window": (32, 64, 2, 2, dict(
            is_causal=True, causal_alignment="bottom_right", local_window_size=(17, None)),
            None, None),
        "bias_mask_causal_gqa": (32, 64, 4, 2, dict(is_causal=True), (2, 4), (1, 4)),
        "broadcast_bias_bottom_right_lengths": (64, 32, 2, 1, dict(
            is_causal=True, causal_alignment="bottom_right"), (1, 1), None),
        # Not differentiated: the ring's backward computes no dbias.
        "constant_bias_causal": (32, 32, 2, 2, dict(is_causal=True), (2, 2), None),
    }
    extra = dict(interpret=True) if implementation == "pallas_triton" else {}
    if implementation == "pallas_triton":  # the kernels' own features; the rest is partitioning,
        # shared with xla's run (interpreted, about 10 s a configuration on 2 cores)
        configs = {n: configs[n] for n in PALLAS_CONFIGS}
    if strategy:
        extra["context_parallel_strategy"] = strategy
    for name, (lq, lk, hq, hkv, kwargs, bias_shape, mask_shape) in configs.items():
        arrays, rng = problem(np.random.SeedSequence().entropy % 2**31, 2, lq, lk, hq, hkv, 16,
                              bias=bias_shape or False)
        if "lengths" in name:
            kwargs = dict(kwargs, query_seq_lengths=np.array([lq, 20], np.int32),
                          key_value_seq_lengths=np.array([lk - 23, 0], np.int32))
        if "segments" in name:
            kwargs = dict(kwargs,
                          q_segment_ids=np.sort(rng.integers(0, 3, (2, lq)), 1).astype(np.int32),
                          kv_segment_ids=np.sort(rng.integers(0, 3, (2, lk)), 1).astype(np.int32))
        mask = None if mask_shape is None else rng.random(mask_shape + (lq, lk)) < 0.7
        oracle_mask = {} if mask is None else dict(
            mask=np.broadcast_to(mask, (2, mask_shape[1], lq, lk)).copy())
        ref_out, ref_grads = torch_oracle(arrays, **kwargs, **oracle_mask)
        put = lambda x, spec=P(None, "seq"): jax.device_put(x, NamedSharding(mesh, spec))
        rows = P(None, None, "seq", None)  # bias/mask: query rows sharded, every key column
        kwargs = {key: put(val) if "segment" in key else val for key, val in kwargs.items()}
        mask_arg = None if mask is None else put(mask, rows)

        def loss(q, k, v, bias, ct):
            out = flash_attention(q, k, v, bias, mask_arg, implementation=implementation,
                                  **extra, **kwargs)
            return jnp.sum(out * ct), out

        constant = "constant" in name
        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2) if constant else (0, 1, 2, 3),
                                          has_aux=True))
        bias = None if bias_shape is None else put(arrays["bias"], rows)
        args = [put(arrays[n]) for n in ("q", "k", "v")] + [bias, put(arrays["ct"])]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hlo = grad.lower(*args).compile().as_text()
        (_, out), (dq, dk, dv, *dbias) = grad(*args)
        grads = dict(q=dq, k=dk, v=dv)
        if bias is not None and not constant:
            grads["bias"] = dbias = dbias[0]
        results[name] = dict(
            all_gathers=hlo.count("all-gather"), permutes=hlo.count("collective-permute"),
            all_to_alls=hlo.count("all-to-all("),
            out_spec=str(tuple(out.sharding.spec)[:2]), warnings=[str(w.message) for w in caught],
            dbias_spec=None if bias is None or constant else str(tuple(dbias.sharding.spec)),
            errors=max_errors(out, grads, ref_out, ref_grads))
    return results


def refused():
    """context_parallel_strategy="ring" for 72 keys over 8 devices (not 16 zigzag chunks):
    {"eager"|"jit": (exception type, message)}."""
    mesh = Mesh(np.array(jax.devices()), ("seq",))
    x = jax.device_put(np.random.default_rng().standard_normal((1, 72, 8, 16), np.float32),
                       NamedSharding(mesh, P(None, "seq")))
    ring = lambda q: flash_attention(q, q, q, context_parallel_strategy="ring")
    raised = {}
    for how, fn in (("eager", ring), ("jit", jax.jit(ring))):
        try:
            fn(x).block_until_ready()
            raised[how] = None
        except Exception as err:  # noqa: BLE001 (the type is what is reported)
            raised[how] = (type(err).__name__, str(err))
    return raised


def memory():
    shape = (1, 32768, 8, 64)

    def grad(q, k, v):
        f = lambda q, k, v: jnp.sum(flash_attention(q, k, v, is_causal=True, implementation="xla",
                                                    context_parallel_strategy="ring"))
        return jax.grad(f, argnums=(0, 1, 2))(q, k, v)

    figures = {}
    for n in (1, 8):
        mesh = Mesh(np.array(jax.devices()[:n]), ("seq",))
        arg = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P(None, "seq")))
        for name, fn in (("forward", lambda q, k, v: flash_attention(
                q, k, v, is_causal=True, implementation="xla", context_parallel_strategy="ring")),
                         ("forward_backward", grad)):
            compiled = jax.jit(fn).lower(arg, arg, arg).compile()
            m = compiled.memory_analysis()
            figures[f"{name}_{n}"] = dict(bytes=m.argument_size_in_bytes + m.temp_size_in_bytes,
                                          all_gathers=compiled.as_text().count("all-gather"))
    return figures


if __name__ == "__main__":
    if sys.argv[1] == "exact_a2a":
        print(json.dumps(dict(exact("xla", "all_to_all"), refused=refused())))
    else:
        print(json.dumps(exact(*sys.argv[2:]) if sys.argv[1] == "exact" else memory()))
