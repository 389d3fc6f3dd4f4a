"""The tile ranges of masking.py against the element rules they summarise.

For every query tile, key tiles outside [lo, hi) must hold no allowed pair (skipping them is
exact), and tiles in [full_lo, full_hi) must hold only allowed pairs (not masking them is
exact); likewise for key tiles and their query-tile ranges (the dK/dV loop).
"""
from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from jax_impl import masking

SPECS = [
    masking.MaskSpec(),
    masking.MaskSpec(is_causal=True),
    masking.MaskSpec(is_causal=True, bottom_right=True),
    masking.MaskSpec(window_left=5, window_right=3),
    masking.MaskSpec(is_causal=True, window_left=9),
    masking.MaskSpec(window_left=0, window_right=0, bottom_right=True),
    masking.MaskSpec(window_right=7, bottom_right=True, has_q_lengths=True, has_kv_lengths=True),
    masking.MaskSpec(is_causal=True, bottom_right=True, has_q_lengths=True, has_kv_lengths=True),
    masking.MaskSpec(has_kv_lengths=True),  # no rule reads the rows (keys padded alone)
    masking.MaskSpec(has_q_lengths=True),
]
SHAPES = [(37, 53), (53, 37), (16, 16), (1, 40), (40, 1)]
BLOCKS = [(16, 16), (16, 32), (32, 16)]


def _pattern(spec, lq, lk, q_len, kv_len):
    full = masking.dense_allowed(spec, lq, lk, jnp.array([q_len]), jnp.array([kv_len]))
    return np.asarray(full[0, 0])


def _cases():
    rng = np.random.default_rng(0)
    for spec, (lq, lk), (bq, bk) in itertools.product(SPECS, SHAPES, BLOCKS):
        lengths = [(lq, lk)]
        if spec.has_q_lengths:
            lengths += [(int(rng.integers(0, lq + 1)), int(rng.integers(0, lk + 1))) for _ in range(3)]
        for q_len, kv_len in lengths:
            yield spec, lq, lk, bq, bk, q_len, kv_len


