"""pallas_triton.decode, the split-K decode kernel (dense caches), in the Pallas interpreter
against torch_ref.manual_attention in float64; its program count; and (pip triton) its
compile for sm_90a without spills."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_ref
from jax_impl import dropout_sinks, explain_implementation, flash_attention, masking
from jax_impl.config import AttentionConfig
from jax_impl.pallas_triton import decoding as pallas_decode
from jax_impl.pallas_triton.layout import tiles
from test_decode import HEADS_FIRST, _inputs, _oracle


def test_decode_kernel_matches_the_oracle_with_gradients():
    """Through flash_attention (interpret=True): the decode kernel forward, the Triton backward
    from its RowStats."""
    rng, (q, k, v), cot = _inputs(21, 2, 2, 4, 2, 520, 16)
    lengths = jnp.asarray([520, 301], jnp.int32)
    kw = dict(is_causal=True, causal_alignment="bottom_right", key_value_seq_lengths=lengths)
    assert explain_implementation(q, k, v, implementation="pallas_triton", interpret=True, **kw).path == "decode"
    out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, implementation="pallas_triton",
                                                       interpret=True, **kw), q, k, v)
    expected, expected_grads = _oracle(q, k, v, cot, **kw)
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5)
    for got, want in zip(vjp(jnp.asarray(cot)), expected_grads):
        np.testing.assert_allclose(np.asarray(got), want, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("lq,hq,hkv,window,cap,sinks", [
    (1, 8, 2, (150, 0), None, True), (16, 2, 1, None, 3.0, False), (3, 3, 3, (40, 5), None, True)],
    ids=["gqa_window_sinks", "mqa_16_rows_softcap", "mha_window_right"])
def test_decode_kernel_features(lq, hq, hkv, window, cap, sinks):
    b, lk, d = 2, 300, 24  # D and Lk not tile multiples
    rng, (q, k, v), _ = _inputs(lq + hq, b, lq, hq, hkv, lk, d)
    kv_len = np.array([300, 130], np.int32)
    offsets = np.array([0, 7], np.int32)
    spec = masking.MaskSpec(is_causal=True, bottom_right=True, has_kv_lengths=True,
                            window_left=None if window is None else window[0],
                            window_right=None if window is None else window[1])
    cfg = AttentionConfig(scale=0.3, mask=spec, logits_soft_cap=cap, interpret=True)
    sink_values = rng.standard_normal((1, hq)).astype(np.float32) if sinks else None
    masks = masking.MaskInputs(jnp.full((b,), lq, jnp.int32), jnp.asarray(kv_len), None, None, None,
                               jnp.asarray(offsets))
    out, _ = pallas_decode.decode(cfg, q, k, v, masks, dropout_sinks.SinksAndDropout(
        sinks=None if sink_values is None else jnp.asarray(sink_values)))
    i, j = np.arange(lq)[None, :, None], np.arange(lk)[None, None, :]
    diagonal = i + (kv_len - lq + offsets)[:, None, None]
    allowed = (j < kv_len[:, None, None]) & (j <= diagonal)
    if window is not None:
        allowed &= (j >= diagonal - window[0]) & (j <= diagonal + window[1])
    expected = torch_ref.manual_attention(
        *(HEADS_FIRST(x) for x in (q, k, v)), scale=0.3, logits_soft_cap=cap,
        mask=torch.tensor(allowed[:, None]),
        attention_sinks=None if sink_values is None else torch.tensor(sink_values[0], dtype=torch.float64))
    np.testing.assert_allclose(np.asarray(out), expected.permute(0, 2, 1, 3).numpy(), atol=2e-5)


def test_decode_kernel_fills_an_h100():
    """B=1, Hkv=8, one query row, 65,536 keys: at least 132 programs (one per SM)."""
    block_k = 64
    runs = pallas_decode.decode_runs(1, 8, tiles(65536, block_k))
    assert runs * 1 * 8 >= 132


def test_decode_kernel_compiles_for_sm90a_without_spills():
    pytest.importorskip("triton", reason="pip triton (the `test` extra) compiles the kernel for sm_90a")
    from benchmarks import compile_report
    kernel, grid = compile_report.decode_kernel()
    assert grid[0] * grid[1] * grid[2] >= 132, grid
    facts = compile_report.compile_kernel(kernel)
    assert facts["ptxas_ok"], facts["error"]
    assert facts["spill_stores"] == 0 and facts["spill_loads"] == 0, facts
