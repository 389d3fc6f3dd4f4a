"""Dropout and attention sinks through the ring / the all-to-all on 8 devices, fwd+bwd.

argv: "jit" (flash_attention under plain jax.jit, q/k/v sharded P(None, "seq"): partitioned.py
      routes to the ring) or "shard_map" (ring_attention inside jax.shard_map, both layouts);
      "jit_a2a" / "shard_map_a2a": the same with context_parallel_strategy="all_to_all" /
      ulysses_attention; "jit_hybrid": a (2, 4) mesh, the sequence over both axes
      (P(None, ("host", "chip"))), context_parallel_strategy="hybrid"; "shard_map_pallas":
      ring_attention with the Pallas Triton kernels interpreted; then config names.
Prints {config: {errors: vs torch_ref float64 (dropout: with jax_impl.dropout_mask's pattern,
the definition of the pattern), single: max |ring - one-device call| (out and grads), pattern:
the kept (query, key) pairs read off the ring's output (V = one-hot of the key index, so
out[i, h, j] = P_drop[i, j]) equal the one-device call's and the dropout mask's, bit for bit,
all_gathers, permutes}}.
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from _common import max_errors, problem
from torch_ref import attention_with_grads, manual_attention
from jax_impl import dropout_mask, ring
from jax_impl.context_parallel import hybrid_attention, ring_attention, ulysses_attention
from jax_impl.flash_attention import flash_attention

N = 8
RATE = 0.3
# The Triton kernels, interpreted, as each ring step's kernel (shard_map_pallas).
PALLAS_INTERPRETED = dict(implementation="pallas_triton", interpret=True)
CONFIGS = {
    # name: (b, lq, lk, hq, hkv, d, layout (shard_map), kwargs, sinks shape or None, dropout)
    "dropout_causal_gqa": (2, 64, 64, 4, 2, 16, "zigzag", dict(is_causal=True), None,
                           dict(broadcast_dropout=False)),
    "sinks_causal_gqa": (2, 64, 64, 4, 2, 16, "zigzag", dict(is_causal=True), (4,), None),
    "dropout_sinks_bottom_right_lengths": (
        2, 32, 64, 2, 1, 16, "contiguous", dict(is_causal=True, causal_alignment="bottom_right",
                                                query_seq_lengths=np.array([29, 32], np.int32),
                                                key_value_seq_lengths=np.array([64, 40], np.int32)),
        (2, 2), dict(broadcast_dropout=True)),
    # V = one-hot of the key index (D = Lk): the output exposes each row's kept pairs.
    "dropout_pattern_causal": (1, 64, 64, 2, 2, 64, "zigzag", dict(is_causal=True), None,
                               dict(broadcast_dropout=False)),
    # The all-to-all needs heads divisible by the 8 devices.
    "a2a_causal_gqa_dropout_sinks": (2, 64, 64, 16, 8, 16, "contiguous", dict(is_causal=True),
                                     (16,), dict(broadcast_dropout=False)),
    "a2a_bottom_right_window_lengths_segments": (
        2, 32, 64, 8, 8, 16, "contiguous",
        dict(is_causal=True, causal_alignment="bottom_right", local_window_size=(21, None),
             query_seq_lengths=np.array([29, 32], np.int32),
             key_value_seq_lengths=np.array([64, 40], np.int32), segments=True), None, None),
    "hybrid_causal_gqa_dropout_sinks": (2, 64, 64, 8, 4, 16, "contiguous", dict(is_causal=True),
                                        (2, 8), dict(broadcast_dropout=False)),
    "a2a_dropout_pattern_causal": (1, 64, 64, 8, 8, 64, "contiguous", dict(is_causal=True), None,
                                   dict(broadcast_dropout=False)),
}


def _setup(name):
    b, lq, lk, hq, hkv, d, layout, kwargs, sinks_shape, dropout = CONFIGS[name]
    kwargs = dict(kwargs)
    seed = np.random.SeedSequence().entropy % 2**31
    arrays, rng = problem(seed, b, lq, lk, hq, hkv, d)
    if "pattern" in name:
        arrays["v"] = np.broadcast_to(np.eye(lk, dtype=np.float32)[None, :, None, :],
                                      (b, lk, hkv, lk)).copy()
    if sinks_shape is not None:
        arrays["sinks"] = rng.standard_normal(sinks_shape).astype(np.float32)
    if kwargs.pop("segments", False):
        kwargs = dict(kwargs, **{f"{side}_segment_ids": np.sort(rng.integers(0, 3, (b, n)), 1).astype(np.int32)
                                 for side, n in (("q", lq), ("kv", lk))})
    features = {}
    if dropout is not None:
        features = dict(dropout_rng=jax.random.key(int(rng.integers(2**31))), dropout_rate=RATE,
                        **dropout)
    return arrays, layout, kwargs, features


def _oracle(arrays, kwargs, features):
    """torch_ref float64 with the pattern of jax_impl.dropout_mask."""
    b, lq, hq, _ = arrays["q"].shape
    extra = {}
    if features:
        mask = dropout_mask(features["dropout_rng"], (b, hq, lq, arrays["k"].shape[1]), RATE,
                            broadcast_dropout=features["broadcast_dropout"])
        extra = dict(dropout_mask=np.asarray(mask), dropout_rate=RATE)
    if "sinks" in arrays:
        extra["attention_sinks"] = np.asarray(arrays["sinks"], np.float64)
    c64 = lambda x: np.asarray(x, np.float64)
    ref = attention_with_grads(manual_attention, *(c64(arrays[n]) for n in ("q", "k", "v", "ct")),
                               **kwargs, **extra)
    grads = {n: ref["d" + n] for n in ("q", "k", "v", "sinks") if "d" + n in ref}
    return ref["out"], grads, extra.get("dropout_mask")


def _loss(attend, names):
    def loss(*xs):
        named = dict(zip(names, xs))
        out = attend(named)
        return jnp.sum(out * named["ct"]), out
    return jax.value_and_grad(loss, argnums=tuple(i for i, n in enumerate(names) if n != "ct"),
                              has_aux=True)


def _results(name, arrays, kwargs, features, sharded_attend, hlo_of):
    names = [n for n in ("q", "k", "v", "sinks", "ct") if n in arrays]
    single = lambda a: flash_attention(a["q"], a["k"], a["v"], attention_sinks=a.get("sinks"),
                                       implementation="xla", **kwargs, **features)
    args = [jnp.asarray(arrays[n]) for n in names]
    (_, out_1), grads_1 = jax.jit(_loss(single, names))(*args)
    grad = jax.jit(_loss(sharded_attend, names))
    hlo, args = hlo_of(grad, args)
    (_, out), grads = grad(*args)
    grad_names = [n for n in names if n != "ct"]
    ref_out, ref_grads, mask = _oracle(arrays, kwargs, features)
    errors = max_errors(out, dict(zip(grad_names, grads)), ref_out, ref_grads)
    single_diff = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                      for x, y in zip((out,) + tuple(grads), (out_1,) + tuple(grads_1)))
    result = dict(errors=errors, single=single_diff, all_gathers=hlo.count("all-gather"),
                  permutes=hlo.count("collective-permute"), all_to_alls=hlo.count("all-to-all("),
                  _values=(out,) + tuple(grads))
    if "pattern" in name:
        kept = np.moveaxis(np.asarray(out) > 0, 2, 1)  # [B, Hq, Lq, Lk]
        lq, lk = kept.shape[-2:]
        causal = np.tril(np.ones((lq, lk), bool))
        result["pattern"] = dict(
            same_as_single=bool(np.array_equal(kept, np.moveaxis(np.asarray(out_1) > 0, 2, 1))),
            same_as_mask=bool(np.array_equal(kept, mask & causal)),
            kept_fraction=float(kept.sum() / causal.sum() / kept.shape[0] / kept.shape[1]))
    return result


def run_jit(name, strategy=None, setup=None):
    arrays, _, kwargs, features = setup or _setup(name)
    if strategy == "hybrid":  # (2, 4): the sequence over both axes, all-to-all over "chip"
        mesh = Mesh(np.array(jax.devices()[:N]).reshape(2, 4), ("host", "chip"))
        seq_axes = ("host", "chip")
    else:
        mesh, seq_axes = Mesh(np.array(jax.devices()[:N]), ("seq",)), "seq"
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))

    def attend(a):
        return flash_attention(a["q"], a["k"], a["v"], attention_sinks=a.get("sinks"),
                               implementation="xla", context_parallel_strategy=strategy,
                               **kwargs, **features)

    def hlo_of(grad, args):
        specs = {n: P(None, seq_axes) if n in ("q", "k", "v", "ct") else P() for n in arrays}
        sharded = [put(x, specs[n]) for n, x in zip([n for n in ("q", "k", "v", "sinks", "ct")
                                                      if n in arrays], args)]
        return grad.lower(*sharded).compile().as_text(), sharded

    return _results(name, arrays, kwargs, features, attend, hlo_of)


def run_shard_map(name, attention=ring_attention, setup=None, kernel=None):
    arrays, layout, kwargs, features = setup or _setup(name)
    if attention is hybrid_attention:  # (host=2, chip=4): the sequence over both, natural order
        mesh, layout = Mesh(np.array(jax.devices()[:N]).reshape(2, 4), ("host", "chip")), "contiguous"
        seq_axes, axes = ("host", "chip"), dict(all_to_all_axis="chip", ring_axis="host")
    else:
        mesh, seq_axes, axes = Mesh(np.array(jax.devices()[:N]), ("seq",)), "seq", dict(axis_name="seq")
    zigzag = layout == "zigzag"
    order = lambda x: ring.to_zigzag(x, N, 1) if zigzag else x
    unorder = lambda x: ring.from_zigzag(x, N, 1) if zigzag else x
    seq = P(None, seq_axes)
    rng = features.get("dropout_rng")
    options = {n: v for n, v in features.items() if n != "dropout_rng"}
    traced = [n for n in ("query_seq_lengths", "key_value_seq_lengths", "q_segment_ids",
                          "kv_segment_ids") if n in kwargs]
    specs = {n: P() if "lengths" in n else seq for n in traced}
    lengths = {n: order(kwargs[n]) if "segment" in n else kwargs[n] for n in traced}
    static = {n: v for n, v in kwargs.items() if n not in lengths}
    if attention is ring_attention:
        static["layout"] = layout

    def body(q, k, v, sinks, key, lens):
        return attention(q, k, v, **axes, **(kernel or dict(implementation="xla")),
                         attention_sinks=sinks, dropout_rng=key, **lens, **static, **options)

    def attend(a):
        sinks = a.get("sinks")
        key = rng if rng is not None else None
        # The Pallas interpreter mixes varying and unvarying values: check_vma=False for it.
        sharded = jax.shard_map(body, mesh=mesh, out_specs=seq,
                                in_specs=(seq, seq, seq, P(), P(), specs),
                                check_vma=not (kernel or {}).get("interpret", False))
        return unorder(sharded(order(a["q"]), order(a["k"]), order(a["v"]), sinks, key, lengths))

    return _results(name, arrays, kwargs, features, attend,
                    lambda grad, args: (grad.lower(*args).compile().as_text(), args))


def hybrid_both(name):
    """hybrid_attention in shard_map on a (2, 4) mesh, and the plain-jit hybrid on the same
    arrays: the former's result with ``jit_agreement``, max |shard_map - jit| (out and grads),
    and the latter's result as ``jit``."""
    setup = _setup(name)
    explicit = run_shard_map(name, hybrid_attention, setup)
    under_jit = run_jit(name, "hybrid", setup)
    explicit["jit_agreement"] = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                                    for x, y in zip(explicit["_values"], under_jit["_values"]))
    explicit["jit"] = {k: v for k, v in under_jit.items() if k != "_values"}
    return explicit


