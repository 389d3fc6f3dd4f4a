"""implementation="mosaic_tpu": its table entry, its tile lists (the grid walks only non-empty
key tiles), and its forward in the TPU interpreter (races detected) against the float64 torch
oracle, with gradients through its registered backward from the kernel's RowStats.

Interpret mode is slow (seconds per call on CPU): tiny shapes, 128-wide tiles so that the
sequences span several tiles and end ragged.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from conformance import mods as conformance_mods
from conformance.cases import Case
from jax_impl import block_mask, implementations, masking, mosaic_tpu
from jax_impl.call_features import CallFeatures
from jax_impl.config import AttentionConfig, BlockSizes
from jax_impl.flash_attention import explain_implementation
from jax_impl.mosaic_tpu import common
from jax_impl.mosaic_tpu.forward import forward_call
from conformance import tolerance
from _flash_helpers import (DTYPES, assert_judged_correct, baseline, oracle, run, run_arrays,
                            torch_arrays)

needs_pallas_tpu = pytest.mark.skipif(mosaic_tpu.unavailable() is not None,
                                      reason=f"mosaic_tpu: {mosaic_tpu.unavailable()}")
TILES = BlockSizes(**dict.fromkeys(
    ('block_q', 'block_k', 'block_q_dkv', 'block_k_dkv', 'block_q_dq', 'block_k_dq'), 128))


# --- The table and eligibility ---------------------------------------------------------------

def test_table_entry_needs_a_tpu_unless_interpreted_and_is_chosen_on_tpu():
    impl = implementations.get("mosaic_tpu")
    assert impl.automatic and impl.needs_tpu and "unmeasured" in impl.summary
    assert list(implementations.IMPLEMENTATIONS).index("mosaic_tpu") < list(
        implementations.IMPLEMENTATIONS).index("xla")
    features = lambda interpret: CallFeatures(AttentionConfig(
        scale=0.125, mask=masking.MaskSpec(), interpret=interpret), 64)
    reason = impl.unsupported(features(False), "cpu")
    assert "needs a TPU" in reason and "'cpu'" in reason and "interpret=True" in reason
    assert impl.unsupported(features(True), "cpu") is None
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    assert explain_implementation(q, q, q, platform="tpu").chosen == "mosaic_tpu"
    assert explain_implementation(q, q, q, platform="cpu").chosen != "mosaic_tpu"


@pytest.mark.parametrize("features, reason", [
    (dict(dtype=jnp.float16), "dtype float16 is not bfloat16 or float32"),
    (dict(dropout_rate=0.1), None),
    (dict(dtype=jnp.float32, precision=lax.Precision.HIGH), "precision=HIGH with float32 inputs"),
    (dict(dtype=jnp.bfloat16, precision=lax.Precision.HIGH), None),  # 16-bit: native
    (dict(block_sizes=BlockSizes(block_q=64, block_k=128)), "BlockSizes.block_q=64 is not a multiple of 128"),
    (dict(block_sizes=BlockSizes(block_q=128, block_k=128)),  # the backward's fields too
     "BlockSizes.block_q_dkv=32 is not a multiple of 128"),
    (dict(dtype=jnp.float32), None),
])
def test_unsupported_names_what_the_kernel_does_not_take(features, reason):
    cfg = AttentionConfig(scale=0.125, mask=masking.MaskSpec(),
                          dropout_rate=features.pop("dropout_rate", 0.0),
                          precision=features.pop("precision", lax.Precision.HIGHEST),
                          block_sizes=features.pop("block_sizes", None))
    got = mosaic_tpu.unsupported(CallFeatures(cfg, 64, **features))
    assert got == reason if reason is None else reason in got


def test_mods_with_mod_aux_are_refused_and_the_automatic_choice_says_xla():
    """The kernels gather from no mod_aux array: such a call is named as refused and runs on
    xla, and explain_implementation says so (it named mosaic_tpu while xla ran)."""
    q = jax.random.normal(jax.random.key(3), (1, 128, 2, 64), jnp.float32)
    slopes = jax.random.uniform(jax.random.key(4), (2,), jnp.float32)
    alibi = lambda s, b, h, qi, ki, sl: s + sl[h] * (ki - qi)
    choice = explain_implementation(q, q, q, score_mod=alibi, mod_aux=(slopes,), platform="tpu")
    assert choice.chosen == "xla"
    assert "mosaic_tpu" in choice.reasons and "mod_aux" in choice.reasons["mosaic_tpu"]
    index_only = lambda s, b, h, qi, ki: s + 0.5 * (ki - qi)
    assert explain_implementation(q, q, q, score_mod=index_only, platform="tpu").chosen == "mosaic_tpu"
    from jax_impl import flash_attention
    with pytest.raises(ValueError, match="implementation='mosaic_tpu' cannot run this call: "
                                         "score_mod or mask_mod with mod_aux"):
        flash_attention(q, q, q, score_mod=alibi, mod_aux=(slopes,), implementation="mosaic_tpu",
                        interpret=True)


def test_flash_attention_refuses_what_the_kernel_does_not_take_by_name():
    """Judged when the call is made, not where it lowers: the feature is named."""
    from jax_impl import flash_attention
    q = jnp.ones((1, 128, 2, 64), jnp.float16)
    with pytest.raises(ValueError, match="implementation='mosaic_tpu' cannot run this call: "
                                         "dtype float16 is not bfloat16 or float32"):
        flash_attention(q, q, q, implementation="mosaic_tpu", interpret=True)


# --- Tile lists: the grid's key axis walks only non-empty tiles ------------------------------

def _grid(cfg, q, k, masks):
    """The grid of the forward's pallas_call for these operands (traced, not run)."""
    jaxpr = jax.make_jaxpr(lambda q, k, v: forward_call(cfg, q, k, v, masks))(q, k, k)
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    return eqn.params["grid_mapping"].grid


