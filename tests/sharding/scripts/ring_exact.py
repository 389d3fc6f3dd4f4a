"""ring_attention inside shard_map over 8 devices vs torch_ref.manual_attention in float64.

argv: implementation ("xla", "pallas_triton" in the Pallas interpreter, or "cpu", the fused
C++ kernel: configs without bias or mask; "ulysses": ulysses_attention, kernel xla), then config names (CONFIGS). Prints {config: {out, dq, dk, dv[, dbias]: max |err|}}.

Bias and mask are global ``[Bx, Hx, Lq, Lk]`` arrays in natural order; each device gets its
query rows (reordered like the queries for the zigzag layout) and every key column.
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from _common import max_errors, problem, torch_oracle
from jax_impl import ring
from jax_impl.context_parallel import ring_attention, ulysses_attention

N = 8
CONFIGS = {
    # name: (b, lq, lk, hq, hkv, d, layout, kwargs, lengths, segments, pairwise)
    # pairwise: {"bias": (Bb, Hb), "mask": (Bm, Hm)} given to ring_attention
    "causal_top_left": (2, 64, 64, 2, 2, 16, "zigzag", dict(is_causal=True), None, False, {}),
    "bottom_right_gqa_window_lengths_segments": (
        2, 32, 64, 4, 2, 16, "zigzag",
        dict(is_causal=True, causal_alignment="bottom_right", local_window_size=(21, None)),
        ([29, 0], [50, 64]), True, {}),
    "contiguous_window_kv_lengths": (
        1, 32, 32, 2, 1, 16, "contiguous", dict(local_window_size=(5, 3)), (None, [19]), False, {}),
    "bias_causal_gqa": (2, 32, 64, 4, 2, 16, "zigzag", dict(is_causal=True), None, False,
                        {"bias": (2, 4)}),
    "bias_broadcast_mask_bottom_right_lengths": (
        2, 64, 32, 2, 1, 16, "zigzag", dict(is_causal=True, causal_alignment="bottom_right"),
        ([60, 17], None), False, {"bias": (1, 2), "mask": (2, 1)}),
    "contiguous_bias_mask_window": (1, 32, 32, 2, 2, 16, "contiguous",
                                    dict(local_window_size=(9, 2)), None, False,
                                    {"bias": (1, 1), "mask": (1, 2)}),
    # Not differentiated: the ring's backward computes no dbias.
    "constant_bias_causal": (2, 32, 32, 2, 2, 16, "zigzag", dict(is_causal=True), None, False,
                             {"bias": (2, 2)}),
    # For ulysses_attention (argv "ulysses"): heads divisible by 8, a bias/mask per head.
    "a2a_bias_mask_causal_gqa_lengths_segments": (
        2, 32, 64, 16, 8, 16, "contiguous", dict(is_causal=True, causal_alignment="bottom_right"),
        ([29, 32], [64, 40]), True, {"bias": (1, 16), "mask": (2, 16)}),
}


def run(name, implementation):
    b, lq, lk, hq, hkv, d, layout, kwargs, lengths, segments, pairwise = CONFIGS[name]
    arrays, rng = problem(np.random.SeedSequence().entropy % 2**31, b, lq, lk, hq, hkv, d,
                          bias=pairwise.get("bias", False))
    full_kwargs = dict(kwargs)
    extra = {}
    if lengths is not None:
        for key, value in zip(("query_seq_lengths", "key_value_seq_lengths"), lengths):
            if value is not None:
                full_kwargs[key] = extra[key] = np.asarray(value, np.int32)
    if segments:
        q_seg = np.sort(rng.integers(0, 3, (b, lq)), axis=1).astype(np.int32)
        kv_seg = np.sort(rng.integers(0, 3, (b, lk)), axis=1).astype(np.int32)
        full_kwargs.update(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    mask = None
    if "mask" in pairwise:
        mask = rng.random(pairwise["mask"] + (lq, lk)) < 0.7
        full_kwargs["mask"] = np.broadcast_to(mask, (b, pairwise["mask"][1], lq, lk)).copy()
    ref_out, ref_grads = torch_oracle(arrays, **full_kwargs)

    mesh = Mesh(np.array(jax.devices()[:N]), ("seq",))
    zigzag = layout == "zigzag"
    order = lambda x, axis=1: ring.to_zigzag(x, N, axis) if zigzag else x
    unorder = lambda x, axis=1: ring.from_zigzag(x, N, axis) if zigzag else x
    seq, rows = P(None, "seq"), P(None, None, "seq", None)
    seg_args = () if not segments else (order(jnp.asarray(full_kwargs["q_segment_ids"])),
                                        order(jnp.asarray(full_kwargs["kv_segment_ids"])))
    attention = ring_attention
    if implementation == "ulysses":  # ulysses_attention, local kernel xla
        attention, implementation = ulysses_attention, "xla"
        options = dict(implementation="xla", **kwargs)
    else:
        options = dict(layout=layout, implementation=implementation,
                       interpret=implementation == "pallas_triton", **kwargs)

    def body(q, k, v, bias, mask, lens, *segs):
        return attention(q, k, v, bias, mask, axis_name="seq",
                         **dict(zip(("q_segment_ids", "kv_segment_ids"), segs)),
                         **lens, **options)

    pair_spec = lambda x: None if x is None else rows
    bias = arrays.get("bias")
    sharded = jax.shard_map(
        body, mesh=mesh, out_specs=seq, check_vma=implementation != "pallas_triton",
        in_specs=(seq, seq, seq, pair_spec(bias), pair_spec(mask), P(), *[seq] * len(seg_args)))

    @jax.jit
    def f(q, k, v, bias):
        pairwise_rows = lambda x: None if x is None else order(x, 2)  # rows only: keys stay natural
        return unorder(sharded(order(q), order(k), order(v), pairwise_rows(bias),
                               pairwise_rows(None if mask is None else jnp.asarray(mask)),
                               extra, *seg_args))

    if "constant" in name:
        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, bias), arrays["q"], arrays["k"], arrays["v"])
        dq, dk, dv = vjp(arrays["ct"])
        return max_errors(out, dict(q=dq, k=dk, v=dv), ref_out, ref_grads)
    out, vjp = jax.vjp(f, arrays["q"], arrays["k"], arrays["v"], bias)
    dq, dk, dv, dbias = vjp(arrays["ct"])
    grads = dict(q=dq, k=dk, v=dv) if bias is None else dict(q=dq, k=dk, v=dv, bias=dbias)
    return max_errors(out, grads, ref_out, ref_grads)


def interpreter_refusal():
    """The Pallas interpreter under shard_map's default check_vma=True: refused by name."""
    mesh = Mesh(np.array(jax.devices()[:N]), ("seq",))
    body = lambda q: ring_attention(q, q, q, axis_name="seq", implementation="pallas_triton",
                                    interpret=True)
    try:
        jax.shard_map(body, mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))(
            jnp.asarray(np.random.default_rng().standard_normal((1, 32, 1, 16)), jnp.float32))
    except ValueError as err:
        return str(err)
    return None


if __name__ == "__main__":
    if sys.argv[1] == "refusal":
        print(json.dumps({"message": interpreter_refusal()}))
        sys.exit()
    implementation, names = sys.argv[1], sys.argv[2:]
    print(json.dumps({name: run(name, implementation) for name in names}))
