"""MaskInputs.position_offset (what ring attention passes per chunk pair) in the Pallas kernels
(forward, dK/dV, dQ; interpreter) and the xla path, judged by torch_ref.manual_attention in
float64 with a dense mask built here in numpy: allowed when the shifted band holds."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _flash_helpers import torch_arrays
from jax_impl import dropout_sinks, implementations, masking, recompute_vjp
from jax_impl.config import AttentionConfig, BlockSizes

TOL = 2e-5


def _numpy_mask(b, lq, lk, offsets, causal, window, q_len, kv_len):
    i = np.arange(lq)[None, :, None]
    j = np.arange(lk)[None, None, :]
    off = np.asarray(offsets)[:, None, None]
    allowed = (i < np.asarray(q_len)[:, None, None]) & (j < np.asarray(kv_len)[:, None, None])
    if causal:
        allowed &= j <= i + off
    if window is not None:
        left, right = window
        if left is not None:
            allowed &= j >= i + off - left
        if right is not None:
            allowed &= j <= i + off + right
    return np.broadcast_to(allowed[:, None], (b, 1, lq, lk)).copy()


@pytest.mark.parametrize("implementation", ["pallas_triton", "xla", "cpu"])
@pytest.mark.parametrize("causal,window,lengths", [
    (True, None, False), (False, (7, 3), False), (True, (12, None), True)],
    ids=["causal", "window", "causal_window_lengths"])
def test_position_offset_shifts_the_band(implementation, causal, window, lengths):
    rng = np.random.default_rng()
    b, lq, lk, hq, hkv, d = 3, 40, 48, 4, 2, 16
    normal = lambda *s: rng.standard_normal(s).astype(np.float32)
    q, k, v, ct = normal(b, lq, hq, d), normal(b, lk, hkv, d), normal(b, lk, hkv, d), normal(b, lq, hq, d)
    offsets = np.array([17, -9, 40], np.int32)  # the last row: every query sees every key
    q_len = np.array([lq, 33, 21] if lengths else [lq] * b, np.int32)
    kv_len = np.array([lk, 44, 5] if lengths else [lk] * b, np.int32)
    spec = masking.MaskSpec(is_causal=causal, window_left=None if window is None else window[0],
                            window_right=None if window is None else window[1],
                            has_q_lengths=lengths, has_kv_lengths=lengths)
    cfg = AttentionConfig(scale=d ** -0.5, mask=spec, interpret=implementation == "pallas_triton",
                          block_sizes=BlockSizes(16, 64 if implementation == "cpu" else 16,
                                                 16, 16, 16, 16))  # several tiles (cpu: 64-key panels)
    masks = masking.MaskInputs(jnp.asarray(q_len), jnp.asarray(kv_len), None, None, None,
                               position_offset=jnp.asarray(offsets))

    def attend(q, k, v):
        return recompute_vjp.attention(implementations.get(implementation), cfg, q, k, v, None, masks,
                                       dropout_sinks.SinksAndDropout())[0]

    out, vjp = jax.vjp(attend, q, k, v)
    dq, dk, dv = vjp(jnp.asarray(ct))
    mask = _numpy_mask(b, lq, lk, offsets, causal, window, q_len, kv_len)
    assert mask[0].any() and not mask[0].all()  # the offset matters in this case
    ref = torch_arrays(q, k, v, ct, mask=mask)
    errors = {name: float(np.max(np.abs(np.asarray(x, np.float64) - ref[name])))
              for name, x in dict(out=out, dq=dq, dk=dk, dv=dv).items()}
    assert max(errors.values()) < TOL, errors


def test_ring_with_pallas_kernels_lowers_to_triton_for_cuda():
    """ring_attention's local step with implementation="pallas_triton" (compiled, not the
    interpreter) inside jax.shard_map with the default check_vma=True, forward and backward,
    exported for CUDA: the three kernels lower with the position offset and bias columns."""
    from jax_impl.pallas_triton.export import cuda_mesh, export_for_cuda
    from jax.sharding import PartitionSpec as P

    from jax_impl.context_parallel import ring_attention

    mesh = cuda_mesh("seq")
    seq, rows = P(None, "seq"), P(None, None, "seq", None)

    def loss(q, k, v, bias):
        body = lambda q, k, v, bias: ring_attention(
            q, k, v, bias, axis_name="seq", implementation="pallas_triton", is_causal=True,
            causal_alignment="bottom_right", key_value_seq_lengths=jnp.array([70, 33], jnp.int32))
        out = jax.shard_map(body, mesh=mesh, in_specs=(seq, seq, seq, rows), out_specs=seq)(q, k, v, bias)
        return jnp.sum(out.astype(jnp.float32))

    sd = jax.ShapeDtypeStruct
    shapes = [sd((2, 64, 4, 64), jnp.bfloat16), sd((2, 96, 2, 64), jnp.bfloat16),
              sd((2, 96, 2, 64), jnp.bfloat16), sd((1, 4, 64, 96), jnp.float32)]
    exported = export_for_cuda(jax.grad(loss, argnums=(0, 1, 2, 3)), *shapes, axis_name="seq")
    kernels = set(re.findall(r'name = "(flash_attention_\w+)"', exported.mlir_module()))
    assert kernels == {"flash_attention_forward", "flash_attention_backward_dkdv",
                       "flash_attention_backward_dq"}
