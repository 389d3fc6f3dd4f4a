"""Block-sparse attention and user score/mask functions in the Pallas Triton kernels (interpret
mode): the forward, dK/dV and dQ kernels visit only the tiles that segment ids or a block_mask
leave non-empty, evaluate no mask on the full ones, and trace score_mod / mask_mod (reading
mod_aux) into every tile. Judged against torch_ref.manual_attention in float64 with the same
rules written as a dense mask or bias here."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _flash_helpers import torch_arrays
from jax_impl import block_mask as block_mask_lib
from jax_impl import implementations, masking, pallas_triton
from jax_impl.config import AttentionConfig, BlockSizes
from jax_impl.dropout_sinks import SinksAndDropout

B, L, HQ, HKV, D = 2, 40, 4, 2, 16  # L is not a multiple of the tiles: a ragged last tile
TILE = 16
BLOCKS = BlockSizes(TILE, TILE, TILE, TILE, TILE, TILE, num_warps=4, num_warps_bwd=4, num_stages=1)
TOLERANCE = dict(atol=2e-5, rtol=1e-4)


def _inputs(seed, length=L):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, length, HQ, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, length, HKV, D)).astype(np.float32) for _ in range(2))
    cotangent = rng.standard_normal((B, length, HQ, D)).astype(np.float32)
    return q, k, v, cotangent


def _packed_documents(rng, length=L):
    """[B, length] ascending document ids: a first document of 32 to 47 positions (so that
    some tiles lie inside one document: full), then 1-3 short ones."""
    ids = [np.concatenate([np.zeros(first, int), 1 + np.sort(rng.integers(0, 3, length - first))])
           for first in rng.integers(32, min(48, length - 2), B)]
    return np.stack(ids).astype(np.int32)


def _pallas(q, k, v, cotangent, *, is_causal=False, segment_ids=None, block_mask=None,
            mod_aux=(), **config):
    """Out and (dq, dk, dv) of the pallas_triton forward and backward called directly, and
    the backward's d_mod_aux."""
    spec = masking.MaskSpec(is_causal=is_causal, has_block_mask=block_mask is not None)
    cfg = AttentionConfig(scale=D ** -0.5, mask=spec,
                          block_sizes=BLOCKS, interpret=True, **config)
    seg = None if segment_ids is None else jnp.asarray(segment_ids)
    extras = SinksAndDropout(mod_aux=tuple(mod_aux))
    q, k, v, cotangent = map(jnp.asarray, (q, k, v, cotangent))
    lengths = jnp.full((B,), q.shape[1], jnp.int32)
    masks = masking.MaskInputs(lengths, lengths, seg, seg, None, block_mask=block_mask)
    out, stats = pallas_triton.forward(cfg, q, k, v, None, masks, extras)
    delta = jnp.einsum("bqhd,bqhd->bhq", cotangent, out)
    dq, dk, dv, dbias, d_mod_aux = implementations.get("pallas_triton").backward(
        cfg, q, k, v, None, masks, stats, cotangent, delta, extras)
    assert dbias is None
    grads = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    return {name: np.asarray(x, np.float64) for name, x in grads.items()}, d_mod_aux


def _judge(got, oracle, **tolerance):
    for name in ("out", "dq", "dk", "dv"):
        np.testing.assert_allclose(got[name], oracle[name], **{**TOLERANCE, **tolerance}, err_msg=name)


def _positions(length=L):
    i = np.arange(length)
    return i[:, None], i[None, :]  # query rows, key columns


