"""The programmable surface (block masks, score_mod / mask_mod, mod_aux gradients, closures,
JAX transformations) as one grid over every implementation this host can run
(``backends.grid()``: the automatic choice, each implementation, the Pallas kernels in their
interpreters, tile variants), each judged by a float64 torch oracle written here from the
documented rules (sharing no code with jax_impl). Inputs are fresh random draws on every run;
a failure prints its seed.
"""
from __future__ import annotations

import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import backends
from jax_impl import create_block_mask, flash_attention, implementations
from jax_impl.block_mask import EMPTY, FULL, PARTIAL, BlockMask

B, H, D = 2, 2, 16
LQ, LK = 160, 144


def _draw():
    seed = secrets.randbelow(2**31)
    return np.random.default_rng(seed), seed


def _normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _oracle(q, k, v, d_out, allowed, logits=None, aux=()):
    """Dense float64 attention with torch autograd: (out, dq, dk, dv, *d_aux) as numpy.
    ``logits(s, *aux)`` rewrites the scaled logits ``[B, H, Lq, Lk]`` (written so that no
    excluded pair yields a non-finite value); ``allowed [B, H, Lq, Lk]``; a row with no allowed
    key gives 0."""
    leaf = lambda x: torch.tensor(np.asarray(x, np.float64), requires_grad=True)
    tq, tk, tv = map(leaf, (q, k, v))
    taux = [leaf(a) for a in aux]
    groups = q.shape[2] // k.shape[2]  # GQA: query head h reads kv head h // groups
    kh, vh = (x.repeat_interleave(groups, dim=2) for x in (tk, tv))
    s = torch.einsum("bqhd,bkhd->bhqk", tq, kh) / np.sqrt(q.shape[-1])
    if logits is not None:
        s = logits(s, *taux)
    keep = torch.from_numpy(np.broadcast_to(allowed, s.shape).copy())
    s = torch.where(keep, s, torch.tensor(-np.inf, dtype=torch.float64))
    row_max = s.amax(-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(s - row_max)
    total = e.sum(-1, keepdim=True)
    p = torch.where(total > 0, e / torch.where(total > 0, total, torch.ones_like(total)),
                    torch.zeros_like(e))
    out = torch.einsum("bhqk,bkhd->bqhd", p, vh)
    grads = torch.autograd.grad(out, [tq, tk, tv, *taux],
                                grad_outputs=torch.from_numpy(np.asarray(d_out, np.float64)),
                                allow_unused=True)
    return [out.detach().numpy()] + [np.zeros(x.shape) if g is None else g.numpy()
                                     for g, x in zip(grads, (tq, tk, tv, *taux))]


def _assert_close(got, want, seed, names):
    for name, x, y in zip(names, got, want):
        x = np.asarray(x, np.float64)
        assert np.isfinite(x).all(), f"{name} has NaN/inf (seed={seed})"
        scale = max(1.0, float(np.abs(y).max()))
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=3e-5 * scale,
                                   err_msg=f"{name} (seed={seed})")


def _refused(implementation, call, words):
    """mosaic_tpu, named, refuses what its kernels cannot read: the error says so."""
    with pytest.raises(ValueError, match=words):
        call()


def _per_pair(classes, block_q, block_kv):
    """Tile classes [B|1, H|1, nq, nk] -> [B|1, H|1, LQ, LK]."""
    pairs = np.repeat(np.repeat(classes, block_q, 2), block_kv, 3)
    return pairs[:, :, :LQ, :LK]


MASK_TILES = [(16, 128), (64, 64), (256, 32), (128, 256)]