@pytest.mark.parametrize("spec, steps", [
    (masking.MaskSpec(window_left=128, window_right=0), 2),   # each query tile: 2 of 4 key tiles
    (masking.MaskSpec(is_causal=True, window_left=0), 1),      # the diagonal tile alone
    (masking.MaskSpec(is_causal=True), 4),                     # the last query tile sees all 4
])
def test_the_key_axis_extent_is_the_most_non_empty_tiles_of_any_query_tile(spec, steps):
    q = jnp.zeros((1, 512, 2, 64), jnp.bfloat16)
    full = jnp.full((1,), 512, jnp.int32)
    masks = masking.MaskInputs(full, full, None, None, None)
    cfg = AttentionConfig(scale=0.125, mask=spec, block_sizes=TILES)
    assert _grid(cfg, q, q, masks) == (1, 2, 4, steps)


@pytest.mark.parametrize("spec", [
    masking.MaskSpec(is_causal=True), masking.MaskSpec(is_causal=True, bottom_right=True),
    masking.MaskSpec(window_left=100, window_right=30),
    masking.MaskSpec(is_causal=True, bottom_right=True, window_left=200),
    masking.MaskSpec(window_left=0, window_right=0, bottom_right=True)])
@pytest.mark.parametrize("q_len, kv_len, block_q, block_k", [(520, 300, 128, 256), (200, 900, 256, 128)])
@pytest.mark.parametrize("transposed", [False, True])
def test_the_static_step_count_is_the_most_non_empty_tiles_of_block_masks_classes(
        spec, q_len, kv_len, block_q, block_k, transposed):
    """Computed without JAX (under set_mesh a JAX computation would run on the mesh): the
    largest non-empty count of any row of block_mask.tile_classes, both orientations."""
    full = masking.MaskInputs(jnp.full((1,), q_len, jnp.int32), jnp.full((1,), kv_len, jnp.int32),
                              None, None, None)
    classes = np.asarray(block_mask.tile_classes(spec, full, q_len, kv_len, block_q, block_k,
                                                 band_only=True))[0, 0]
    nonempty = (classes != block_mask.EMPTY).sum(axis=0 if transposed else 1)
    assert common.static_steps(spec, full, q_len, kv_len, block_q, block_k,
                               transposed=transposed) == max(1, nonempty.max())


def test_segment_ids_leave_a_query_tile_only_the_tiles_of_its_documents():
    """Two documents of 256 keys: every query tile lists 2 of the 4 key tiles, all FULL, and
    the padding repeats the last listed tile (no new copy)."""
    ids = jnp.repeat(jnp.arange(2, dtype=jnp.int32), 256)[None]
    full = jnp.full((1,), 512, jnp.int32)
    masks = masking.MaskInputs(full, full, ids, ids, None)
    cfg = AttentionConfig(scale=0.125, mask=masking.MaskSpec())
    lists = common.tile_lists(cfg, masks, 512, 512, 128, 128)
    assert lists.steps == 4 and lists.counts.tolist() == [2, 2, 2, 2]
    assert np.asarray(lists.indices).reshape(4, 4).tolist() == [[0, 1, 1, 1], [0, 1, 1, 1],
                                                                [2, 3, 3, 3], [2, 3, 3, 3]]
    assert np.asarray(lists.full).reshape(4, 4)[:, :2].all()