def _padded(n, block):
    return -(-n // block) * block


@pytest.mark.parametrize("spec, lq, lk, bq, bk, q_len, kv_len", list(_cases()))
def test_tile_ranges_are_exact_summaries_of_the_element_rules(spec, lq, lk, bq, bk, q_len, kv_len):
    lq_pad, lk_pad = _padded(lq, bq), _padded(lk, bk)
    spec = masking.with_padding(spec, queries_padded=lq_pad != lq, keys_padded=lk_pad != lk)
    allowed = np.zeros((lq_pad, lk_pad), bool)
    allowed[:lq, :lk] = _pattern(spec, lq, lk, q_len, kv_len)
    args = (jnp.int32(q_len), jnp.int32(kv_len))
    for i in range(lq_pad // bq):
        lo, full_lo, full_hi, hi = (int(x) for x in masking.kv_block_split(
            spec, i * bq, bq, bk, *args))
        assert lo <= full_lo <= full_hi <= hi <= lk_pad // bk
        rows = slice(i * bq, (i + 1) * bq)
        for j in range(lk_pad // bk):
            tile = allowed[rows, j * bk:(j + 1) * bk]
            if not lo <= j < hi:
                assert not tile.any(), f"query tile {i} skips key tile {j} holding allowed pairs"
            if full_lo <= j < full_hi:  # rows past Lq (padding) are sliced off, not judged
                real_rows = min(bq, max(lq - i * bq, 0))
                assert tile[:real_rows].all(), \
                    f"query tile {i} leaves key tile {j} unmasked though it holds excluded pairs"
    for j in range(lk_pad // bk):
        lo, full_lo, full_hi, hi = (int(x) for x in masking.q_block_split(
            spec, j * bk, bk, bq, *args))
        assert lo <= full_lo <= full_hi <= hi <= lq_pad // bq
        cols = slice(j * bk, (j + 1) * bk)
        for i in range(lq_pad // bq):
            tile = allowed[i * bq:(i + 1) * bq, cols]
            if not lo <= i < hi:
                assert not tile.any(), f"key tile {j} skips query tile {i} holding allowed pairs"
            if full_lo <= i < full_hi:
                in_range = min(bq, max(lq - i * bq, 0))
                assert tile[:in_range].all(), f"key tile {j} leaves query tile {i} unmasked wrongly"


def test_causal_split_leaves_most_tiles_unmasked():
    """The split is not vacuous: a long causal problem masks only the diagonal tiles."""
    spec = masking.MaskSpec(is_causal=True)
    lo, full_lo, full_hi, hi = (int(x) for x in masking.kv_block_split(
        spec, 512, 64, 64, jnp.int32(1024), jnp.int32(1024)))
    assert (lo, full_lo, full_hi, hi) == (0, 0, 8, 9)


def _rules_1_to_3(spec, i, j, q_len, kv_len, offset):
    """The rules as docs/semantics.md states them, in numpy, pair by pair."""
    shift = (kv_len - q_len if spec.bottom_right else 0) + offset
    ok = np.ones(np.broadcast_shapes(i.shape, j.shape), bool)
    if spec.has_q_lengths:
        ok &= i < q_len
    if spec.has_kv_lengths:
        ok &= j < kv_len
    if spec.is_causal:
        ok &= j <= i + shift
    if spec.window_left is not None:
        ok &= j >= i + shift - spec.window_left
    if spec.window_right is not None:
        ok &= j <= i + shift + spec.window_right
    return ok


@pytest.mark.parametrize("keys_first", [False, True], ids=["key_bounds_per_row",
                                                           "query_bounds_per_key"])
@pytest.mark.parametrize("spec", SPECS)
def test_per_row_bounds_state_the_rules_exactly(spec, keys_first):
    """key_bounds_per_row (the Mosaic forward's masked tiles, queries x keys) and
    query_bounds_per_key (the Mosaic dK/dV's, keys x queries), each with within_bounds,
    allow exactly the pairs of rules 1-3, for tiles anywhere (before, across and past the
    band and the lengths), random lengths and position offsets; key_bounds_per_row without
    rows where the spec does not vary by row."""
    rng = np.random.default_rng(7)
    tile_rows, tile_cols = 16, 32
    local = np.arange(tile_cols)[None, :]
    bounds = masking.query_bounds_per_key if keys_first else masking.key_bounds_per_row
    for _ in range(40):
        q_len, kv_len = (int(x) for x in rng.integers(0, 70, 2))
        offset = int(rng.integers(-40, 41)) if rng.random() < 0.5 else 0
        first_row, first_col = (int(x) for x in rng.integers(-8, 80, 2))
        rows = first_row + np.arange(tile_rows)
        # Where no rule reads the rows the Mosaic forward passes none (an unused iota fails
        # its layout inference): the bounds must not need them.
        given = jnp.asarray(rows, jnp.int32) if spec.varies_by_row or keys_first else None
        lo, hi = bounds(spec, given, jnp.int32(first_col),
                        jnp.int32(q_len), jnp.int32(kv_len), jnp.int32(offset) if offset else None)
        per_row = lambda x: x if x is None or jnp.ndim(x) == 0 else jnp.asarray(x)[:, None]
        got = masking.within_bounds(jnp.asarray(local, jnp.int32), per_row(lo), per_row(hi))
        got = np.ones((tile_rows, tile_cols), bool) if got is None else np.broadcast_to(
            np.asarray(got), (tile_rows, tile_cols))
        queries, keys = rows[:, None], first_col + local
        if keys_first:
            queries, keys = keys, queries
        want = np.broadcast_to(_rules_1_to_3(spec, queries, keys, q_len, kv_len, offset),
                               (tile_rows, tile_cols))
        np.testing.assert_array_equal(got, want, err_msg=f"{spec} q_len={q_len} kv_len="
                                      f"{kv_len} offset={offset} tile at ({first_row}, "
                                      f"{first_col}), keys first: {keys_first}")
