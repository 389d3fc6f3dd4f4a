"""The Mosaic TPU backward kernels (jax_impl/mosaic_tpu/backward.py) in the TPU interpreter on
the CPU: dq, dk, dv (and dbias) judged against torch_ref.manual_attention's float64 gradients.

The kernels are called directly with the RowStats of the xla forward (the forward they must
agree with: natural-log max and log-sum), so every case tests the backward alone. Tiny shapes:
an interpreted grid step costs milliseconds on the shared cores."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from _flash_helpers import torch_arrays
from jax_impl import dropout_sinks, implementations, masking, xla
from jax_impl.config import AttentionConfig, BlockSizes
from jax_impl.mosaic_tpu import backward as tpu_backward

B, HQ, HKV = 1, 2, 1          # GQA: two query heads share the kv head (summed in VMEM)
TILE = 128
BLOCKS = BlockSizes(TILE, TILE, TILE, TILE, TILE, TILE)
TOLERANCE = dict(atol=2e-5, rtol=1e-4)


@dataclasses.dataclass(frozen=True)
class Case:
    """One call: its static mask, the oracle's keyword arguments and the kernels' inputs."""
    lq: int = 256
    lk: int = 256
    d: int = 64
    spec: masking.MaskSpec = masking.MaskSpec()
    q_len: int | None = None
    kv_len: int | None = None
    segments: bool = False
    dense_mask: bool = False
    bias: bool = False
    soft_cap: float | None = None
    sinks: bool = False
    dropout_rate: float = 0.0
    mods: bool = False
    position_offset: int | None = None
    nonfinite: bool = False
    dtype: object = np.float32


CASES = {
    "gqa_d128_sinks": Case(d=128, sinks=True),
    # A non-finite key past kv_len: no row attends it, so it reaches no gradient.
    "causal_bottom_right_lengths_nonfinite_key": Case(lq=128, spec=masking.MaskSpec(
        is_causal=True, bottom_right=True, has_kv_lengths=True), kv_len=200, nonfinite=True),
    # L=200: the last tile is ragged (padded to 256 inside).
    "ragged_window_segments_softcap_dropout": Case(
        lq=200, lk=200, spec=masking.MaskSpec(window_left=64, window_right=0, has_q_lengths=True),
        q_len=190, segments=True, soft_cap=5.0, dropout_rate=0.3),
    "mods_bias_dbias_dense_mask": Case(spec=masking.MaskSpec(is_causal=True), mods=True,
                                       bias=True, dense_mask=True),
    # Causal top-left shifted by 128 keys: the bottom-right diagonal of a 128 x 256 call.
    "position_offset": Case(lq=128, spec=masking.MaskSpec(is_causal=True), position_offset=128),
}


def _distance_penalty(s, b, h, q_idx, kv_idx):  # a score_mod: ALiBi-like, per head
    return s - (0.05 * (h + 1)) * jnp.abs(q_idx - kv_idx).astype(jnp.float32)


def _no_multiples_of_five(b, h, q_idx, kv_idx):  # a mask_mod the band does not know
    return (kv_idx % 5 != 0) | (kv_idx == q_idx)


def _run(case: Case, seed: int = 0):
    """(got, oracle, xla's): dicts of float64 dq, dk, dv (and dbias); the race detector on."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    q, cot = normal(B, case.lq, HQ, case.d), normal(B, case.lq, HQ, case.d)
    k, v = normal(B, case.lk, HKV, case.d), normal(B, case.lk, HKV, case.d)
    q_len = np.full((B,), case.q_len or case.lq, np.int32)
    kv_len = np.full((B,), case.kv_len or case.lk, np.int32)
    if case.nonfinite:
        k[0, 230, 0, 3] = np.inf
    bottom_right = case.spec.bottom_right or case.position_offset is not None
    oracle_kwargs = dict(is_causal=case.spec.is_causal,
                         causal_alignment="bottom_right" if bottom_right else "top_left")
    if case.spec.window_left is not None:
        oracle_kwargs["local_window_size"] = (case.spec.window_left, case.spec.window_right)
    if case.q_len is not None:
        oracle_kwargs["query_seq_lengths"] = q_len
    if case.kv_len is not None:
        oracle_kwargs["key_value_seq_lengths"] = kv_len
    q_seg = kv_seg = mask = bias = None
    if case.segments:  # three documents, a boundary inside a tile
        q_seg = np.searchsorted([90, 150], np.arange(case.lq), side="right")[None].astype(np.int32)
        kv_seg = np.searchsorted([90, 150], np.arange(case.lk), side="right")[None].astype(np.int32)
        oracle_kwargs.update(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    rows, cols = np.arange(case.lq)[:, None], np.arange(case.lk)[None, :]
    oracle_mask = np.ones((B, HQ, case.lq, case.lk), bool)
    if case.dense_mask:
        mask = rng.random((B, HQ, case.lq, case.lk)) < 0.8
        mask[:, :, :, 0] = True
        oracle_mask &= mask
    if case.bias:
        bias = normal(B, HQ, case.lq, case.lk)
        bias[0, 1, 5, 7:20] = -np.inf  # excluded pairs: dbias 0 there
        oracle_kwargs["bias"] = bias
    extras = dropout_sinks.SinksAndDropout()
    if case.sinks:
        sinks = normal(1, HQ)
        extras = extras._replace(sinks=jnp.asarray(sinks))
        oracle_kwargs["attention_sinks"] = sinks[0]
    if case.dropout_rate:
        key = jax.random.key(seed + 7)
        seeds = dropout_sinks.head_seeds(dropout_sinks.key_words(key), B, HQ, False)
        extras = extras._replace(dropout_seeds=seeds)
        oracle_kwargs.update(dropout_rate=case.dropout_rate, dropout_mask=np.asarray(
            dropout_sinks.dropout_mask(key, (B, HQ, case.lq, case.lk), case.dropout_rate,
                                       broadcast_dropout=False)))
    config = {}
    if case.mods:
        config = dict(score_mod=_distance_penalty, mask_mod=_no_multiples_of_five)
        heads = np.arange(HQ)[:, None, None]
        oracle_kwargs["bias"] = oracle_kwargs.get("bias", 0.0) - (0.05 * (heads + 1)) * np.abs(
            rows - cols)[None].astype(np.float64)
        oracle_mask &= ((cols % 5 != 0) | (cols == rows))[None, None]
    if case.dense_mask or case.mods:
        oracle_kwargs["mask"] = oracle_mask
    if case.soft_cap is not None:
        oracle_kwargs["logits_soft_cap"] = case.soft_cap
    cfg = AttentionConfig(scale=case.d ** -0.5, mask=case.spec, block_sizes=BLOCKS,
                          logits_soft_cap=case.soft_cap, dropout_rate=case.dropout_rate,
                          interpret=pltpu.InterpretParams(detect_races=True), **config)
    as_jnp = lambda x: None if x is None else jnp.asarray(x)
    masks = masking.MaskInputs(jnp.asarray(q_len), jnp.asarray(kv_len), as_jnp(q_seg),
                               as_jnp(kv_seg), as_jnp(mask),
                               position_offset=None if case.position_offset is None
                               else jnp.full((B,), case.position_offset, jnp.int32))
    q, k, v, cot_j = (jnp.asarray(x, case.dtype) for x in (q, k, v, cot))
    bias_j = as_jnp(bias)
    out, stats = xla.forward(cfg, q, k, v, bias_j, masks, extras)
    delta = jnp.einsum("bqhd,bqhd->bhq", cot_j, out)
    grads = lambda fn: dict(zip(("dq", "dk", "dv", "dbias"), fn(
        cfg, q, k, v, bias_j, masks, stats, cot_j, delta, extras)[:3 + case.bias]))
    got, by_xla = grads(tpu_backward.backward), grads(xla.backward)
    oracle = torch_arrays(*(np.asarray(x.astype(jnp.float32)) for x in (q, k, v, cot_j)),
                          **oracle_kwargs)
    as_np = lambda d: {n: np.asarray(x.astype(jnp.float32), np.float64) for n, x in d.items()}
    return as_np(got), oracle, as_np(by_xla)


def _judge(got, oracle):
    for name, x in got.items():
        np.testing.assert_allclose(x, oracle[name], **TOLERANCE, err_msg=name)


@pytest.mark.parametrize("name", list(CASES))
def test_backward_matches_the_float64_oracle(name):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # no public accessor
    got, oracle, _ = _run(CASES[name])
    _judge(got, oracle)
    assert not interpret_pallas_call.races.races_found  # no unordered access between grid steps


def test_bfloat16_head_dim_256_as_close_as_the_xla_path():
    """bf16 at D=256: products round to bf16 in both paths, so the kernels' error against the
    float64 oracle (of the same bf16 inputs) is judged against the xla path's own."""
    got, oracle, by_xla = _run(Case(lq=128, lk=256, d=256, spec=masking.MaskSpec(is_causal=True),
                                    dtype=jnp.bfloat16))
    for name, x in got.items():
        error, xla_error = (np.max(np.abs(y - oracle[name])) for y in (x, by_xla[name]))
        assert error <= 2 * xla_error + 1e-3, (name, error, xla_error)


def test_tiles_not_a_multiple_of_the_lanes_are_refused():
    cfg = AttentionConfig(scale=1.0, mask=masking.MaskSpec(), interpret=True,
                          block_sizes=BlockSizes(64, 64, 64, 128, 128, 128))
    with pytest.raises(ValueError, match="block_q_dkv=64 must be a multiple of 128"):
        tpu_backward.blocks(cfg, 256, 256)


@pytest.mark.skipif("mosaic_tpu" not in implementations.IMPLEMENTATIONS,
                    reason="the mosaic_tpu registration (forward helper's) is not merged")
def test_gradient_through_flash_attention():
    from jax_impl.flash_attention import flash_attention
    rng = np.random.default_rng(5)
    q, cot = (rng.standard_normal((B, 256, HQ, 64)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((B, 256, HKV, 64)).astype(np.float32) for _ in range(2))
    loss = lambda q, k, v: jnp.sum(flash_attention(
        q, k, v, is_causal=True, implementation="mosaic_tpu", interpret=True,
        block_sizes=BLOCKS) * cot)
    grads = jax.grad(loss, argnums=(0, 1, 2))(*map(jnp.asarray, (q, k, v)))
    oracle = torch_arrays(q, k, v, cot, is_causal=True)
    _judge(dict(zip(("dq", "dk", "dv"), (np.asarray(g, np.float64) for g in grads))), oracle)