# --- Numbers in the TPU interpreter ------------------------------------------------------------

@contextlib.contextmanager
def _race_detection():
    """The interpreter with race detection; asserts afterwards that it ran and found none."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    try:
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(detect_races=True)):
            yield
    except Exception:
        pltpu.reset_tpu_interpret_mode_state()
        raise
    assert ipc.races is not None and not ipc.races.races_found


PROBLEMS = [  # every sequence ragged against the 128-wide tiles
    Case("bf16-plain-gqa-edges", batch=1, q_heads=2, kv_heads=1, q_len=200, kv_len=130,
         dtype="bfloat16", seed=60),
    Case("fp32-causal-bottomright-lengths-mqa-dropout", batch=2, q_heads=2, kv_heads=1, q_len=260,
         kv_len=140, causal="bottom_right", lengths=True, dropout=0.2, seed=61),
    Case("bf16-causal-window-softcap-sinks-d128", batch=1, q_heads=2, kv_heads=2, q_len=260,
         kv_len=260, head_dim=128, dtype="bfloat16", causal="top_left", window=(50, None),
         soft_cap=4.0, sinks=True, seed=62),
    Case("fp32-segments-mask-bias-d96", batch=1, q_heads=2, kv_heads=2, q_len=200, kv_len=200,
         head_dim=96, segments=True, mask="bool", bias=True, seed=63),
    Case("bf16-mask_mod-block_mask", batch=1, q_heads=2, kv_heads=2, q_len=300, kv_len=300,
         dtype="bfloat16", mods="sliding_global", block_size=128, seed=64),
    Case("fp32-score_mod-empty_rows", batch=1, q_heads=2, kv_heads=1, q_len=140, kv_len=140,
         mods="soft_cap", mask="bool", empty_rows=True, seed=65),
]


def _mods(case: Case) -> dict:
    """The case's score_mod / mask_mod (index-only: no mod_aux) and its block_mask, as
    flash_attention keywords."""
    if case.mods is None:
        return {}
    mods = conformance_mods.get(case.mods)
    given = {name: conformance_mods.bound(fn, jnp) for name, fn in
             (("score_mod", mods.score_mod), ("mask_mod", mods.mask_mod)) if fn is not None}
    if case.block_size:
        given["block_mask"] = block_mask.create_block_mask(
            given["mask_mod"], None, None, case.q_len, case.kv_len, block_size=case.block_size)
    return given


@needs_pallas_tpu
@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.name)
def test_forward_and_its_gradients_match_the_float64_oracle(problem):
    with _race_detection():
        results = run(problem, DTYPES[problem.dtype], "mosaic_tpu", interpret=True,
                      block_sizes=TILES, **_mods(problem))
    assert_judged_correct(results, oracle(problem), baseline(problem), problem.dtype)


@needs_pallas_tpu
@pytest.mark.parametrize("where", ["q", "q, k and v"])
def test_nonfinite_operands_follow_the_rule_inside_the_kernel(where):
    """NaN and inf past the lengths and at allowed pairs: q's rows take the rule once per query
    tile, K and V tile by tile when a flag (read through scalar prefetch) says they hold one, so
    out and the gradients have the float64 oracle's NaNs exactly and its finite values within
    tolerance."""
    seed = int(np.random.SeedSequence().entropy % 2**31)  # fresh inputs every run
    rng = np.random.default_rng(seed)
    q, ct = (rng.standard_normal((2, 200, 2, 64)).astype(np.float32) for _ in "qc")
    k, v = (rng.standard_normal((2, 260, 1, 64)).astype(np.float32) for _ in "kv")
    kv_len, q_len = np.array([170, 260], np.int32), np.array([200, 150], np.int32)
    q[1, 150:] = np.nan                         # past batch row 1's queries
    q[0, 20, 1, 7] = np.inf                     # its own row only (which attends no key)
    k[0, :, 0, 9] = np.abs(k[0, :, 0, 9]) + 0.1
    q[0, 180, 1, 9] = -np.inf  # its logits all -inf, which the bias would exclude: NaN, not empty
    if where != "q":
        k[0, 170:], v[0, 200:] = np.nan, np.inf  # past batch row 0's keys: never reach
        v[0, 140, 0, 3] = np.nan                 # reaches the rows that see key 140 (causal)
        k[1, 30, 0, 5] = -np.inf                 # every row of batch row 1 sees key 30
    bias = rng.standard_normal((2, 2, 200, 260)).astype(np.float32)
    kwargs = dict(bias=bias, is_causal=True, causal_alignment="bottom_right",
                  query_seq_lengths=q_len, key_value_seq_lengths=kv_len)
    with _race_detection():
        results = run_arrays(q, k, v, ct, "mosaic_tpu", interpret=True, block_sizes=TILES,
                             **kwargs)
    reference = torch_arrays(q, k, v, ct, **kwargs)
    plain = torch_arrays(q, k, v, ct, dtype=np.float32, **kwargs)
    assert np.isnan(reference["out"]).any() and not np.isnan(reference["out"]).all()
    for name, got in results.items():
        nan = np.isnan(reference[name])
        np.testing.assert_array_equal(np.isnan(got), nan, err_msg=f"{name}: NaN pattern, seed {seed}")
        verdict = tolerance.judge(name, got[~nan], reference[name][~nan], plain[name][~nan],
                                  "float32")
        assert verdict.passed and np.isfinite(got[~nan]).all(), (verdict, seed)


def test_finite_operands_reach_the_kernel_without_a_copy():
    """The non-finite rule costs one read of q, k and v before the forward kernel, no write: the
    kernel's operands are the inputs as laid out for it, and any non-finite value is handled on
    the tiles in VMEM (what the test above checks)."""
    q = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
    full = jnp.full((1,), 256, jnp.int32)
    cfg = AttentionConfig(scale=128 ** -0.5, mask=masking.MaskSpec(), block_sizes=TILES)
    jaxpr = jax.make_jaxpr(lambda q, k, v: mosaic_tpu.forward(
        cfg, q, k, v, None, masking.MaskInputs(full, full, None, None, None)))(q, q, q)
    producer = {out: eqn for eqn in jaxpr.jaxpr.eqns for out in eqn.outvars}
    (call,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    kernel_operands = [x for x in call.invars if x.aval.shape == (1, 2, 256, 128)]
    assert len(kernel_operands) == 3
    for x in kernel_operands:  # q, k and v: the inputs transposed, nothing computed on them
        assert producer[x].primitive.name == "transpose" and producer[x].invars[0] in jaxpr.jaxpr.invars


# --- The index schedule (the forward's own choice where it can) computes what the lists do -----

@needs_pallas_tpu
@pytest.mark.parametrize("causal, lq, lk, heads, head_dim, blocks", [
    (None, 300, 200, (2, 1), 128, (128, 256)),           # whole rows, ragged, GQA, in place
    ("top_left", 384, 260, (2, 2), 64, (256, 128)),      # causal, D below the lanes
    ("bottom_right", 200, 456, (2, 1), 128, (128, 128)),  # the band shifted by Lk - Lq
    ("bottom_right", 456, 200, (1, 1), 64, (128, 128)),   # the first query rows see no key
    ("top_left", 512, 512, (1, 1), 128, (128, 256)),
])
def test_the_index_schedule_gives_the_lists_results_bit_for_bit(causal, lq, lk, heads, head_dim,
                                                                blocks):
    seed = int(np.random.SeedSequence().entropy % 2**31)  # fresh inputs every run
    rng = np.random.default_rng(seed)
    (hq, hkv), (block_q, block_k) = heads, blocks
    q = jnp.asarray(rng.standard_normal((1, lq, hq, head_dim)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((1, lk, hkv, head_dim)), jnp.bfloat16) for _ in "kv")
    spec = masking.MaskSpec(is_causal=causal is not None, bottom_right=causal == "bottom_right")
    masks = masking.MaskInputs(jnp.full((1,), lq, jnp.int32), jnp.full((1,), lk, jnp.int32),
                               None, None, None)
    cfg = AttentionConfig(scale=head_dim ** -0.5, mask=spec,
                          block_sizes=BlockSizes(block_q=block_q, block_k=block_k))
    results = {schedule: jax.jit(lambda q, k, v, schedule=schedule: forward_call(
        cfg, q, k, v, masks, interpret=pltpu.InterpretParams(), schedule=schedule))(q, k, v)
        for schedule in ("lists", "index")}
    for name, lists, index in zip(("out", "max", "log_sum"), results["lists"], results["index"]):
        np.testing.assert_array_equal(np.asarray(index, np.float32), np.asarray(lists, np.float32),
                                      err_msg=f"{name}, seed {seed}")
    out = np.asarray(results["index"][0], np.float64)
    assert np.isfinite(out).all() and np.abs(out).max() > 0
    # The kernel's own choice on these calls: no list is prefetched (the grid reads only the
    # two lengths).
    assert _prefetched(lambda q, k, v: forward_call(cfg, q, k, v, masks), q, k, v) == 2


def _prefetched(fn, *args) -> int:
    """The scalar-prefetch operands of the forward kernel that ``fn(*args)`` traces."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    return eqn.params["grid_mapping"].num_index_operands