def _tile_classes(allowed):
    """[B|1, H|1, nq, nk] of a dense [B|1, H|1, L, L] bool pattern: 0 empty, 1 partial, 2 full
    (pairs past L count as masked, so a ragged tile is never full)."""
    length = allowed.shape[-1]
    n = -(-length // TILE)
    padded = np.zeros((*allowed.shape[:2], n * TILE, n * TILE), bool)
    padded[..., :length, :length] = allowed
    tiles = padded.reshape(*allowed.shape[:2], n, TILE, n, TILE)
    return np.where(tiles.all((3, 5)), 2, np.where(tiles.any((3, 5)), 1, 0))


def test_kernels_visit_only_the_non_empty_tiles():
    """A score_mod that records which tile it runs on: every kernel (forward, dK/dV and dQ,
    each query head) visits exactly the tiles that the causal packed documents leave non-empty
    (the band alone would visit the tiles below the diagonal between documents too)."""
    length = 72  # 5 tiles: a document ends before the last two query tiles begin
    q, k, v, cotangent = _inputs(1, length)
    ids = _packed_documents(np.random.default_rng(1), length)
    visited = []

    def recording_score_mod(score, b, h, q_idx, kv_idx):
        jax.debug.callback(lambda *tile: visited.append(tuple(map(int, tile))),
                           b, h, jnp.min(q_idx) // TILE, jnp.min(kv_idx) // TILE)
        return score

    _pallas(q, k, v, cotangent, is_causal=True, segment_ids=ids, score_mod=recording_score_mod)
    rows, cols = _positions(length)
    same_document = ids[:, None, :, None] == ids[:, None, None, :]
    classes = _tile_classes(same_document & (cols <= rows))
    band = _tile_classes(np.broadcast_to(cols <= rows, same_document.shape))
    assert ((classes == 0) & (band != 0)).any()  # tiles that only the documents empty
    expected = sorted((b, h, i, j) for b, _, i, j in zip(*np.nonzero(classes)) for h in range(HQ))
    assert sorted(visited) == sorted(expected * 3)  # forward, dK/dV, dQ: each once


def _prefix_lm(b, h, q_idx, kv_idx, prefix):
    """Bidirectional inside each row's prefix, causal after it."""
    return (kv_idx <= q_idx) | (kv_idx < prefix[b])


def test_mask_mod_runs_only_on_the_partial_tiles_of_a_block_mask():
    q, k, v, cotangent = _inputs(3)
    prefix = jnp.asarray([5, 23], jnp.int32)
    mask = block_mask_lib.create_block_mask(_prefix_lm, B, None, L, L, block_size=TILE,
                                            mod_aux=(prefix,))
    evaluated = []

    def recording_mask_mod(b, h, q_idx, kv_idx, prefix):
        jax.debug.callback(lambda *tile: evaluated.append(tuple(map(int, tile))),
                           b, jnp.min(q_idx) // TILE, jnp.min(kv_idx) // TILE)
        return _prefix_lm(b, h, q_idx, kv_idx, prefix)

    _pallas(q, k, v, cotangent, block_mask=mask, mask_mod=recording_mask_mod, mod_aux=(prefix,))
    classes = np.asarray(mask.to_dense())
    partial = [(b, i, j) for b, _, i, j in zip(*np.nonzero(classes == block_mask_lib.PARTIAL))]
    assert (classes == block_mask_lib.FULL).any()
    assert sorted(evaluated) == sorted(partial * HQ * 3)


def test_arithmetic_on_a_whole_mod_aux_array_is_refused_with_the_rule():
    q, k, v, cotangent = _inputs(7)
    slopes = jnp.ones((HQ,), jnp.float32)
    with pytest.raises(TypeError, match=r"mod_aux\[0\].*indexing every axis"):
        _pallas(q, k, v, cotangent, mod_aux=(slopes,),
                score_mod=lambda score, b, h, q_idx, kv_idx, slopes: score + (slopes * 2)[h])


def test_bool_and_scalar_mod_aux_are_read_in_the_kernels():
    """A bool [B, L] aux indexed by the mask_mod (loaded as int8) and a 0-d float aux used as
    a plain scalar by the score_mod (a temperature)."""
    q, k, v, cotangent = _inputs(9)
    rng = np.random.default_rng(9)
    key_kept = rng.random((B, L)) < 0.7
    temperature = np.float32(rng.uniform(0.5, 2.0))
    got, _ = _pallas(q, k, v, cotangent, is_causal=True,
                     mod_aux=(jnp.asarray(key_kept), jnp.asarray(temperature)),
                     mask_mod=lambda b, h, q_idx, kv_idx, kept, temp: kept[b, kv_idx],
                     score_mod=lambda score, b, h, q_idx, kv_idx, kept, temp: score * temp)
    _judge(got, torch_arrays(q, k, v, cotangent, is_causal=True, scale=D ** -0.5 * float(temperature),
                             mask=key_kept[:, None, None, :]))