@pytest.mark.parametrize("tiles", MASK_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("implementation, options", backends.grid(tiles=True))
def test_a_block_mask_means_its_tiles_alone_and_with_any_mask_mod(implementation, options, tiles):
    """FlexAttention's meaning, per batch row and head, on any kernel tile: a pair in an EMPTY
    tile is excluded, in a FULL one allowed (its mask_mod is not consulted there), in a PARTIAL
    one as the mask_mod says; a block_mask of EMPTY and FULL tiles needs no mask_mod, and ANDs
    with causal masking and segment ids. The masks here differ per batch row and per query head
    (two heads share one kv head), and their FULL tiles disagree with the mask_mod."""
    rng, seed = _draw()
    block_q, block_kv = tiles
    nq, nk = -(-LQ // block_q), -(-LK // block_kv)
    q, d_out = _normal(rng, B, LQ, H, D), _normal(rng, B, LQ, H, D)
    k, v = _normal(rng, B, LK, 1, D), _normal(rng, B, LK, 1, D)
    q_docs = np.sort(rng.integers(0, 3, (B, LQ)), axis=1).astype(np.int32)
    kv_docs = np.sort(rng.integers(0, 3, (B, LK)), axis=1).astype(np.int32)
    structure = dict(is_causal=True, q_segment_ids=q_docs, kv_segment_ids=kv_docs)
    structural = ((np.arange(LK)[None, :] <= np.arange(LQ)[:, None])
                  & (q_docs[:, :, None] == kv_docs[:, None, :]))[:, None]
    modulus = int(rng.integers(2, 5))
    mask_mod = lambda b, h, q_idx, kv_idx: (q_idx + 2 * kv_idx + b + h) % modulus != 0
    rule = (np.arange(B)[:, None, None, None] + np.arange(H)[None, :, None, None]
            + np.arange(LQ)[:, None] + 2 * np.arange(LK)[None, :]) % modulus != 0
    alone = rng.choice([EMPTY, FULL], (B, H, nq, nk))
    with_mod = rng.choice([EMPTY, PARTIAL, FULL], (B, H, nq, nk))
    for classes, mod, more in ((alone, None, structure), (with_mod, mask_mod, {})):
        classes[:, :, 0, 0] = FULL if mod is None else PARTIAL
        block_mask = BlockMask.from_tile_classes(jnp.asarray(classes, jnp.int8), LQ, LK,
                                                 block_q, block_kv)
        pairs = _per_pair(classes, block_q, block_kv)
        allowed = (pairs == FULL) | ((pairs == PARTIAL) & rule)
        if more:
            allowed = allowed & structural
        f = lambda q, k, v: flash_attention(q, k, v, block_mask=block_mask, mask_mod=mod,
                                            **more, **options)
        if implementation == "mosaic_tpu" and (block_q % 128 or block_kv % 128 or mod):
            _refused(implementation, lambda: f(q, k, v), "block_mask")
            continue
        out, vjp = jax.vjp(f, q, k, v)
        _assert_close((out, *vjp(d_out)), _oracle(q, k, v, d_out, allowed), seed,
                      ("out", "dq", "dk", "dv"))


def _clamped(index, size):  # jnp's read: a negative index counts from the end once, then clamps
    index = np.where(index < 0, index + size, index)
    return np.clip(index, 0, size - 1)


@pytest.mark.parametrize("implementation, options", backends.grid())
def test_mods_mod_aux_gradients_and_closures_match_the_oracle(implementation, options):
    """One call with the common patterns at once: a learnable per-head weight of a log
    distance that is non-finite at the excluded pairs (their partials reach no gradient), a
    table read past its end (reads clamp, and so does the gradient), a closed-over 0-d
    temperature (a constant), and packed documents as a mask_mod (integer mod_aux) with its
    create_block_mask."""
    rng, seed = _draw()
    lq = lk = 96
    q, k, v, d_out = (_normal(rng, B, lq, H, D) for _ in range(4))
    w = rng.uniform(0.1, 0.5, H).astype(np.float32)
    table = _normal(rng, 8)
    temperature = jnp.asarray(rng.uniform(0.5, 1.5), jnp.float32)
    doc = np.sort(rng.integers(0, 3, (B, lq)), axis=1).astype(np.int32)

    def score_mod(s, b, h, q_idx, kv_idx, w, table, doc):
        distance = (q_idx - kv_idx + 1).astype(jnp.float32)
        return s * temperature + w[h] * jnp.log(distance) + table[q_idx - kv_idx + 4]

    def mask_mod(b, h, q_idx, kv_idx, w, table, doc):
        return (kv_idx <= q_idx) & (doc[b, q_idx] == doc[b, kv_idx])

    positions = np.arange(lq)
    allowed = ((positions[None, :] <= positions[:, None])
               & (doc[:, :, None] == doc[:, None, :]))[:, None]  # [B, 1, Lq, Lk]
    rel = positions[:, None] - positions[None, :]
    keep = torch.from_numpy(np.broadcast_to(allowed, (B, H, lq, lk)).copy())
    read = torch.from_numpy(_clamped(rel + 4, 8))

    def logits(s, w, table):
        distance = torch.where(keep, torch.from_numpy(rel + 1.0), torch.ones(()))
        return (s * float(temperature) + w[None, :, None, None] * torch.log(distance)
                + table[read][None, None])

    aux = (jnp.asarray(w), jnp.asarray(table), jnp.asarray(doc))
    block_mask = create_block_mask(mask_mod, B, None, lq, lk, block_size=32, mod_aux=aux)
    f = lambda q, k, v, w, table: flash_attention(
        q, k, v, score_mod=score_mod, mask_mod=mask_mod, mod_aux=(w, table, aux[2]),
        block_mask=block_mask, **options)
    if implementation == "mosaic_tpu":
        _refused(implementation, lambda: f(q, k, v, w, table), "mod_aux|block_mask")
        return
    out, vjp = jax.vjp(f, q, k, v, aux[0], aux[1])
    _assert_close((out, *vjp(d_out)), _oracle(q, k, v, d_out, allowed, logits, (w, table)), seed,
                  ("out", "dq", "dk", "dv", "dw", "dtable"))


def _alibi(s, b, h, q_idx, kv_idx, slopes):
    return s - slopes[h] * jnp.abs(q_idx - kv_idx)


@pytest.mark.parametrize("with_mods", [False, True], ids=["plain", "mods"])
@pytest.mark.parametrize("implementation, options", backends.grid())
def test_transformations_equal_the_per_example_results(implementation, options, with_mods):
    """``jit(grad(vmap(f)))`` and ``jit(vmap(grad(f)))`` give the stacked per-example
    gradients; a ``lax.scan`` over layers under ``jax.checkpoint`` gives the unrolled loop's;
    forward mode stays refused by name (the reference differentiates it)."""
    rng, seed = _draw()
    length = 64
    q, k, v, d_out = (_normal(rng, B, length, H, D) for _ in range(4))
    slopes = rng.uniform(0.1, 0.5, (2, H)).astype(np.float32)  # one row per layer
    mods = (lambda w: dict(score_mod=_alibi, mod_aux=(w,))) if with_mods else (lambda w: {})
    if implementation == "mosaic_tpu" and with_mods:
        return  # mod_aux: refused by name (test_mods_mod_aux_gradients_and_closures...)

    def attend(q, k, v, w):  # one example: [L, H, D], no batch axis
        return flash_attention(q, k, v, is_causal=True, **mods(w), **options)

    def example_loss(q, k, v, w, cotangent):
        return (attend(q, k, v, w) * cotangent).sum()

    per_example = [jax.grad(example_loss, argnums=(0, 1, 2, 3))(q[i], k[i], v[i], slopes[0], d_out[i])
                   for i in range(B)]
    want = [np.stack([g[j] for g in per_example]) for j in range(3)] + [sum(g[3] for g in per_example)]
    names = ("dq", "dk", "dv", "dw")
    batch_loss = lambda q, k, v, w: (jax.vmap(attend, (0, 0, 0, None))(q, k, v, w) * d_out).sum()
    got = jax.jit(jax.grad(batch_loss, argnums=(0, 1, 2, 3)))(q, k, v, slopes[0])
    _assert_close(got, want, seed, names)
    got = jax.jit(jax.vmap(jax.grad(example_loss, argnums=(0, 1, 2, 3)), (0, 0, 0, None, 0)))(
        q, k, v, slopes[0], d_out)
    _assert_close((*got[:3], got[3].sum(0)), want, seed, names)

    def layers(q, slopes, scan):
        layer = jax.checkpoint(lambda x, w: (attend(x, k[0], v[0], w), None))
        if scan:
            return (jax.lax.scan(layer, q, slopes)[0] * d_out[0]).sum()
        for w in slopes:
            q = attend(q, k[0], v[0], w)
        return (q * d_out[0]).sum()

    # The Mosaic interpreters run ordered io callbacks, which jax.checkpoint cannot
    # partially evaluate (the compiled kernels have no effects).
    if not (implementation and implementations.get(implementation).interpreter_has_effects):
        scanned = jax.jit(jax.grad(lambda q, s: layers(q, s, True), argnums=(0, 1)))(q[0], slopes)
        unrolled = jax.grad(lambda q, s: layers(q, s, False), argnums=(0, 1))(q[0], slopes)
        _assert_close(scanned, unrolled, seed, ("dq (scan)", "dslopes (scan)"))

    forward_mode = lambda: jax.jvp(lambda q: attend(q, k[0], v[0], slopes[0]), (q[0],), (d_out[0],))
    if implementation == "reference":
        forward_mode()
    else:
        with pytest.raises(NotImplementedError, match="Forward mode"):
            forward_mode()
