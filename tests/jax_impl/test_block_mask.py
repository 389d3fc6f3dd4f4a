"""BlockMask (jax_impl/block_mask.py) against a numpy oracle written here, against PyTorch
FlexAttention's own create_block_mask, and block_mask_from_bounds against create_block_mask."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_impl import block_mask as bm
from jax_impl import masking

# Element rules written once for numpy, JAX and torch: only operators and indexing, no library
# calls. (b, h, q, kv, *aux) -> bool.


def causal_documents(b, h, q, kv, doc):  # packed documents [B, L], causal inside each
    return (kv <= q) & (doc[b, q] == doc[b, kv])


def prefix_lm(b, h, q, kv, prefix):  # prefix [B]: bidirectional below it, causal after
    return (kv <= q) | (kv < prefix[b])


def sliding_window_global(b, h, q, kv, is_global):  # is_global [L] bool, window 20 behind
    return ((kv <= q) & (q - kv <= 20)) | is_global[kv] | is_global[q]


def per_head_window(b, h, q, kv):  # head h sees 16 * (h + 1) keys behind it
    return (kv <= q) & (q - kv < 16 * (h + 1))


def random_mask(b, h, q, kv, mask):  # mask [B, H, Lq, Lk] bool
    return mask[b, h, q, kv]


def packed_documents(rng, batch, length, max_docs=5):
    """[batch, length] int32 ids ascending: random document boundaries."""
    ids = np.zeros((batch, length), np.int32)
    for row in ids:
        for boundary in rng.choice(np.arange(1, length), rng.integers(1, max_docs), replace=False):
            row[boundary:] += 1
    return ids


def cases(rng):
    """(name, rule, B, H, Lq, Lk, block_size, aux as numpy)."""
    lq, lk = 200, 168  # ragged in every block size below
    # Per 32x24 tile a density of 0, 0.3 or 1, so that every class occurs.
    density = rng.choice([0.0, 0.3, 1.0], (2, 3, -(-lq // 32), -(-lk // 24)))
    density = density.repeat(32, 2).repeat(24, 3)[:, :, :lq, :lk]
    random = rng.random((2, 3, lq, lk)) < density
    return [
        ("documents", causal_documents, 2, None, lq, lq, 32, (packed_documents(rng, 2, lq),)),
        ("prefix_lm", prefix_lm, 3, None, lq, lq, (32, 16), (rng.integers(0, lq, 3).astype(np.int32),)),
        ("window_global", sliding_window_global, None, None, lq, lq, (16, 32),
         (rng.random(lq) < 0.03,)),
        ("per_head", per_head_window, None, 3, lq, lk, 16, ()),
        ("random", random_mask, 2, 3, lq, lk, (32, 24), (random,)),
        ("one_tile", lambda b, h, q, kv: kv <= q, 1, 1, 20, 30, 64, ()),
    ]


def oracle_tile_classes(rule, batch, heads, lq, lk, block_size, aux):
    """Dense numpy: the rule over every pair, then per tile (padding past Lq/Lk counts as masked)."""
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    batch, heads = batch or 1, heads or 1
    b, h, q, kv = np.ix_(np.arange(batch), np.arange(heads), np.arange(lq), np.arange(lk))
    allowed = np.broadcast_to(rule(b, h, q, kv, *aux), (batch, heads, lq, lk))
    nq, nk = -(-lq // bq), -(-lk // bk)
    padded = np.zeros((batch, heads, nq * bq, nk * bk), bool)
    padded[:, :, :lq, :lk] = allowed
    tiles = padded.reshape(batch, heads, nq, bq, nk, bk)
    return np.where(tiles.all((3, 5)), 2, np.where(tiles.any((3, 5)), 1, 0))


def check_lists(counts, indices, selected):
    """Counts, ascending valid entries, padding = last valid (0 when none), against a boolean
    [..., n] selection."""
    counts, indices = np.asarray(counts), np.asarray(indices)
    assert counts.dtype == indices.dtype == np.int32
    np.testing.assert_array_equal(counts, selected.sum(-1))
    for row in np.ndindex(counts.shape):
        n = counts[row]
        np.testing.assert_array_equal(indices[row][:n], np.flatnonzero(selected[row]))
        np.testing.assert_array_equal(indices[row][n:], indices[row][n - 1] if n else 0)


def check_block_mask_against(mask, classes):
    np.testing.assert_array_equal(np.asarray(mask.to_dense()), classes)
    transposed = np.swapaxes(classes, -1, -2)
    check_lists(mask.kv_num_blocks, mask.kv_indices, classes == 1)
    check_lists(mask.full_kv_num_blocks, mask.full_kv_indices, classes == 2)
    check_lists(mask.q_num_blocks, mask.q_indices, transposed == 1)
    check_lists(mask.full_q_num_blocks, mask.full_q_indices, transposed == 2)
    np.testing.assert_allclose(float(mask.sparsity()), np.mean(classes == 0), rtol=1e-6)


@pytest.mark.parametrize("index", range(6))
def test_create_block_mask_matches_numpy_oracle(index):
    name, rule, batch, heads, lq, lk, block_size, aux = cases(np.random.default_rng(index))[index]
    classes = oracle_tile_classes(rule, batch, heads, lq, lk, block_size, aux)
    assert {0, 1} <= set(np.unique(classes)) or name == "one_tile", "the case must mix tile classes"
    mask = bm.create_block_mask(rule, batch, heads, lq, lk, block_size=block_size,
                                mod_aux=tuple(jnp.asarray(a) for a in aux))
    assert mask.shape == (batch or 1, heads or 1, lq, lk)
    check_block_mask_against(mask, classes)
    # A pytree: the lists are jit arguments, lengths and block sizes static.
    np.testing.assert_array_equal(jax.jit(lambda m: m.to_dense())(mask), classes)


@pytest.mark.parametrize("lq, lk", [(63, 48), (64, 47)])
def test_ragged_tile_whose_valid_pairs_all_attend_is_partial(lq, lk):
    """One padded row or column is enough to make a tile partial."""
    mask = bm.create_block_mask(lambda b, h, q, kv: q >= 0, None, None, lq, lk, block_size=16)
    classes = np.full((1, 1, -(-lq // 16), -(-lk // 16)), bm.FULL)
    classes[..., lq // 16:, :] = classes[..., :, lk // 16:] = bm.PARTIAL
    check_block_mask_against(mask, classes)


@pytest.mark.parametrize("index", range(6))
def test_create_block_mask_matches_torch_flex_attention(index):
    torch = pytest.importorskip("torch")
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    name, rule, batch, heads, lq, lk, block_size, aux = cases(np.random.default_rng(index))[index]
    torch_aux = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in aux)
    theirs = flex.create_block_mask(lambda b, h, q, kv: rule(b, h, q, kv, *torch_aux), batch, heads,
                                    lq, lk, device="cpu", BLOCK_SIZE=block_size, _compile=False)
    ours = bm.create_block_mask(rule, batch, heads, lq, lk, block_size=block_size,
                                mod_aux=tuple(jnp.asarray(a) for a in aux))
    # Compared as sets per row: torch pads past the count with the unselected indices.
    for prefix in ("", "full_"):
        for axis in ("kv", "q"):
            counts = np.asarray(getattr(ours, f"{prefix}{axis}_num_blocks"))
            indices = np.asarray(getattr(ours, f"{prefix}{axis}_indices"))
            their_counts = getattr(theirs, f"{prefix}{axis}_num_blocks").numpy()
            their_indices = getattr(theirs, f"{prefix}{axis}_indices").numpy()
            np.testing.assert_array_equal(counts, their_counts, err_msg=f"{prefix}{axis}")
            for row in np.ndindex(counts.shape):
                assert (set(indices[row][:counts[row]])
                        == set(their_indices[row][:their_counts[row]])), (prefix, axis, row)


UNBOUNDED = 1 << 20


def bounds_rule(b, h, q, kv, q_len, kv_len, offset, q_seg, kv_seg, flags):
    """The element rule flash_attention documents (docs/semantics.md), written out here; one
    function for every case (flags: is_causal, bottom_right, left, right, has_segments; a side
    without a window is UNBOUNDED), so that create_block_mask compiles it once per shape."""
    is_causal, bottom_right, left, right, has_segments = (flags[i] for i in range(5))
    diagonal = q + offset[b] + bottom_right * (kv_len[b] - q_len[b])
    return ((q < q_len[b]) & (kv < kv_len[b]) & ((is_causal == 0) | (kv <= diagonal))
            & (kv >= diagonal - left) & (kv <= diagonal + right)
            & ((has_segments == 0) | (q_seg[b, q] == kv_seg[b, kv])))


def bounds_aux(batch, lq, lk, is_causal=False, bottom_right=False, window=(None, None),
               q_len=None, kv_len=None, offset=None, q_seg=None, kv_seg=None):
    """bounds_rule's aux for block_mask_from_bounds's arguments."""
    flags = [is_causal, bottom_right, *(UNBOUNDED if w is None else w for w in window), q_seg is not None]
    return (np.full(batch, lq, np.int32) if q_len is None else q_len,
            np.full(batch, lk, np.int32) if kv_len is None else kv_len,
            np.zeros(batch, np.int32) if offset is None else offset,
            np.zeros((batch, lq), np.int32) if q_seg is None else q_seg,
            np.zeros((batch, lk), np.int32) if kv_seg is None else kv_seg,
            np.array(flags, np.int32))


BOUNDS_CASES = [  # is_causal, bottom_right, (left, right), lengths, offset, segments
    (True, False, (None, None), False, False, False),
    (True, True, (None, None), True, False, False),
    (True, True, (None, None), False, False, False),
    (False, False, (40, 7), False, False, False),
    (True, False, (25, None), True, True, False),
    (False, True, (None, 3), True, False, False),
    (False, False, (None, None), True, False, False),
    (False, False, (None, None), False, False, True),
    (True, False, (None, None), True, False, True),
    (True, True, (None, None), True, True, True),
    (True, False, (40, None), False, False, True),
    (False, False, (30, 30), True, False, True),
]


@pytest.mark.parametrize("case", BOUNDS_CASES)
@pytest.mark.parametrize("lq, lk, block_size", [(200, 200, 32), (77, 130, (16, 24))])
def test_block_mask_from_bounds_matches_create_block_mask(case, lq, lk, block_size):
    is_causal, bottom_right, window, has_lengths, has_offset, has_segments = case
    rng = np.random.default_rng(lq + len(str(case)))
    batch = 3
    q_len = rng.integers(lq // 2, lq + 1, batch).astype(np.int32) if has_lengths else None
    kv_len = rng.integers(lk // 2, lk + 1, batch).astype(np.int32) if has_lengths else None
    offset = rng.integers(-30, 30, batch).astype(np.int32) if has_offset else None
    q_seg = kv_seg = None
    if has_segments:  # packed self-attention documents; the keys continue the queries' ids
        ids = packed_documents(rng, batch, max(lq, lk), max_docs=6)
        q_seg, kv_seg = ids[:, :lq], ids[:, :lk]
    spec = masking.MaskSpec(is_causal=is_causal, bottom_right=bottom_right, window_left=window[0],
                            window_right=window[1])
    ours = bm.block_mask_from_bounds(spec, lq, lk, block_size=block_size, q_lengths=q_len,
                                     kv_lengths=kv_len, position_offset=offset,
                                     q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    aux = bounds_aux(batch, lq, lk, is_causal, bottom_right, window, q_len, kv_len, offset, q_seg, kv_seg)
    classes = oracle_tile_classes(bounds_rule, batch, 1, lq, lk, block_size, aux)
    assert len(np.unique(classes)) > 1
    evaluated = bm.create_block_mask(bounds_rule, batch, 1, lq, lk, block_size=block_size,
                                     mod_aux=tuple(jnp.asarray(a) for a in aux))
    np.testing.assert_array_equal(np.asarray(evaluated.to_dense()), classes)
    got = np.asarray(ours.to_dense())
    if has_segments and (has_offset or bottom_right or window != (None, None)):
        # Documented: where the band cuts a tile of mixed ids, from bounds may say partial
        # where no equal-id pair lies inside the band; never anything else.
        conservative = (got == bm.PARTIAL) & (classes == bm.EMPTY)
        assert conservative.mean() <= 0.05
        classes = np.where(conservative, bm.PARTIAL, classes)
    if not (has_lengths or has_offset or has_segments):  # from bounds: one row for all
        assert ours.shape[0] == 1 and (classes == classes[:1]).all()
        classes = classes[:1]
    check_block_mask_against(ours, classes)


def test_new_mask_values_reuse_one_compilation():
    traces = []

    def rule(b, h, q, kv, doc):
        traces.append(1)
        return causal_documents(b, h, q, kv, doc)

    lq = 96
    build = jax.jit(lambda doc: bm.create_block_mask(rule, 2, None, lq, lq, block_size=16,
                                                     mod_aux=(doc,)))
    rng = np.random.default_rng(3)
    for attempt in range(3):
        doc = packed_documents(rng, 2, lq, max_docs=6)
        got = build(jnp.asarray(doc))
        check_block_mask_against(got, oracle_tile_classes(causal_documents, 2, None, lq, lq, 16,
                                                          (doc,)))
        if attempt == 0:
            traced_once = len(traces)
        assert len(traces) == traced_once, "a new mod_aux value retraced mask_mod"
        assert build._cache_size() == 1
    for attempt in range(3):  # the same without an enclosing jit
        doc = packed_documents(rng, 2, lq, max_docs=6)
        got = bm.create_block_mask(rule, 2, None, lq, lq, block_size=16, mod_aux=(jnp.asarray(doc),))
        check_block_mask_against(got, oracle_tile_classes(causal_documents, 2, None, lq, lq, 16,
                                                          (doc,)))
        if attempt == 0:
            traced_eagerly = len(traces)
        assert len(traces) == traced_eagerly, "a new mod_aux value retraced mask_mod"


@pytest.mark.parametrize("rule, error, words", [
    (lambda b, h, q, kv: kv - q, TypeError, "mask_mod must return a bool array"),
    (lambda b, h, q, kv: (kv <= q, q >= 0), TypeError, "mask_mod must return a bool array"),
    (lambda b, h, q, kv: jnp.ones((5, 1, 1, 1), bool), ValueError, "mask_mod returned shape"),
    (lambda b, h, q, kv: jnp.ones((1, 1, 1, 1, 1), bool), ValueError, "mask_mod returned shape"),
])
def test_mask_mod_with_a_wrong_result_is_refused(rule, error, words):
    with pytest.raises(error, match=re.escape(words)):
        bm.create_block_mask(rule, 2, 1, 40, 40, block_size=16)


def test_mask_mod_closing_over_a_tracer_is_refused():
    @jax.jit
    def inside(limit):
        return bm.create_block_mask(lambda b, h, q, kv: kv <= limit[q], None, None, 40, 40,
                                    block_size=16)

    with pytest.raises(ValueError, match="closes over a traced array.*mod_aux"):
        inside(jnp.arange(40))
    leaked = []
    jax.jit(lambda x: leaked.append(x) or x)(jnp.arange(40))
    with pytest.raises(ValueError, match="mod_aux"):
        bm.create_block_mask(lambda b, h, q, kv: kv <= leaked[0][q], None, None, 40, 40,
                             block_size=16)


def test_check_block_mask_names_what_differs():
    mask = bm.create_block_mask(lambda b, h, q, kv: kv <= q, 2, None, 100, 80, block_size=(32, 16))
    bm.check_block_mask(mask, batch=2, heads=4, q_len=100, kv_len=80, block_q=32, block_kv=16)
    wrong = [
        (dict(q_len=96), r"block_mask was built for \(Lq, Lk\)=\(100, 80\); the call has \(Lq, Lk\)=\(96, 80\)"),
        (dict(kv_len=81), r"\(Lq, Lk\)=\(100, 81\)"),
        (dict(batch=3), r"block_mask has \(B, H\)=\(2, 1\).*\(batch, heads\)=\(3, 4\)"),
        (dict(block_q=64), "block_mask.block_q=32 must equal the implementation's block_q=64"),
        (dict(block_kv=32), "block_mask.block_kv=16 must equal"),
    ]
    for change, words in wrong:
        call = dict(batch=2, heads=4, q_len=100, kv_len=80, block_q=32, block_kv=16) | change
        with pytest.raises(ValueError, match=words):
            bm.check_block_mask(mask, **call)
    import dataclasses
    broken = dataclasses.replace(mask, q_indices=mask.q_indices[..., :2])
    with pytest.raises(ValueError, match=r"block_mask.q_indices must be int32 \(2, 1, 5, 4\)"):
        bm.check_block_mask(broken, batch=2, heads=1, q_len=100, kv_len=80)
    with pytest.raises(ValueError, match=r"q_lengths must lie in \[0, 100\]"):
        bm.block_mask_from_bounds(masking.MaskSpec(), 100, 80, q_lengths=np.array([101]))
    with pytest.raises(ValueError, match=r"kv_segment_ids must be integers \[B, 80\]"):
        bm.block_mask_from_bounds(masking.MaskSpec(), 100, 80, q_segment_ids=np.zeros((2, 100), int),
                                  kv_segment_ids=np.zeros((2, 81), int))
    with pytest.raises(ValueError, match="kv_lengths has batch 3 where q_lengths has 2"):
        bm.block_mask_from_bounds(masking.MaskSpec(), 100, 80, q_lengths=np.array([1, 2]),
                                  kv_lengths=np.array([1, 2, 3]))
    with pytest.raises(TypeError, match="block_mask must be a jax_impl.block_mask.BlockMask"):
        bm.check_block_mask(mask.to_dense(), batch=2, heads=1, q_len=100, kv_len=80)


def test_create_block_mask_never_builds_the_whole_mask():
    length = 8192
    lowered = jax.jit(lambda doc: bm.create_block_mask(
        causal_documents, 1, None, length, length, mod_aux=(doc,))).lower(
            jax.ShapeDtypeStruct((1, length), jnp.int32))
    compiled = lowered.compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < length * length // 8, temp  # a bool [Lq, Lk] would be length * length bytes
    shapes = re.findall(r"\[([0-9,]+)\]", compiled.as_text())
    largest = max(np.prod([int(d) for d in s.split(",") if d]) for s in shapes)
    assert largest < length * length // 16, largest


def test_mask_mod_sees_only_indices_inside_the_sequences():
    seen = []

    def rule(b, h, q, kv):
        jax.debug.callback(lambda q_max, kv_max: seen.append((int(q_max), int(kv_max))),
                           q.max(), kv.max())
        return kv <= q

    bm.create_block_mask(rule, None, None, 45, 37, block_size=16)
    assert seen and max(s[0] for s in seen) == 44 and max(s[1] for s in seen) == 36