@pytest.mark.parametrize("spec, given", [
    (dict(is_causal=True, window_left=64), {}),
    (dict(is_causal=True, has_kv_lengths=True), {}),
    (dict(is_causal=True), dict(segments=True)),
    (dict(), dict(offset=True)),
])
def test_the_forward_walks_the_lists_where_the_tiles_need_them(spec, given):
    """A window, lengths, segment ids or a position offset: the key tiles depend on more than
    static values, and the kernel prefetches its tile lists (counts, indices, full flags)."""
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    full = jnp.full((1,), 256, jnp.int32)
    ids = jnp.zeros((1, 256), jnp.int32) if given.get("segments") else None
    masks = masking.MaskInputs(full, full, ids, ids, None,
                               jnp.zeros((1,), jnp.int32) if given.get("offset") else None)
    cfg = AttentionConfig(scale=0.125, mask=masking.MaskSpec(**spec), block_sizes=TILES)
    lengths_and_offset = 2 + bool(given.get("offset"))
    assert _prefetched(lambda q: forward_call(cfg, q, q, q, masks), q) == lengths_and_offset + 3
    assert _prefetched(lambda q: forward_call(cfg, q, q, q, masks, schedule="lists"), q) == (
        lengths_and_offset + 3)


def test_the_index_schedule_refuses_tiles_it_cannot_compute_by_name():
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    full = jnp.full((1,), 256, jnp.int32)
    masks = masking.MaskInputs(full, full, None, None, None)
    cfg = AttentionConfig(scale=0.125, mask=masking.MaskSpec(is_causal=True, window_left=64))
    with pytest.raises(ValueError, match="schedule='index': .* this call has a window"):
        forward_call(cfg, q, q, q, masks, schedule="index")
    with pytest.raises(ValueError, match=r"schedule='rows' is not one of \('lists', 'index'\)"):
        forward_call(cfg, q, q, q, masks, schedule="rows")