def sinks_without_vma():
    """dsinks of ring_attention and ulysses_attention under check_vma True and False (the
    Pallas interpreter's setting), max |error| against the one-device call's."""
    mesh = Mesh(np.array(jax.devices()[:N]), ("seq",))
    rng = np.random.default_rng(np.random.SeedSequence().entropy % 2**31)
    q = rng.standard_normal((1, 64, 8, 16)).astype(np.float32)
    sinks = rng.standard_normal((8,)).astype(np.float32)
    seq = P(None, "seq")
    one = jax.grad(lambda s: jnp.sum(jnp.sin(flash_attention(
        q, q, q, attention_sinks=s, implementation="xla"))))(sinks)
    errors = {}
    two_axes = Mesh(np.array(jax.devices()[:N]).reshape(2, 4), ("host", "chip"))
    for attention in (ring_attention, ulysses_attention, hybrid_attention):
        for check in (True, False):
            kw = dict(layout="contiguous", axis_name="seq") if attention is ring_attention else (
                dict(axis_name="seq") if attention is ulysses_attention else
                dict(all_to_all_axis="chip", ring_axis="host"))
            on = (two_axes, P(None, ("host", "chip"))) if attention is hybrid_attention else (mesh, seq)
            mapped = jax.shard_map(
                lambda q, s: attention(q, q, q, attention_sinks=s, implementation="xla", **kw),
                mesh=on[0], in_specs=(on[1], P()), out_specs=on[1], check_vma=check)
            got = jax.jit(jax.grad(lambda s: jnp.sum(jnp.sin(mapped(q, s)))))(sinks)
            errors[f"{attention.__name__}_{check}"] = float(np.max(np.abs(got - one)))
    return errors


if __name__ == "__main__":
    if sys.argv[1] == "sinks_without_vma":
        print(json.dumps(sinks_without_vma()))
        sys.exit()
    mode, names = sys.argv[1], sys.argv[2:]
    run = dict(jit=lambda n: run_jit(n, "ring"), shard_map=run_shard_map,
               jit_a2a=lambda n: run_jit(n, "all_to_all"), jit_hybrid=lambda n: run_jit(n, "hybrid"),
               shard_map_a2a=lambda n: run_shard_map(n, ulysses_attention),
               shard_map_hybrid=lambda n: hybrid_both(n),
               shard_map_pallas=lambda n: run_shard_map(n, kernel=PALLAS_INTERPRETED))[mode]
    results = {name: run(name) for name in names}
    print(json.dumps({name: {k: v for k, v in r.items() if k != "_values"}
                      for name, r in results.items()}))
