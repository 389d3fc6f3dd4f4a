"""ring_attention inside shard_map over 8 devices vs the float64 dense oracle on one device.

argv: implementation, then config names (CONFIGS). Prints {config: {out, dq, dk, dv: max |err|}}.
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from _common import max_errors, oracle, problem
from jax_impl import ring
from jax_impl.context_parallel import ring_attention

N = 8
CONFIGS = {
    # name: (b, lq, lk, hq, hkv, d, layout, kwargs, lengths, segments)
    "causal_top_left": (2, 64, 64, 2, 2, 16, "zigzag", dict(is_causal=True), None, False),
    "bottom_right_gqa_window_lengths_segments": (
        2, 32, 64, 4, 2, 16, "zigzag",
        dict(is_causal=True, causal_alignment="bottom_right", local_window_size=(21, None)),
        ([29, 0], [50, 64]), True),
    "contiguous_window_kv_lengths": (
        1, 32, 32, 2, 1, 16, "contiguous", dict(local_window_size=(5, 3)), (None, [19]), False),
}


def run(name, implementation):
    b, lq, lk, hq, hkv, d, layout, kwargs, lengths, segments = CONFIGS[name]
    arrays, rng = problem(hash(name) % 1000, b, lq, lk, hq, hkv, d)
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
    ref_out, ref_grads = oracle(arrays, **full_kwargs)

    mesh = Mesh(np.array(jax.devices()[:N]), ("seq",))
    order = (lambda x: ring.to_zigzag(x, N, 1)) if layout == "zigzag" else (lambda x: x)
    unorder = (lambda x: ring.from_zigzag(x, N, 1)) if layout == "zigzag" else (lambda x: x)
    seq = P(None, "seq")
    seg_args = () if not segments else (order(jnp.asarray(full_kwargs["q_segment_ids"])),
                                        order(jnp.asarray(full_kwargs["kv_segment_ids"])))

    def body(q, k, v, lens, *segs):
        return ring_attention(q, k, v, axis_name="seq", layout=layout, implementation=implementation,
                              **dict(zip(("q_segment_ids", "kv_segment_ids"), segs)),
                              **lens, **kwargs)

    sharded = jax.shard_map(body, mesh=mesh, in_specs=(seq, seq, seq, P(), *[seq] * len(seg_args)),
                            out_specs=seq)

    @jax.jit
    def f(q, k, v):
        return unorder(sharded(order(q), order(k), order(v), extra, *seg_args))

    out, vjp = jax.vjp(f, arrays["q"], arrays["k"], arrays["v"])
    dq, dk, dv = vjp(arrays["ct"])
    return max_errors(out, dict(q=dq, k=dk, v=dv), ref_out, ref_grads)


if __name__ == "__main__":
    implementation, names = sys.argv[1], sys.argv[2:]
    print(json.dumps({name: run(name, implementation) for name in names}))