# --- Plain logits: the scale folded into exp2's multiply ----------------------------------------

def _kernel_eqns(jaxpr):
    """Every equation of a Pallas kernel's jaxpr, those inside its branches and loops too."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in (param if isinstance(param, (tuple, list)) else (param,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _kernel_eqns(inner)


@pytest.mark.parametrize("soft_cap, has_bias, folded", [
    (None, False, True), (30.0, False, False), (None, True, False)])
def test_plain_logits_take_their_row_max_on_the_product_itself(soft_cap, has_bias, folded):
    """Plain logits (no soft cap, bias or score_mod): the row max is taken on q.k as the
    MXU returns it, the scale applied once inside exp2's argument (one multiply fewer per
    logit than scaling S first); with a soft cap or a bias S is formed first."""
    q = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
    full = jnp.full((1,), 256, jnp.int32)
    masks = masking.MaskInputs(full, full, None, None, None)
    cfg = AttentionConfig(scale=128 ** -0.5, mask=masking.MaskSpec(), logits_soft_cap=soft_cap,
                          block_sizes=BlockSizes(block_q=128, block_k=128))
    bias = jnp.zeros((1, 2, 256, 256), jnp.float32) if has_bias else None
    jaxpr = jax.make_jaxpr(lambda q, k, v: forward_call(cfg, q, k, v, masks, bias))(q, q, q)
    (call,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    eqns = list(_kernel_eqns(call.params["jaxpr"]))
    producer = {out: eqn.primitive.name for eqn in eqns for out in eqn.outvars}
    tile_maxes = [e for e in eqns if e.primitive.name == "reduce_max"
                  and e.invars[0].aval.shape == (128, 128)]
    assert tile_maxes
    assert all((producer.get(e.invars[0]) == "dot_general") == folded for e in tile_maxes)
    assert any(e.primitive.name == "exp2" for e in eqns)
    assert not any(e.primitive.name == "exp" for e in eqns)
