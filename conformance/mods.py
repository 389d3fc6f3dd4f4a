"""FlexAttention-style score and mask functions of the conformance cases, each written ONCE.

Every mod takes the array namespace first and then FlexAttention's arguments:
``score_mod(xp, score, b, h, q_idx, kv_idx, *mod_aux)`` and ``mask_mod(xp, b, h, q_idx, kv_idx,
*mod_aux)``. It only indexes and uses operators (and ``xp.tanh``, ``xp.clip``), so the same
definition runs with ``jax.numpy`` on jax_impl's broadcast index arrays, with ``torch`` inside
PyTorch's ``flex_attention`` (scalar indices) and with ``numpy`` on dense ``[B, H, Lq, Lk]``
indices, where the oracle turns it into a dense mask and bias (``dense_mask``, ``dense_bias``).
``bound(fn, xp)`` gives FlexAttention's signature (one function object per pair, so a static
argument stays the same).

The oracle (``torch_ref.manual_attention`` in float64) takes a score_mod as the additive bias it
is (``score_mod(0, ...)``; ``check_additive`` refuses one that is not), or, for ``soft_cap``,
as the built-in ``logits_soft_cap`` it equals (``Mods.oracle_soft_cap``). Float ``mod_aux``
entries are differentiable; the oracle's gradient for them is the vjp of the dense bias.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import numpy as np

WINDOW, GLOBAL_TOKENS = 6, 3   # sliding_global: keys within WINDOW of the query, and the first tokens
T5_MAX_DISTANCE = 8            # t5: relative positions clipped to [-T5_MAX_DISTANCE, T5_MAX_DISTANCE]
SOFT_CAP = 4.0                 # soft_cap as a score_mod
EMPTY_ROW_PERIOD = 4           # empty_rows: every 4th query row (q_idx % 4 == 1) has no allowed key


# --- The mods -------------------------------------------------------------------------------

def documents(xp, b, h, q_idx, kv_idx, doc):
    """Packed documents, causal inside each: ``doc`` int32 [B, L] (queries and keys share positions)."""
    return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)


def prefix_lm(xp, b, h, q_idx, kv_idx, prefix):
    """Bidirectional over the first ``prefix[b]`` keys, causal after: ``prefix`` int32 [B]."""
    return (kv_idx <= q_idx) | (kv_idx < prefix[b])


def sliding_global(xp, b, h, q_idx, kv_idx):
    """A band of WINDOW keys either side, plus GLOBAL_TOKENS global tokens (they see and are seen by all)."""
    near = (q_idx - kv_idx <= WINDOW) & (kv_idx - q_idx <= WINDOW)
    return near | (kv_idx < GLOBAL_TOKENS) | (q_idx < GLOBAL_TOKENS)


def empty_rows(xp, b, h, q_idx, kv_idx):
    """Causal, and query rows with ``q_idx % EMPTY_ROW_PERIOD == 1`` attend nothing."""
    return (kv_idx <= q_idx) & (q_idx % EMPTY_ROW_PERIOD != 1)


def alibi(xp, score, b, h, q_idx, kv_idx, slopes):
    """ALiBi: a per-head linear distance penalty, ``slopes`` float32 [Hq] (h is the query head)."""
    return score + slopes[h] * (kv_idx - q_idx)


def t5(xp, score, b, h, q_idx, kv_idx, table):
    """T5 relative position bias: a learnable ``table`` float32 [2 * T5_MAX_DISTANCE + 1, Hq]."""
    return score + table[xp.clip(kv_idx - q_idx, -T5_MAX_DISTANCE, T5_MAX_DISTANCE) + T5_MAX_DISTANCE, h]


def soft_cap(xp, score, b, h, q_idx, kv_idx):
    """The logits soft cap written as a score_mod: equals ``logits_soft_cap=SOFT_CAP``."""
    return SOFT_CAP * xp.tanh(score / SOFT_CAP)


# Both mods receive every mod_aux entry: a pair of them takes (doc, slopes).
def documents_of_pair(xp, b, h, q_idx, kv_idx, doc, slopes):
    return documents(xp, b, h, q_idx, kv_idx, doc)


def alibi_of_pair(xp, score, b, h, q_idx, kv_idx, doc, slopes):
    return alibi(xp, score, b, h, q_idx, kv_idx, slopes)


# --- Their aux arrays (seeded numpy) ---------------------------------------------------------

def _document_ids(rng, batch: int, length: int):
    count = int(rng.integers(2, 5))
    starts = np.sort(rng.choice(np.arange(1, length), count - 1, replace=False))
    return (np.stack([np.searchsorted(starts, np.arange(length), side="right") for _ in range(batch)])
            .astype(np.int32),)


def _draw_documents(rng, case):
    return _document_ids(rng, case.batch, case.q_len)


def _draw_prefix(rng, case):
    return (rng.integers(0, case.kv_len + 1, case.batch).astype(np.int32),)


def _draw_slopes(rng, case):
    return ((2.0 ** (-8.0 * (np.arange(case.q_heads) + 1) / case.q_heads)
             * (1 + 0.1 * rng.standard_normal(case.q_heads))).astype(np.float32),)


def _draw_table(rng, case):
    return (rng.standard_normal((2 * T5_MAX_DISTANCE + 1, case.q_heads)).astype(np.float32),)


@dataclasses.dataclass(frozen=True)
class Mods:
    """A case's score_mod and/or mask_mod, its aux arrays, and the oracle's form of them."""

    name: str
    score_mod: Callable | None = None
    mask_mod: Callable | None = None
    aux_names: tuple = ()
    draw: Callable | None = None       # (rng, case) -> tuple of numpy arrays, in aux_names' order
    oracle_soft_cap: float | None = None  # the score_mod is this built-in soft cap (not additive)
    same_lengths: bool = False         # the mods index one [B, L] array with q_idx and kv_idx

    def aux(self, rng, case) -> dict:
        return dict(zip(self.aux_names, self.draw(rng, case))) if self.draw else {}


def _both(*draws):
    return lambda rng, case: sum((d(rng, case) for d in draws), ())


MODS = {m.name: m for m in (
    Mods("documents", mask_mod=documents, aux_names=("doc",), draw=_draw_documents, same_lengths=True),
    Mods("prefix_lm", mask_mod=prefix_lm, aux_names=("prefix",), draw=_draw_prefix),
    Mods("sliding_global", mask_mod=sliding_global),
    Mods("empty_rows", mask_mod=empty_rows),
    Mods("alibi", score_mod=alibi, aux_names=("slopes",), draw=_draw_slopes),
    Mods("t5", score_mod=t5, aux_names=("table",), draw=_draw_table),
    Mods("soft_cap", score_mod=soft_cap, oracle_soft_cap=SOFT_CAP),
    Mods("alibi_documents", score_mod=alibi_of_pair, mask_mod=documents_of_pair, aux_names=("doc", "slopes"),
         draw=_both(_draw_documents, _draw_slopes), same_lengths=True),
)}


def get(name: str) -> Mods:
    if name not in MODS:
        raise ValueError(f"mods={name!r} must be one of {tuple(MODS)}")
    return MODS[name]


@functools.cache
def bound(fn: Callable, xp) -> Callable:
    """``fn`` with its namespace given: FlexAttention's signature, one object per (fn, xp)."""
    return functools.partial(fn, xp)


