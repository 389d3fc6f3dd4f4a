"""Dropout and attention sinks inside the ring (8 virtual CPU devices, fwd+bwd): no gathers,
the one-device dropout pattern bit for bit, sinks once per row, dsinks summed over the ring."""
import pytest

from _spawn import run_script

TOL = 2e-5  # float32 blocked attention vs float64 dense, unit-normal inputs, L <= 64
NAMES = ("dropout_causal_gqa", "sinks_causal_gqa", "dropout_sinks_bottom_right_lengths",
         "dropout_pattern_causal")


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_dropout_and_sinks_run_in_the_ring_exactly(mode):
    """jit: flash_attention on P(None, "seq") inputs (partitioned.py's ring, natural order in
    and out); shard_map: ring_attention (zigzag and contiguous layouts). Judged against
    torch_ref float64 with jax_impl.dropout_mask's pattern, and against the one-device call."""
    results = run_script("ring_features.py", mode, *NAMES)
    assert set(results) == set(NAMES)
    for name, r in results.items():
        assert r["all_gathers"] == 0, (name, r)
        assert r["permutes"] > 0, name
        expected = {"out", "dq", "dk", "dv"} | ({"dsinks"} if "sinks" in name else set())
        assert set(r["errors"]) == expected, name
        assert max(r["errors"].values()) < TOL, (name, r["errors"])
        assert r["single"] < TOL, (name, r["single"])  # the one-device call, same pattern
    pattern = results["dropout_pattern_causal"]["pattern"]
    assert pattern["same_as_single"] and pattern["same_as_mask"], pattern
    assert 0.6 < pattern["kept_fraction"] < 0.8  # rate 0.3: the pattern is not trivial


def test_ring_dropout_on_the_pallas_kernels_draws_the_one_device_pattern():
    """ring_attention with the Pallas Triton kernels (interpreted) as each step's kernel: they
    hash at the ring's dropout_offset, so the kept pairs are the one-device pattern bit for bit
    and the gradients match torch_ref float64 given that pattern."""
    (r,) = run_script("ring_features.py", "shard_map_pallas", "dropout_pattern_causal").values()
    assert r["all_gathers"] == 0 and r["permutes"] > 0, r
    assert set(r["errors"]) == {"out", "dq", "dk", "dv"} and max(r["errors"].values()) < TOL, r
    assert r["single"] < TOL, r
    assert r["pattern"]["same_as_single"] and r["pattern"]["same_as_mask"], r["pattern"]
    assert 0.6 < r["pattern"]["kept_fraction"] < 0.8


def test_ring_dropout_with_a_kernel_that_hashes_local_positions_is_refused():
    import jax
    from test_ring_attention import _ring_shapes
    with pytest.raises(ValueError, match="cannot run dropout in a ring.*'pallas_triton', 'mosaic_gpu', 'xla'"):
        _ring_shapes(8, 8, implementation="cpu", dropout_rate=0.1,
                     dropout_rng=jax.random.key(0))


def test_dsinks_are_summed_once_with_and_without_check_vma():
    """An unvarying sink's gradient is the sum of the devices' shares: taken by psum when
    shard_map tracks varying axes, by shard_map's own transpose when check_vma=False."""
    errors = run_script("ring_features.py", "sinks_without_vma")
    assert len(errors) == 6 and max(errors.values()) < TOL, errors  # ring, ulysses, hybrid


def test_a_ring_step_whose_chunks_share_no_document_is_skipped():
    """ring.pair_active: packed documents whose chunks share no id attend nothing (skipped);
    one shared id or a band-only call keeps the step."""
    import jax.numpy as jnp
    import numpy as np
    from jax_impl import implementations, masking, ring
    from jax_impl.config import AttentionConfig

    cq = ck = 32
    rng = np.random.default_rng()
    cfg = AttentionConfig(scale=1.0, mask=masking.MaskSpec(is_causal=True))
    r = ring.Ring("seq", 4, "contiguous", implementations.get("xla"), cfg, False)
    ids = np.sort(rng.integers(0, 3, (2, 4 * cq)), axis=1).astype(np.int32)
    masks = masking.MaskInputs(q_len=jnp.full((2,), 4 * cq), kv_len=jnp.full((2,), 4 * ck),
                               q_segment_ids=None, kv_segment_ids=None, mask=None)

    def active(a, c, q_ids, kv_ids):
        pm = ring.pair_masks(r, masks, a, c, cq, ck, q_ids, kv_ids)
        return bool(ring.pair_active(r, pm, cq, ck))

    shift = 10 * np.arange(2)[:, None]  # rows never share an id with the other row: per row
    chunk = lambda x, n: jnp.asarray(x[:, n * cq:(n + 1) * cq])
    later = ids + 100  # key chunks of documents that no query chunk holds
    assert not active(3, 1, chunk(ids + shift, 3), chunk(later + shift, 1))
    assert active(3, 1, chunk(ids, 3), jnp.asarray(np.where(np.arange(ck) == 5, ids[:, 3 * cq:3 * cq + 1], 77)))
    assert active(3, 1, None, None) and not active(1, 3, None, None)  # causal band alone


def test_a_ring_step_whose_block_mask_tiles_are_all_empty_is_skipped():
    """ring.pair_masks cuts each chunk pair's BlockMask from the global one (at global tile
    positions), and pair_active skips the pair when all its tiles are empty: a random global
    pattern, every pair of 4 chunks judged against the pattern's own tiles."""
    import jax.numpy as jnp
    import numpy as np
    from jax_impl import block_mask, implementations, masking, ring
    from jax_impl.config import AttentionConfig

    chunk, tile, n = 32, 16, 4
    rng = np.random.default_rng()
    classes = rng.choice([block_mask.EMPTY, block_mask.PARTIAL, block_mask.FULL],
                         (1, 1, n * chunk // tile, n * chunk // tile), p=[0.6, 0.2, 0.2])
    classes[..., 2:4, 4:6] = block_mask.EMPTY  # chunk pair (1, 2): skipped
    classes[..., 4, 2] = block_mask.FULL  # chunk pair (2, 1): kept
    global_mask = block_mask.BlockMask.from_tile_classes(jnp.asarray(classes, jnp.int8),
                                                         n * chunk, n * chunk, tile, tile)
    cfg = AttentionConfig(scale=1.0, mask=masking.MaskSpec(has_block_mask=True))
    r = ring.Ring("seq", n, "contiguous", implementations.get("xla"), cfg, False)
    masks = masking.MaskInputs(q_len=jnp.full((1,), n * chunk), kv_len=jnp.full((1,), n * chunk),
                               q_segment_ids=None, kv_segment_ids=None, mask=None,
                               block_mask=global_mask)
    tiles, per = block_mask.dense_classes(global_mask), chunk // tile
    for a in range(n):
        for c in range(n):
            pm = ring.pair_masks(r, masks, a, c, chunk, chunk, None, None, tiles)
            want = classes[..., a * per:(a + 1) * per, c * per:(c + 1) * per]
            np.testing.assert_array_equal(np.asarray(block_mask.dense_classes(pm.block_mask)), want)
            assert bool(ring.pair_active(r, pm, chunk, chunk)) == bool((want != 0).any())
