"""The per-tile steps of FlashAttention, shared by the blocked XLA path and the Pallas kernels.

Shape-agnostic: a Pallas kernel calls them on ``[block_q, block_k]`` tiles, the XLA path on
``[B, Hkv, G, block_q, block_k]``; the last two axes are always (query, key).
Notation of FlashAttention-2 (Dao, 2023): S logits, P probabilities, m running row max,
l running row sum in m's scale, O unnormalised output accumulator.

Non-finite values (one rule, every implementation, as torch_ref's oracle computes it densely):
a pair whose query row or key row (K or V) holds a non-finite value gets a NaN added to its
logit (``row_poison``, ``key_poison``) on every tile, masked or not, and the products read Q, K
and V with their non-finite entries as 0 (``finite_or_zero``) wherever they reach a pair that
takes no part. The mask's select (and, with a bias, a -inf logit: ``attended``) keeps the NaN
only at the pairs a row attends, where it makes the row NaN; P, dS and d(q.k) are exactly 0 at
every other pair, also in a NaN row (the probabilities select after the saved statistics, which
are NaN there; ``logits_gradient(exclusions=True)``). So a NaN or inf at a key or query that a
row may not attend never reaches that row's output or gradients, one at an allowed pair gives
NaN, and a NaN row's gradients reach only the keys it attends (the non-finite entry itself gets
its row's gradient, as the products give it: no select). Each implementation takes the poison once per call
and chooses how a tile gets it: added to S, or folded into a row of an operand that enters
only S (a poisoned row is NaN at every pair, and the select keeps the allowed ones).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from jax_impl.config import AttentionConfig


class RowStats(NamedTuple):
    """What the backward needs to recompute P = exp(S - max - log_sum), per query row.

    Kept apart, not summed into the logsumexp: with logits of magnitude 1e9 the sum rounds
    to the max and P could not be recomputed. A row with no allowed key (or only -inf logits)
    has ``max = +inf`` and ``log_sum = 0``, so its recomputed P is exactly 0 with no select.
    """

    max: object      # [..., Lq] float32
    log_sum: object  # [..., Lq] float32


def logits(qk, cfg: AttentionConfig, bias_tile=None, poison=None):
    """S = softcap(scale * q.k) + poison + bias. Returns (S, tanh term kept for the soft cap's gradient).

    ``poison`` (the non-finite rule's 0 or NaN, broadcast against the tile) is added right after
    the last product, before the bias: the product and the add, fused into a multiply-add or
    not, give S = fl(scale * q.k) (fma(a, b, 0) == fl(a * b)), so S is one rounded value that
    every pass recomputes bit for bit and that no later subtraction of the row max fuses with.
    """
    s = qk * cfg.scale
    capped = None
    if cfg.logits_soft_cap is not None:
        capped = jnp.tanh(s / cfg.logits_soft_cap)
        s = capped * cfg.logits_soft_cap
    if poison is not None:
        s = s + poison
    if bias_tile is not None:
        s = s + bias_tile.astype(jnp.float32)
    return s, capped


def logits_unit(cfg: AttentionConfig, has_bias: bool) -> float:
    """The unit a kernel's online softmax may hold the logits in (``online_step``'s): the
    scale where S is the scaled product alone (no soft cap, bias or score_mod), so q.k enters
    as the MXU returns it and the scale folds into the exponential's multiply; else 1."""
    plain = not has_bias and cfg.logits_soft_cap is None and cfg.score_mod is None
    return cfg.scale if plain else 1.0


def is_finite(x):
    """Elementwise isfinite written with a comparison (lowers in Triton and XLA alike)."""
    return jnp.abs(x) < jnp.inf


def finite_or_zero(x):
    """x with its non-finite entries replaced by 0."""
    return jnp.where(is_finite(x), x, jnp.zeros((), x.dtype))


def row_poison(x):
    """``[..., n, D] -> [..., n]`` float32: NaN where the row holds a non-finite value, else 0."""
    # x - x is 0 or NaN: a sum, with no select of constants (which Mosaic TPU cannot lay out on
    # a tile), no reduce_or (which Pallas Triton cannot lower) and no product (XLA would rewrite
    # a sum of x * 0 as a dot with a materialised zero array).
    x = x.astype(jnp.float32)
    return jnp.sum(x - x, axis=-1)


def per_row(x, transposed: bool = False):
    """A per-query vector ``[..., Tq]`` broadcast against a tile: ``[..., Tq, 1]``, or against a
    transposed tile (keys first, the dK/dV kernel's S^T) ``[..., 1, Tq]``."""
    return x[..., None, :] if transposed else x[..., :, None]


def rows_to(x, tile):
    """A per-query vector ``[..., Tq]`` broadcast to a tile ``[..., Tq, T]`` (keys or features)
    in one step: ``per_row``'s ``[..., Tq, 1]`` has no layout in Mosaic GPU's WGMMA row
    layouts, a direct ``broadcast_in_dim`` lowers there as in XLA and Triton."""
    return lax.broadcast_in_dim(x, tile.shape, tuple(range(x.ndim)))


def poisoned_rows(x):
    """x with every row that holds a non-finite value made all NaN (for an operand that enters
    only S, where the select keeps a poisoned row's NaN at the allowed pairs alone)."""
    return x + per_row(row_poison(x)).astype(x.dtype)


def pack_query_groups(x, groups: int):
    """``[B, Lq, Hkv * G, ...] -> [B, Lq * G, Hkv, ...]``: each kv head's G query heads as rows
    of one tile (GQA/MQA), row r being query r // G of the group's head r % G: the decode
    kernels' rows and the Mosaic GPU forward's packed items. ``unpack_query_groups`` inverts it."""
    b, lq, hq = x.shape[:3]
    grouped = x.reshape(b, lq, hq // groups, groups, *x.shape[3:])
    return jnp.swapaxes(grouped, 2, 3).reshape(b, lq * groups, hq // groups, *x.shape[3:])


def unpack_query_groups(x, groups: int):
    """``[B, Lq * G, Hkv, ...] -> [B, Lq, Hkv * G, ...]`` (``pack_query_groups``'s inverse)."""
    b, rows, hkv = x.shape[:3]
    grouped = x.reshape(b, rows // groups, groups, hkv, *x.shape[3:])
    return jnp.swapaxes(grouped, 2, 3).reshape(b, rows // groups, hkv * groups, *x.shape[3:])


def key_poison(k, v):
    """``[..., n, D] -> [..., n]``: NaN where key n's row of K or of V holds a non-finite value."""
    return row_poison(k) + row_poison(v)


def operands_poisoned(q, k, v):
    """q, k, v as a kernel that reads its operands only through copies into on-chip memory
    (Mosaic GPU, Mosaic TPU) takes them, the non-finite rule applied in one XLA pass: q's rows
    that hold a non-finite value all NaN, k's rows their key's poison, v's non-finite
    entries 0 (a key whose V row is non-finite has a poisoned k)."""
    poison = per_row(key_poison(k, v))  # [B, Lk, Hkv, 1]
    return poisoned_rows(q), k + poison.astype(k.dtype), finite_or_zero(v)


def attended(s, allowed, has_bias: bool):
    """The pairs of a tile that take part in the softmax, or None when every pair does: those
    the mask rule allows (``allowed``, None: all) and, with a bias, whose logit is not -inf (an
    additive -inf bias excludes its pair). A poisoned logit is NaN, never -inf, so it takes
    part wherever the mask allows it."""
    if not has_bias:
        return allowed
    finite_or_nan = s != -jnp.inf
    return finite_or_nan if allowed is None else allowed & finite_or_nan


def online_step(row_max, row_sum, s, allowed, *, base2: bool = False, unit: float = 1.0):
    """Algorithm 1, lines 8-10: fold one key tile of logits S into the running (m, l) and return P.

    Rows that have seen no finite allowed logit keep m = -inf; they use 0 as the reference
    point so that no inf - inf appears, and their P is exactly 0. ``base2``: the exponentials
    as exp2 (``_exp``: the Pallas kernels). ``unit``: s holds S / unit (q.k, unscaled), and
    so does m: the max is still subtracted first, and one multiply takes the difference to S's
    units (the natural max is then ``fl(m * unit)``, the max of ``fl(q.k * unit)``).
    Returns (rescale factor for the old accumulator, P, new m, new l).
    """
    exp = _exp(base2, unit)
    if allowed is not None:  # None: every pair of the tile is allowed
        s = jnp.where(allowed, s, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(s, axis=-1))
    safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    rescale = exp(row_max - safe_max)            # 0 while row_max is -inf
    p = exp(s - rows_to(safe_max, s))            # 0 where not allowed
    new_sum = rescale * row_sum + jnp.sum(p, axis=-1)
    return rescale, p, new_max, new_sum


def finalize(acc, row_max, row_sum):
    """Algorithm 1, lines 12-13: O = acc / l and the row statistics; empty rows give O = 0."""
    empty = row_sum == 0
    out = acc / rows_to(jnp.where(empty, 1.0, row_sum), acc)
    stats = RowStats(jnp.where(empty, jnp.inf, row_max),
                     jnp.log(jnp.where(empty, 1.0, row_sum)))
    return out, stats


def logsumexp(stats: RowStats):
    """The public logsumexp (natural log): max + log_sum, -inf for an empty row."""
    return jnp.where(stats.max == jnp.inf, -jnp.inf, stats.max + stats.log_sum)


def recomputed_probs(s, stats: RowStats, attended, *, base2: bool = False,
                     transposed: bool = False, to_tile=None, at_most_one: bool = True):
    """Backward: P = exp(S - max - log_sum) from the saved statistics (the forward's S, so the
    row max cancels), at most 1, exactly 0 where not ``attended`` (selected after the statistics,
    which are NaN in a NaN row). ``base2``: as ``online_step``; ``transposed``: s is a
    (key, query) tile; ``to_tile``: how a per-query vector meets the tile, else ``per_row``;
    ``at_most_one=False`` leaves P unclamped (a kernel that never runs interpreted)."""
    row = to_tile or (lambda x: per_row(x, transposed))
    if base2:  # the multiply by log2(e) and the log-sum's subtraction: one multiply-add
        shifted = (s - row(stats.max)) * LOG2_E - row(stats.log_sum * LOG2_E)
    else:
        shifted = (s - row(stats.max)) - row(stats.log_sum)
    # P <= 1: a backward whose S^T comes from a dot of another shape (XLA:CPU's, in the
    # interpreters) may round S a few ulps past the forward's max, which at |S| ~ 1e9 is an
    # exponent of hundreds and an infinite P; a NaN stays NaN (min propagates it).
    if at_most_one:
        shifted = jnp.minimum(shifted, 0.0)
    if attended is not None:
        shifted = jnp.where(attended, shifted, -jnp.inf)
    return jnp.exp2(shifted) if base2 else jnp.exp(shifted)


def logits_gradient(p, dp, delta, capped, cfg: AttentionConfig, *, scaled: bool = True,
                    transposed: bool = False, exclusions: bool = False, score_vjp=None):
    """Algorithm 2, line 11: dS = P * (dP - delta), delta = rowsum(dO * O) - d(lse).

    Returns (dS: the gradient of the bias, d(q.k): the gradient of the raw product, with the
    soft cap's derivative and, if ``scaled``, the scale folded in; a kernel passes False and
    scales its [block, D] dq/dk accumulator once instead of every logit). ``transposed``: the
    tiles are (key, query), delta still one value per query.

    ``exclusions``: the tile may hold pairs that take no part (``attended`` is not None), where
    P is exactly 0. Both gradients are then exactly 0 wherever P is 0, as the gradient of the
    mask's select is, even in a NaN row (whose delta is NaN: 0 * NaN) and where a poisoned row
    makes the soft cap's factor NaN. (Where P underflows to 0 at an attended pair, dS is 0 too.)

    ``score_vjp``: with a score_mod, the map from dS of its output to dS of its input (the
    logits; ``mods.score_gradient``); dS is then the input's.
    """
    ds = softmax_gradient(p, dp, delta, transposed=transposed)
    if score_vjp is not None:
        ds = score_vjp(jnp.where(p == 0, 0.0, ds) if exclusions else ds)
    dqk = ds
    if capped is not None:
        dqk = dqk * (1.0 - capped * capped)
    if exclusions:
        excluded = p == 0
        ds = jnp.where(excluded, 0.0, ds)
        dqk = ds if capped is None else jnp.where(excluded, 0.0, dqk)
    return ds, dqk * cfg.scale if scaled else dqk


def softmax_gradient(p, dp, delta, *, transposed: bool = False):
    """dS = P * (dP - delta) of the logits the softmax read (``logits_gradient``)."""
    return p * (dp - per_row(delta, transposed))


# --- Exact merge of partial results (ring steps; key splits) ------------------------------

def empty_stats(shape):
    """RowStats of rows that have seen no allowed key yet."""
    return RowStats(jnp.full(shape, jnp.inf, jnp.float32),
                                   jnp.zeros(shape, jnp.float32))


def merge(out_a, stats_a, out_b, stats_b):
    """Two normalised partial outputs ``[B, L, H, D]`` over disjoint key sets -> the output over
    their union, with RowStats ``[B, H, L]`` kept as (max, log-sum) so the backward recomputes
    P exactly. Empty rows (max = +inf) contribute nothing."""
    m_a = jnp.where(stats_a.max == jnp.inf, -jnp.inf, stats_a.max)
    m_b = jnp.where(stats_b.max == jnp.inf, -jnp.inf, stats_b.max)
    m = jnp.maximum(m_a, m_b)
    safe = jnp.where(m == -jnp.inf, 0.0, m)
    w_a = jnp.exp(m_a - safe) * jnp.exp(stats_a.log_sum)  # 0 for an empty side
    w_b = jnp.exp(m_b - safe) * jnp.exp(stats_b.log_sum)
    total = w_a + w_b
    empty = total == 0
    denom = jnp.where(empty, 1.0, total)
    per_row = lambda w: jnp.swapaxes(w / denom, 1, 2)[..., None]  # [B, H, L] -> [B, L, H, 1]
    out = per_row(w_a) * out_a.astype(jnp.float32) + per_row(w_b) * out_b.astype(jnp.float32)
    return out, RowStats(jnp.where(empty, jnp.inf, m), jnp.log(denom))


def merge_runs(out, stats: RowStats):
    """Partial results over ``runs`` disjoint key ranges -> their union (``merge``, pairwise).

    out ``[runs, X, L, H, D]``, stats ``[runs, X, H, L]`` -> out ``[X, L, H, D]`` float32,
    RowStats ``[X, H, L]`` (a split-K decode's runs; each a normalised partial result)."""
    count, x = out.shape[:2]
    out = out.reshape((count * x,) + out.shape[2:]).astype(jnp.float32)
    stats = RowStats(*(s.reshape((count * x,) + s.shape[2:]) for s in stats))
    while count > 1:
        half = count // 2
        first, second, rest = slice(0, half * x), slice(half * x, 2 * half * x), slice(2 * half * x, None)
        merged, merged_stats = merge(out[first], RowStats(*(s[first] for s in stats)),
                                     out[second], RowStats(*(s[second] for s in stats)))
        out = jnp.concatenate([merged, out[rest]])
        stats = RowStats(*(jnp.concatenate([m, s[rest]]) for m, s in zip(merged_stats, stats)))
        count = half + count % 2
    return out, stats


# --- Base 2 (the Pallas kernels) ----------------------------------------------------------------
# exp2 is one hardware instruction (PTX ex2.approx); exp is a libdevice call (__nv_expf, about
# ten instructions). So the GPU kernels compute P = 2^((S - m) log2(e)) (``base2=True``) from
# the natural logits S (``logits``) and the natural RowStats. The row max is subtracted before
# the multiply: the max's own exponent is then exactly 0 at any magnitude, forward and
# backward, where the multiply-add S log2(e) - m log2(e) leaves the max's two roundings
# (hundreds apart at |S| ~ 1e9).

LOG2_E = math.log2(math.e)


def _exp(base2: bool, unit: float = 1.0):
    """x -> e^(x unit): ``jnp.exp``, or with ``base2`` 2^(x unit log2(e)) (one multiply and exp2)."""
    if base2:
        return lambda x: jnp.exp2(x * (unit * LOG2_E))
    return jnp.exp if unit == 1.0 else lambda x: jnp.exp(x * unit)