# --- Dense evaluation (the oracle's mask and bias) --------------------------------------------

def dense_indices(batch: int, heads: int, q_len: int, kv_len: int):
    """int32 numpy b [B,1,1,1], h [1,H,1,1], q_idx [1,1,Lq,1], kv_idx [1,1,1,Lk]."""
    return tuple(np.arange(n, dtype=np.int32).reshape([n if i == axis else 1 for i in range(4)])
                 for axis, n in enumerate((batch, heads, q_len, kv_len)))


def dense_mask(mods: Mods, shape, mod_aux) -> np.ndarray | None:
    """Bool [B, Hq, Lq, Lk] of ``mods.mask_mod`` (None without one), evaluated with numpy on the
    ``mod_aux`` arrays (a sequence)."""
    if mods.mask_mod is None:
        return None
    allowed = mods.mask_mod(np, *dense_indices(*shape), *mod_aux)
    return np.broadcast_to(allowed, shape)


def dense_bias(mods: Mods, shape, mod_aux, xp=np):
    """float64 [B, Hq, Lq, Lk]: the additive score_mod's bias, ``score_mod(0, ...)`` (None without
    one, or for a score_mod the oracle takes as its built-in form). ``mod_aux``: a sequence of
    arrays of ``xp`` (torch tensors that require grad give the bias's graph)."""
    if mods.score_mod is None or mods.oracle_soft_cap is not None:
        return None
    indices = dense_indices(*shape)
    if xp is not np:
        indices = tuple(xp.from_numpy(i) for i in indices)
    zero = xp.zeros(shape, dtype=xp.float64)
    return mods.score_mod(xp, zero, *indices, *mod_aux)


def check_additive(mods: Mods, shape, mod_aux, rng) -> None:
    """The oracle adds ``score_mod(0, ...)`` as a bias: refuse a score_mod that is not ``score + f``."""
    if mods.score_mod is None or mods.oracle_soft_cap is not None:
        return
    score = rng.standard_normal(shape)
    moved = mods.score_mod(np, score, *dense_indices(*shape), *mod_aux) - score
    if not np.allclose(moved, dense_bias(mods, shape, mod_aux), rtol=1e-12, atol=1e-12):
        raise ValueError(f"mods {mods.name!r}: the oracle takes a score_mod as a bias (score + f); "
                         f"this one is not additive: give it an oracle form (e.g. oracle_soft_cap)")
