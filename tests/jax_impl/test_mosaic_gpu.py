"""implementation="mosaic_gpu": its table entry and eligibility, its tiles, its work order, and
(jax >= 0.11) its numbers in the Mosaic GPU interpreter against the float64 torch oracle.

The interpreter runs the kernel's program (TMA copies, the mbarrier ring, the schedule barrier,
the masks and the base-2 softmax, the persistent loop) except the P V product, which it cannot
run as a register-operand wgmma: there it is a plain dot (forward._accumulate_values). The
interpreter checks at the end that every warpgroup observed every barrier phase. On jax 0.10
(CI's suite) the kernel is not offered and only the first group of tests runs; the others need
jax 0.11 (Python >= 3.12): CI's CUDA compile lane runs them in its venv, with the oracle in the
suite's Python (tests/cuda_compile_lane.sh, ``ORACLE_PYTHON``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conformance.cases import Case
from jax_impl import (dropout_sinks, implementations, masking, mosaic_gpu, online_softmax,
                      pallas_triton, recompute_vjp, reference)
from jax_impl import block_mask as block_mask_lib
from jax_impl.call_features import CallFeatures
from jax_impl.config import AttentionConfig, BlockSizes
from jax_impl.flash_attention import explain_implementation, flash_attention
from jax_impl.mosaic_gpu.config import (BackwardConfig, Config, default_config,
                                        packs_query_group)
from jax_impl.mosaic_gpu.scheduler import WorkOrder
from _flash_helpers import DTYPES, assert_judged_correct, baseline, oracle, run, torch_arrays

needs_mosaic = pytest.mark.skipif(mosaic_gpu.unavailable() is not None,
                                  reason=f"mosaic_gpu: {mosaic_gpu.unavailable()}")
# The numbers: in the interpreter (any machine with jax >= 0.11), and compiled on a CUDA device
# of compute capability 9.0 (the gpu lane: pytest -m gpu, benchmarks/run_gpu.sh).
INTERPRET = [pytest.param(True, id="interpret", marks=needs_mosaic),
             pytest.param(False, id="compiled", marks=(needs_mosaic, pytest.mark.gpu))]


# --- The table, eligibility, dispatch (any jax) --------------------------------------------

def test_table_entry_is_by_name_only_and_says_whose_backward_it_uses():
    """Its own backward by default; pallas_triton's where the caller's Config chose it."""
    impl = implementations.get("mosaic_gpu")
    assert not impl.automatic and impl.needs_cuda and impl.takes_position_offset
    assert "pallas_triton" in impl.summary and "GPU" in impl.manual_because
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    choice = explain_implementation(q, q, q, platform="cuda")
    assert choice.chosen == "pallas_triton"
    assert choice.reasons["mosaic_gpu"] == (mosaic_gpu.unavailable() or
                                           f"never chosen automatically: {impl.manual_because}")


@pytest.mark.parametrize("features, reason", [
    (dict(head_dim=96), "head_dim=96 is not one of (64, 128, 256)"),
    (dict(head_dim=256, has_bias=True, dropout_rate=0.1),
     "head_dim=256 with a bias and dropout: at head_dim 256 a bias or mask ring does not fit"),
    (dict(head_dim=256, has_mask=True), "head_dim=256 with a dense mask"),
    (dict(head_dim=256, has_segment_ids=True, has_sinks=True, soft_cap=3.0), None),
    (dict(dtype=jnp.float32), "dtype float32 is not bfloat16 or float16"),
    (dict(has_bias=True), None),  # taken, forward and backward
    (dict(has_mask=True), None),
    (dict(has_bias=True, has_mask=True, block_sizes=Config(64, 64, 2), head_dim=128), None),
    (dict(has_bias=True, block_sizes=Config(64, 128, 2), head_dim=128),
     "block_sizes=Config(block_q=64, block_kv=128, num_stages=2, persistent=True, backward=None, "
     "backward_config=None, pack_query_group=None, overlap=True) needs 292.1 KiB of shared memory "
     "at head_dim=128 with a bias"),
    (dict(has_segment_ids=True), None),  # taken, forward and backward
    (dict(dropout_rate=0.1), None),  # taken, forward and backward
    (dict(block_sizes=BlockSizes()), "block_sizes is a BlockSizes"),
    (dict(block_sizes=Config(64, 128, 3), head_dim=128), "block_sizes=Config(block_q=64, block_kv=128, num_stages=3"),
    (dict(block_sizes=Config(64, 128, 3)), None),  # the same tiles fit at head_dim 64
    (dict(), None),
    (dict(has_sinks=True, soft_cap=3.0, block_sizes=Config()), None),
    (dict(block_sizes=Config(backward_config=BackwardConfig(128, 128, dq="fused")), head_dim=128),
     "backward_config=BackwardConfig(block_q=128, block_kv=128, num_stages=2, dq='fused') needs"),
    (dict(block_sizes=Config(backward_config=BackwardConfig(dq="fused")), head_dim=128,
          has_segment_ids=True), None),  # the default tiles fit, fused
    (dict(block_sizes=Config(pack_query_group=True), dropout_rate=0.1, has_mask=True),
     "Config(pack_query_group=True) packs a kv head's query heads into one tile's rows, where "
     "dropout and a dense mask would differ per query head"),
    (dict(block_sizes=Config(pack_query_group=True), has_bias=True),
     "Config(pack_query_group=True) packs a kv head's query heads into one tile's rows, where "
     "a bias would differ per query head"),
    (dict(block_sizes=Config(pack_query_group=True), has_sinks=True, has_segment_ids=True), None),
    (dict(block_sizes=Config(), dropout_rate=0.1, has_bias=True), None),  # None: left unpacked
], ids=lambda x: str(x)[:40])
def test_every_feature_it_does_not_take_is_named(monkeypatch, features, reason):
    monkeypatch.setattr(mosaic_gpu, "_UNAVAILABLE", None)  # judged as on jax >= 0.11
    features = dict(features)
    cfg = AttentionConfig(scale=1.0, mask=masking.MaskSpec(), logits_soft_cap=features.pop("soft_cap", None),
                          dropout_rate=features.pop("dropout_rate", 0.0),
                          block_sizes=features.pop("block_sizes", None))
    got = mosaic_gpu.unsupported(CallFeatures(cfg, features.pop("head_dim", 64),
                                              dtype=features.pop("dtype", jnp.bfloat16), **features))
    assert (got is None) if reason is None else got.startswith(reason), got


def test_the_mods_and_a_block_mask_are_taken_unless_the_query_group_is_packed(monkeypatch):
    """score_mod, mask_mod and a block_mask run in the kernels (forward and backward); a packed
    query group would mix query heads in one tile's rows, so Config(pack_query_group=True)
    refuses them by name."""
    monkeypatch.setattr(mosaic_gpu, "_UNAVAILABLE", None)
    cfg = AttentionConfig(scale=1.0, mask=masking.MaskSpec(has_block_mask=True),
                          score_mod=lambda s, b, h, q_idx, kv_idx: s,
                          mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    assert mosaic_gpu.unsupported(CallFeatures(cfg, 64, dtype=jnp.bfloat16)) is None
    packed = dataclasses.replace(cfg, block_sizes=Config(pack_query_group=True))
    assert "where a block_mask and score_mod and mask_mod would differ per query head" in (
        mosaic_gpu.unsupported(CallFeatures(packed, 64, dtype=jnp.bfloat16)))


def test_unavailable_on_old_jax_says_so(monkeypatch):
    monkeypatch.setattr(jax, "__version_info__", (0, 10, 2))
    monkeypatch.setattr(jax, "__version__", "0.10.2")
    assert mosaic_gpu._import_error() == "the Mosaic GPU kernel needs jax >= 0.11; this is jax 0.10.2"


def test_a_cpu_call_by_name_is_refused_naming_it():
    q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
    error = ValueError if mosaic_gpu.unavailable() else NotImplementedError
    with pytest.raises(error, match="mosaic_gpu"):
        jax.block_until_ready(flash_attention(q, q, q, implementation="mosaic_gpu"))


def test_unsupported_calls_by_name_are_refused_before_tracing(monkeypatch):
    monkeypatch.setattr(mosaic_gpu, "_UNAVAILABLE", None)
    q = jnp.ones((1, 64, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="mosaic_gpu.*float32"):
        flash_attention(q, q, q, implementation="mosaic_gpu")
    with pytest.raises(TypeError, match="mosaic_gpu.Config"):
        flash_attention(q, q, q, implementation="xla", block_sizes=Config())


# --- Tiles and the work order (any jax) ----------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(block_q=32), "multiple of 64"), (dict(block_kv=96), "multiple of 64"),
    (dict(block_q=192), "64 or 128"), (dict(num_stages=1), r"\[2, 4\]"),
    (dict(persistent=1), "bool"),
    (dict(backward_config="fused"),
     r"backward_config='fused' must be a mosaic_gpu.BackwardConfig"),
    (dict(pack_query_group="yes"), r"pack_query_group='yes' must be None \(where it pays\)"),
    (dict(overlap=1), "overlap=1 must be a bool")])
def test_config_is_validated(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Config(**kwargs)


def test_backward_config_dq_is_validated_and_its_shared_memory_counts_the_fused_tiles():
    with pytest.raises(ValueError, match=r"BackwardConfig.dq='atomic' must be one of "
                                         r"\('separate', 'fused'\)"):
        BackwardConfig(dq="atomic")
    for head_dim in (64, 128):
        separate = BackwardConfig().shared_memory_bytes(head_dim, jnp.bfloat16)
        fused = BackwardConfig(dq="fused").shared_memory_bytes(head_dim, jnp.bfloat16)
        # per consumer: dS^T (64 x 64, 16-bit) and the fp32 dQ tile (64 x head_dim) on top of
        # dK/dV's scratch; separate is the larger kernel's (dQ's ring of key poison: 512 B more)
        tiles = 2 * 64 * (64 * 2 + head_dim * 4)
        assert tiles - 512 <= fused - separate <= tiles, head_dim
        assert fused <= 227 * 1024


@pytest.mark.parametrize("config, lq, groups, per_head_pairs, packed", [
    (Config(64, 128, 2), 64, 8, False, True),     # 4 items of 128 rows instead of 8
    (Config(128, 64, 2), 96, 8, False, True),     # 3 items of 256 rows instead of 8
    (Config(64, 128, 2), 200, 4, False, True),    # 7 instead of 8: 0.875 of them
    (Config(64, 128, 2), 600, 2, False, False),   # 10 instead of 10: no gain
    (Config(64, 128, 2), 4096, 8, False, False),  # whole items either way
    (Config(64, 128, 2), 64, 1, False, False),    # MHA: nothing to pack
    (Config(64, 128, 2), 64, 8, True, False),     # dropout, a bias or a mask: per head
    (Config(pack_query_group=False), 64, 8, False, False),
    (Config(pack_query_group=True), 4096, 8, False, True),
    (Config(pack_query_group=True), 4096, 8, True, False),  # unsupported() refuses it by name
])
def test_the_query_group_is_packed_where_it_fills_fewer_items(config, lq, groups,
                                                               per_head_pairs, packed):
    """FlashAttention-3's PackGQA rule in work items: packed where the group's Lq * G rows fill
    at most 0.9 of the items that G heads of Lq rows each take."""
    assert packs_query_group(config, lq, groups, per_head_pairs=per_head_pairs) is packed


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_default_tiles_fit_the_shared_memory_budget(head_dim):
    config = default_config(head_dim, jnp.bfloat16)
    assert config.shared_memory_bytes(head_dim, jnp.bfloat16) <= 227 * 1024


def test_default_tiles_are_the_sweeps_clean_candidates():
    """The defaults at head_dim 64 and 128 are among the committed sm_90a sweep
    (benchmarks/results/mosaic_forward_tiles_sm90.json), causal and not: compiled with 0 spill
    bytes, no wgmma serialisation, the softmax pipelined (a partial wgmma wait), within 227 KiB
    and the estimate; the previous default stays selectable."""
    import json
    from pathlib import Path
    from jax_impl.mosaic_gpu.config import PREVIOUS_DEFAULT
    rows = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "results" /
                       "mosaic_forward_tiles_sm90.json").read_text())
    assert default_config(64, jnp.bfloat16) == Config(128, 64, 2)
    assert default_config(128, jnp.bfloat16) == PREVIOUS_DEFAULT == Config(64, 128, 2)
    for head_dim in (64, 128):
        config = default_config(head_dim, jnp.bfloat16)
        found = [r for r in rows if r["head_dim"] == head_dim and
                 (r["block_q"], r["block_kv"], r["num_stages"]) ==
                 (config.block_q, config.block_kv, config.num_stages)]
        assert {r["causal"] for r in found} == {False, True}, head_dim
        for r in found:
            assert r["ok"] and r["spill_stores"] == r["spill_loads"] == 0, r
            assert not r["serialized"] and r["partial_waits"] >= 1, r
            assert r["shared"] <= min(r["shared_estimate"], 227 * 1024), r
    for head_dim in (64, 128):
        assert mosaic_gpu.unsupported(CallFeatures(AttentionConfig(
            scale=1.0, mask=masking.MaskSpec(), block_sizes=PREVIOUS_DEFAULT), head_dim,
            dtype=jnp.bfloat16)) in (None, mosaic_gpu.unavailable())


def test_tile_candidates_are_benchmark_plugins_that_pass_their_tiles(monkeypatch):
    """run_gpu.sh's step 3b times each candidate of the sweep by name (benchmarks.mosaic_tiles
    through the plug-in registry); a candidate whose ring does not fit says so."""
    import jax_impl.flash_attention as api
    from benchmarks import mosaic_tiles, suites
    from conformance import registry
    seen = []
    monkeypatch.setattr(api, "flash_attention",
                        lambda *a, **k: seen.append((k["implementation"], k["block_sizes"])))
    suite = suites.get_suite("mosaic_tiles")
    assert set(mosaic_tiles.PLUGINS) <= set(suite.impls["cuda"])
    assert {c.mode for c in suite.configs} == {"fwd"}
    for tiles, spec in zip(mosaic_tiles.TILE_CANDIDATES, mosaic_tiles.PLUGINS):
        adapter = registry.get_adapter(spec, "cpu")
        adapter.fn(None, None, None)
        assert seen[-1] == ("mosaic_gpu", Config(*tiles))
        d128 = adapter.fn.unsupported(Case("c", head_dim=128, dtype="bfloat16"))
        fits = Config(*tiles).shared_memory_bytes(128, jnp.bfloat16) <= 227 * 1024
        assert (d128 is None) == fits, (spec, d128)
        assert adapter.fn.unsupported(Case("c", head_dim=64, dtype="bfloat16")) is None
    assert registry.get_adapter("benchmarks.mosaic_tiles:q64_kv256_s2", "cpu").fn.unsupported(
        Case("c", head_dim=128, dtype="bfloat16")).startswith("tiles q64_kv256_s2 need")


def test_dq_strategies_are_benchmark_plugins_that_pass_their_backward_config(monkeypatch):
    """run_gpu.sh's step 3c times both dQ strategies (forward+backward) by name: the default
    forward tiles, the Mosaic backward chosen, its default tiles with that dq."""
    import dataclasses as dc

    import jax_impl.flash_attention as api
    from benchmarks import mosaic_tiles, suites
    from conformance import registry
    from jax_impl.mosaic_gpu.config import default_backward_config
    seen = []
    monkeypatch.setattr(api, "flash_attention", lambda *a, **k: seen.append(k["block_sizes"]))
    suite = suites.get_suite("mosaic_dq")
    assert set(suite.impls["cuda"]) == set(mosaic_tiles.DQ_PLUGINS)
    assert {c.mode for c in suite.configs} == {"fwd+bwd"}
    for head_dim in (64, 128):
        q = jnp.zeros((1, 64, 2, head_dim), jnp.bfloat16)
        for dq, spec in zip(("separate", "fused"), mosaic_tiles.DQ_PLUGINS):
            registry.get_adapter(spec, "cpu").fn(q, q, q, is_causal=True)
            assert seen[-1] == dc.replace(
                default_config(head_dim, jnp.bfloat16), backward="mosaic_gpu",
                backward_config=dc.replace(default_backward_config(head_dim, jnp.bfloat16),
                                           dq=dq)), (spec, head_dim)


def test_the_unpacked_plugin_passes_the_default_tiles_never_packed(monkeypatch):
    """run_gpu.sh's step 3d times the default (packed where it pays) beside this plug-in."""
    import dataclasses as dc

    import jax_impl.flash_attention as api
    from conformance import registry
    seen = []
    monkeypatch.setattr(api, "flash_attention",
                        lambda *a, **k: seen.append((k["implementation"], k["block_sizes"])))
    for head_dim in (64, 128):
        q = jnp.zeros((1, 64, 8, head_dim), jnp.bfloat16)
        registry.get_adapter("benchmarks.mosaic_tiles:unpacked", "cpu").fn(q, q, q)
        assert seen[-1] == ("mosaic_gpu", dc.replace(default_config(head_dim, jnp.bfloat16),
                                                     pack_query_group=False))


@pytest.mark.parametrize("spec", [masking.MaskSpec(is_causal=True), masking.MaskSpec(),
                                  masking.MaskSpec(window_left=100, window_right=0),
                                  masking.MaskSpec(is_causal=True, bottom_right=True)],
                         ids=["causal", "full", "window", "causal-bottom-right"])
@pytest.mark.parametrize("persistent", [True, False])
def test_work_order_takes_every_item_once_heaviest_first(spec, persistent):
    """Against the mask rule: the key tiles a pair sees (masking.kv_block_range) never grow
    along the order in which the items are started (item w starts in round w // num_ctas)."""
    lq, lk, rows, block_kv, heads, batch = 1000, 1100, 128, 128, 3, 2
    num_pairs = -(-lq // rows)
    order = WorkOrder.create(num_pairs, heads, batch, masking.later_query_tiles_heavier(spec),
                             persistent, num_sms=5)
    seen = []
    for cta in range(order.num_ctas):
        for i in range(int(order.items_of(cta))):
            seen.append((int(order.work(cta, i)), *map(int, order.item(order.work(cta, i)))))
    assert sorted(w for w, *_ in seen) == list(range(num_pairs * heads * batch))
    assert len({tuple(x[1:]) for x in seen}) == len(seen)
    work = lambda pair: np.subtract(*masking.kv_block_range(
        spec, pair * rows, rows, block_kv, jnp.int32(lq), jnp.int32(lk))[::-1])
    weights = [int(work(pair)) for _, pair, _, _ in sorted(seen)]
    assert weights == sorted(weights, reverse=True)


# --- Numbers in the interpreter (jax >= 0.11) ------------------------------------------------

PROBLEMS = [  # 16-bit, head_dim 64 / 128; lengths that are no multiple of a tile
    Case("bf16-plain-edges", q_len=200, kv_len=130, kv_heads=2, dtype="bfloat16", seed=40),
    Case("fp16-causal-topleft-lq<lk", q_len=70, kv_len=300, kv_heads=2, dtype="float16",
         causal="top_left", seed=41),
    Case("bf16-causal-bottomright-lq>lk-lengths", q_len=300, kv_len=129, kv_heads=1, dtype="bfloat16",
         causal="bottom_right", lengths=True, seed=42),
    Case("fp16-window-d128", q_len=257, kv_len=257, q_heads=2, kv_heads=2, head_dim=128,
         dtype="float16", window=(40, 9), seed=43),
    Case("bf16-causal-window-left-softcap-sinks", q_len=260, kv_len=260, kv_heads=2, dtype="bfloat16",
         causal="top_left", window=(50, None), soft_cap=4.0, sinks=True, seed=44),
    Case("bf16-decode-lq1", q_len=1, kv_len=300, kv_heads=1, dtype="bfloat16",
         causal="bottom_right", lengths=True, seed=45),
]


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.name)
def test_forward_and_backward_match_the_float64_oracle(problem, interpret):
    results = run(problem, DTYPES[problem.dtype], "mosaic_gpu", interpret=interpret)
    assert_judged_correct(results, oracle(problem), baseline(problem), problem.dtype)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("config", [Config(64, 64, 2), Config(64, 128, 3), Config(128, 64, 4),
                                    Config(64, 64, 2, persistent=False),
                                    Config(64, 128, 2, overlap=False)], ids=str)
def test_tiles_stages_and_a_persistent_loop_of_many_items(monkeypatch, config, interpret):
    """Two CTAs walk all 2 x 4 x 3 items (several items each: the ring's slot and phase run on
    across items), with causal bottom-right lengths: each config gives the oracle's numbers."""
    monkeypatch.setattr(mosaic_gpu, "_num_sms", lambda: 2)
    problem = Case("bf16-persistent", batch=2, q_len=190 if config.block_q == 64 else 400, kv_len=250,
                   q_heads=4, kv_heads=2, dtype="bfloat16", causal="bottom_right", lengths=True, seed=46)
    results = run(problem, jnp.bfloat16, "mosaic_gpu", interpret=interpret, block_sizes=config)
    assert_judged_correct(results, oracle(problem), baseline(problem), "bfloat16")


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("dtype, magnitude", [("float16", 1e8), ("bfloat16", 1e9), ("bfloat16", 1e36)],
                         ids=["fp16-1e8", "bf16-1e9", "bf16-1e36"])
def test_huge_logits_give_the_oracles_output(dtype, magnitude, interpret):
    """q, k ~ N(0, 1) * sqrt(magnitude), D=64: logits q.k / 8 of order ``magnitude`` (up to
    float16's largest inputs and float32's largest logits), far apart: one-hot rows. The row max
    is subtracted before the multiply by log2(e) (online_softmax.online_step), so the max's P is
    exactly 1 (S log2(e) - max log2(e) rounds its terms hundreds apart: inf, NaN rows)."""
    rng = np.random.default_rng(48)
    numpy_dtype = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    draw = lambda shape, size: (rng.standard_normal(shape) * size).astype(numpy_dtype)
    size = np.sqrt(magnitude)
    q, k, v = draw((1, 70, 2, 64), size), draw((1, 130, 1, 64), size), draw((1, 130, 1, 64), 1.0)
    out = flash_attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                          implementation="mosaic_gpu", interpret=interpret)
    out = np.asarray(out, np.float64)
    expected = torch_arrays(q, k, v, draw(q.shape, 1.0), is_causal=True,
                            causal_alignment="bottom_right")["out"]
    assert np.all(np.isfinite(out)), f"{np.sum(~np.isfinite(out))} NaN/inf"
    np.testing.assert_allclose(out, expected, rtol=0, atol=float(np.finfo(numpy_dtype).eps))


@pytest.mark.parametrize("interpret", INTERPRET)
def test_row_stats_are_the_contract_and_repeat_bit_for_bit(interpret):
    """RowStats as every backend writes them: rows with no allowed key (past q_len, a window
    that misses every key) have max = +inf and log_sum = 0 exactly and output 0; the others
    agree with the xla path's; a second call gives the same bits."""
    rng = np.random.default_rng(47)
    b, lq, lk, h, d = 2, 150, 140, 2, 64
    q, k, v = (jnp.asarray(rng.standard_normal((b, n, h, d)), jnp.bfloat16) for n in (lq, lk, lk))
    spec = masking.MaskSpec(window_left=3, window_right=0, has_q_lengths=True, has_kv_lengths=True)
    masks = masking.MaskInputs(jnp.array([150, 90], jnp.int32), jnp.array([140, 60], jnp.int32),
                               None, None, None)
    cfg = AttentionConfig(scale=d ** -0.5, mask=spec, interpret=interpret)
    out, stats = mosaic_gpu.forward(cfg, q, k, v, None, masks)
    again = mosaic_gpu.forward(cfg, q, k, v, None, masks)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves((out, stats)), jax.tree.leaves(again)))
    _, ref_stats = implementations.get("xla").forward(dataclasses.replace(cfg, interpret=False),
                                                          q, k, v, None, masks)
    empty = np.asarray(ref_stats.max) == np.inf
    assert empty[1].any() and not empty[0].all()  # rows past q_len, and rows past kv_len's window
    np.testing.assert_array_equal(np.asarray(stats.max)[empty], np.inf)
    np.testing.assert_array_equal(np.asarray(stats.log_sum)[empty], 0.0)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)).transpose(0, 2, 1, 3)[empty], 0.0)
    for got, want in zip(stats, ref_stats):
        np.testing.assert_allclose(np.asarray(got)[~empty], np.asarray(want)[~empty], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("causal, window", [(True, None), (False, (7, 3)), (True, (30, None))])
def test_position_offset_shifts_the_band(causal, window, interpret):
    """What ring attention passes per chunk pair, forward and (pallas_triton's) backward."""
    from test_position_offset import _numpy_mask
    rng = np.random.default_rng(48)
    b, lq, lk, hq, hkv, d = 3, 140, 200, 2, 1, 64
    normal = lambda *s: rng.standard_normal(s).astype(np.float32)
    q, k, v, ct = (jnp.asarray(normal(b, n, hh, d), jnp.bfloat16) for n, hh in
                   ((lq, hq), (lk, hkv), (lk, hkv), (lq, hq)))
    offsets = np.array([60, -20, 200], np.int32)
    q_len, kv_len = np.array([lq, 120, 50], np.int32), np.array([lk, 190, 30], np.int32)
    spec = masking.MaskSpec(is_causal=causal, window_left=None if window is None else window[0],
                            window_right=None if window is None else window[1],
                            has_q_lengths=True, has_kv_lengths=True)
    cfg = AttentionConfig(scale=d ** -0.5, mask=spec, interpret=interpret)
    masks = masking.MaskInputs(jnp.asarray(q_len), jnp.asarray(kv_len), None, None, None,
                               position_offset=jnp.asarray(offsets))

    def attend(q, k, v):
        return recompute_vjp.attention(implementations.get("mosaic_gpu"), cfg, q, k, v, None, masks,
                                       dropout_sinks.SinksAndDropout())[0]

    out, vjp = jax.vjp(attend, q, k, v)
    results = dict(zip(("out", "dq", "dk", "dv"), (out, *vjp(ct))))
    mask = _numpy_mask(b, lq, lk, offsets, causal, window, q_len, kv_len)
    f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
    reference = torch_arrays(f32(q), f32(k), f32(v), f32(ct), mask=mask)
    plain = torch_arrays(f32(q), f32(k), f32(v), f32(ct), dtype=ml_dtypes.bfloat16, mask=mask)
    from conformance import tolerance
    for name, x in results.items():
        verdict = tolerance.judge(name, np.asarray(x, np.float64), reference[name], plain[name], "bfloat16")
        assert verdict.passed, verdict


@pytest.mark.parametrize("interpret", INTERPRET)
def test_nonfinite_values_follow_the_rule_of_every_implementation(interpret):
    """A NaN in v and an inf in k at keys some rows may not attend, a NaN query row: the NaN
    pattern and the finite values of out match the xla path's."""
    rng = np.random.default_rng(49)
    b, l, h, d = 1, 150, 2, 64
    q, k, v = (rng.standard_normal((b, l, h, d)).astype(np.float32) for _ in range(3))
    v[0, 100, 0, 5] = np.nan
    k[0, 140, 1, 3] = np.inf
    q[0, 20, 1, 0] = np.nan
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    options = dict(is_causal=True, local_window_size=(60, None))
    got = flash_attention(q, k, v, implementation="mosaic_gpu", interpret=interpret, **options)
    want = flash_attention(q, k, v, implementation="xla", **options)
    got, want = (np.asarray(x.astype(jnp.float32)) for x in (got, want))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(want).any() and not np.isnan(want).all()
    finite = ~np.isnan(want)
    np.testing.assert_allclose(got[finite], want[finite], atol=2e-2)


# --- Segment ids (forward and backward) ------------------------------------------------------

SEGMENT_PROBLEMS = [  # packed segments on every tile (the interior too), with the band rules
    Case("bf16-segments-causal-bottomright-lengths-gqa", q_len=200, kv_len=170, q_heads=4,
         kv_heads=2, dtype="bfloat16", causal="bottom_right", lengths=True, segments=True, seed=60),
    Case("fp16-segments-window-d128", q_len=150, kv_len=150, q_heads=2, kv_heads=2, head_dim=128,
         dtype="float16", window=(40, 9), segments=True, seed=61),
]


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("problem", SEGMENT_PROBLEMS, ids=lambda p: p.name)
def test_segment_ids_match_the_float64_oracle(problem, interpret):
    """Segment ids read per tile by plain loads (the query tile's once per item, each key
    tile's beside its logits). Interpreted, the gradients are pallas_triton's (the default
    there); compiled, the Mosaic backward's (test_backward_kernels_match_the_float64_oracle
    runs those interpreted)."""
    results = run(problem, DTYPES[problem.dtype], "mosaic_gpu", interpret=interpret)
    assert_judged_correct(results, oracle(problem), baseline(problem), problem.dtype)


def test_segment_ids_are_differentiated_by_the_mosaic_backward(monkeypatch):
    """Its own kernels take segment ids (compiled by default, interpreted when chosen); only
    Config(backward="pallas_triton") or an interpreted call without a choice goes to Triton."""
    called = []
    monkeypatch.setattr(mosaic_gpu, "backward", lambda *a, **k: called.append("mosaic_gpu"))
    monkeypatch.setattr(pallas_triton, "backward", lambda *a, **k: called.append("pallas_triton"))
    ids = jnp.zeros((1, 64), jnp.int32)
    masks = masking.MaskInputs(None, None, ids, ids, None)
    for config, interpret in ((None, False), (Config(backward="mosaic_gpu"), True),
                              (Config(backward="pallas_triton"), False), (None, True)):
        cfg = AttentionConfig(scale=1.0, mask=masking.MaskSpec(), block_sizes=config,
                              interpret=interpret)
        implementations.get("mosaic_gpu").backward(cfg, jnp.zeros((1, 64, 1, 64)), None, None,
                                                   None, masks, None, None, None)
    assert called == ["mosaic_gpu"] * 2 + ["pallas_triton"] * 2


@needs_mosaic
def test_backward_call_refuses_one_sided_segment_ids():
    from jax_impl.mosaic_gpu.backward import backward_call
    from jax_impl.mosaic_gpu.config import BackwardConfig
    cfg = AttentionConfig(scale=1.0, mask=masking.MaskSpec())
    with pytest.raises(ValueError, match="q_segment_ids and kv_segment_ids"):
        backward_call(cfg, BackwardConfig(), *[None] * 8, q_segment_ids=jnp.zeros((1, 64)))


# --- head_dim 256: the forward alone -----------------------------------------------------

D256_PROBLEMS = [
    Case("bf16-d256-causal-bottomright-lengths-gqa-softcap-sinks", q_len=150, kv_len=200,
         q_heads=4, kv_heads=2, head_dim=256, dtype="bfloat16", causal="bottom_right",
         lengths=True, soft_cap=20.0, sinks=True, seed=95),
    Case("fp16-d256-window-segments", q_len=130, kv_len=130, q_heads=2, kv_heads=2,
         head_dim=256, dtype="float16", window=(40, 9), segments=True, seed=96),
]


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("problem", D256_PROBLEMS, ids=lambda p: p.name)
def test_head_dim_256_matches_the_float64_oracle(problem, interpret):
    """The forward on config.D256's tiles (64 x 64 x 2, each tile's P V waited before the next
    S: ``Config.overlap=False``); the gradients are pallas_triton's (backward_unsupported)."""
    assert default_config(256, jnp.bfloat16) == Config(64, 64, 2, overlap=False)
    results = run(problem, DTYPES[problem.dtype], "mosaic_gpu", interpret=interpret)
    assert_judged_correct(results, oracle(problem), baseline(problem), problem.dtype)


def test_head_dim_256_is_differentiated_by_pallas_tritons_backward(monkeypatch):
    """Compiled too: the dK/dV kernel's fp32 dK and dV would not fit its registers."""
    called = []
    monkeypatch.setattr(mosaic_gpu, "backward", lambda *a, **k: called.append("mosaic_gpu"))
    monkeypatch.setattr(pallas_triton, "backward", lambda *a, **k: called.append("pallas_triton"))
    cfg = AttentionConfig(scale=1.0, mask=masking.MaskSpec(), block_sizes=None)
    masks = masking.MaskInputs(None, None, None, None, None)
    for head_dim in (128, 256):
        implementations.get("mosaic_gpu").backward(cfg, jnp.zeros((1, 64, 1, head_dim)), None,
                                                   None, None, masks, None, None, None)
    assert called == ["mosaic_gpu", "pallas_triton"]
    assert mosaic_gpu.backward_unsupported(cfg, head_dim=256).startswith(
        "head_dim=256: the dK/dV kernel's fp32 dK and dV (2 x 64 x 256 per warpgroup) do not "
        "fit its registers")


# --- A packed query group (GQA/MQA with few query rows) -----------------------------------

PACKED_PROBLEMS = [  # few query rows; the group fills an item's rows (packs_query_group)
    Case("bf16-packed-causal-bottomright-lengths-segments-sinks", q_len=40, kv_len=300,
         q_heads=8, kv_heads=2, dtype="bfloat16", causal="bottom_right", lengths=True,
         segments=True, sinks=True, seed=90),
    Case("fp16-packed-mqa-window-softcap-d128", q_len=24, kv_len=200, q_heads=4, kv_heads=1,
         head_dim=128, dtype="float16", window=(30, 5), soft_cap=5.0, seed=91),
]


def _packings(monkeypatch):
    """The rows per query position of every packed forward call from now on (a list)."""
    import importlib
    kernel = importlib.import_module("jax_impl.mosaic_gpu.forward")  # the module, not the function
    seen, packed = [], kernel._packed

    def spy(*args):
        result = packed(*args)
        seen.append(result[-1].group_rows)
        return result
    monkeypatch.setattr(kernel, "_packed", spy)
    return seen


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("problem", PACKED_PROBLEMS, ids=lambda p: p.name)
def test_a_packed_query_group_matches_the_float64_oracle(monkeypatch, problem, interpret):
    """Each kv head's query heads in one item's rows (row r: query r // G of head r % G): the
    band, the lengths and the segment ids read each row's query position, the sinks each row's
    head. The default (None) packs these calls; the backward is the unpacked one's
    (interpreted, pallas_triton's, from the same RowStats)."""
    seen = _packings(monkeypatch)
    results = run(problem, DTYPES[problem.dtype], "mosaic_gpu", interpret=interpret)
    assert seen and set(seen) == {problem.q_heads // problem.kv_heads}
    assert_judged_correct(results, oracle(problem), baseline(problem), problem.dtype)


@needs_mosaic
def test_a_packed_forward_computes_what_the_unpacked_one_does():
    """Packed (forced) and unpacked, each row sees the same key tiles in the same order: out
    agrees to a bf16 rounding of out or of P (P is rounded to bf16 before P V, so a float32 p a
    rounding apart moves out by p's ulp times |v|: at most 2^-9 here) and the RowStats to
    float32 rounding (measured: 26 of 230,400 outputs apart, by at most 0.00098; a log-sum 1
    ulp apart), on a call the rule alone would not pack (Lq=300)."""
    rng = np.random.default_rng(92)
    b, lq, lk, hq, hkv, d = 2, 300, 260, 6, 2, 64
    q, k, v = (jnp.asarray(rng.standard_normal((b, n, h, d)), jnp.bfloat16)
               for n, h in ((lq, hq), (lk, hkv), (lk, hkv)))
    sinks = jnp.asarray(rng.standard_normal((b, hq)), jnp.float32)
    masks = masking.MaskInputs(jnp.asarray([lq, 170], jnp.int32), jnp.asarray([lk, 90], jnp.int32),
                               None, None, None)
    spec = masking.MaskSpec(is_causal=True, bottom_right=True, has_q_lengths=True,
                            has_kv_lengths=True)
    results = []
    for pack in (False, True):
        cfg = AttentionConfig(scale=d ** -0.5, mask=spec, interpret=True,
                              block_sizes=Config(pack_query_group=pack))
        assert packs_query_group(cfg.block_sizes, lq, hq // hkv) is pack
        results.append(mosaic_gpu.forward(cfg, q, k, v, None, masks,
                                          dropout_sinks.SinksAndDropout(sinks=sinks)))
    (out, stats), (packed_out, packed_stats) = results
    np.testing.assert_allclose(np.asarray(packed_out, np.float32), np.asarray(out, np.float32),
                               rtol=2 ** -7, atol=2 ** -9)
    for x, y in zip(packed_stats, stats):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


# --- Dropout (the forward's here; the backward's with the backward below) -------------------

DROPOUT_PROBLEMS = [  # the oracle applies inputs.dropout_keep(): dropout_sinks' hash, materialised
    Case("bf16-dropout-causal-gqa-lengths", q_len=200, kv_len=170, q_heads=4, kv_heads=2,
         dtype="bfloat16", causal="bottom_right", lengths=True, dropout=0.3, seed=70),
    Case("fp16-dropout-d128-window", q_len=150, kv_len=190, q_heads=2, kv_heads=1, head_dim=128,
         dtype="float16", window=(60, 10), dropout=0.2, seed=71),
]


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("problem", DROPOUT_PROBLEMS, ids=lambda p: p.name)
def test_dropout_matches_the_float64_oracle_with_the_same_mask(problem, interpret):
    """The forward hashes the keep mask in the kernel; its gradients come from pallas_triton's
    backward when interpreted (the Mosaic one compiled: test_dropout_gradients_... below),
    which draws the same mask: both must meet the oracle's materialised mask."""
    results = run(problem, DTYPES[problem.dtype], "mosaic_gpu", interpret=interpret)
    assert_judged_correct(results, oracle(problem), baseline(problem), problem.dtype)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dropout_output_equals_the_xla_paths(head_dim, interpret):
    """Causal, GQA, lengths: the same rng gives xla's output (bf16 rounding apart), and not the
    output without dropout."""
    rng = np.random.default_rng(72 + head_dim)
    b, lq, lk, hq, hkv = 2, 140, 150, 4, 2
    q = jnp.asarray(rng.standard_normal((b, lq, hq, head_dim)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, lk, hkv, head_dim)), jnp.bfloat16) for _ in range(2))
    options = dict(dropout_rng=jax.random.key(5), dropout_rate=0.4, broadcast_dropout=False,
                   deterministic=False, is_causal=True, query_seq_lengths=jnp.array([140, 90]),
                   key_value_seq_lengths=jnp.array([150, 120]))
    got = flash_attention(q, k, v, implementation="mosaic_gpu", interpret=interpret, **options)
    want = flash_attention(q, k, v, implementation="xla", **options)
    undropped = flash_attention(q, k, v, implementation="xla", **{**options, "dropout_rate": 0.0})
    f32 = lambda x: np.asarray(x.astype(jnp.float32))
    np.testing.assert_allclose(f32(got), f32(want), atol=2e-2, rtol=2e-2)
    assert np.abs(f32(undropped) - f32(want)).max() > 0.5


def _revealing_inputs(rng, b, lq, lk, h, d):
    """V = the identity (key j's value is e_j, lk <= d): out[i, j] = P'[i, j], nonzero exactly
    where pair (i, j) is allowed and kept. q, k small and random: every allowed P > 0."""
    q = jnp.asarray(0.3 * rng.standard_normal((b, lq, h, d)), jnp.bfloat16)
    k = jnp.asarray(0.3 * rng.standard_normal((b, lk, h, d)), jnp.bfloat16)
    v = jnp.asarray(np.broadcast_to(np.eye(lk, d)[None, :, None, :], (b, lk, h, d)), jnp.bfloat16)
    return q, k, v


@pytest.mark.parametrize("interpret", INTERPRET)
def test_dropout_keeps_exactly_the_pairs_of_dropout_mask(interpret):
    """The kept pattern itself, pair by pair, against jax_impl.dropout_mask (the mask every
    implementation draws): rate 0.5, V = identity rows so that out shows each kept pair."""
    rng = np.random.default_rng(74)
    b, lq, lk, h, d = 2, 130, 64, 2, 64
    q, k, v = _revealing_inputs(rng, b, lq, lk, h, d)
    key, rate = jax.random.key(9), 0.5
    out = flash_attention(q, k, v, implementation="mosaic_gpu", interpret=interpret, is_causal=True,
                          dropout_rng=key, dropout_rate=rate, broadcast_dropout=False)
    shown = np.asarray(out.astype(jnp.float32)).transpose(0, 2, 1, 3)[..., :lk] != 0
    keep = np.asarray(dropout_sinks.dropout_mask(key, (b, h, lq, lk), rate, broadcast_dropout=False))
    allowed = np.tril(np.ones((lq, lk), bool))
    np.testing.assert_array_equal(shown, keep & allowed)
    assert 0.4 < keep[:, :, allowed].mean() < 0.6


@pytest.mark.parametrize("interpret", INTERPRET)
def test_dropout_offset_draws_the_global_pattern_of_a_ring_step(interpret):
    """The ring passes dropout_offset = the global (query, key) index of local (0, 0): the
    kernel's kept pairs are the global mask's slice there (broadcast seeds: one [1, 1] seed)."""
    rng = np.random.default_rng(75)
    b, lq, lk, h, d = 1, 70, 64, 2, 64
    q, k, v = _revealing_inputs(rng, b, lq, lk, h, d)
    key, rate, start = jax.random.key(12), 0.5, (300, 130)
    seeds = dropout_sinks.head_seeds(dropout_sinks.key_words(key), b, h, broadcast=True)
    cfg = AttentionConfig(scale=d ** -0.5, mask=masking.MaskSpec(), dropout_rate=rate,
                          interpret=interpret)
    masks = masking.MaskInputs(jnp.full((b,), lq, jnp.int32), jnp.full((b,), lk, jnp.int32),
                               None, None, None)
    extras = dropout_sinks.SinksAndDropout(dropout_seeds=seeds,
                                           dropout_offset=jnp.asarray(start, jnp.int32))
    out, _ = mosaic_gpu.forward(cfg, q, k, v, None, masks, extras)
    shown = np.asarray(out.astype(jnp.float32)).transpose(0, 2, 1, 3)[..., :lk] != 0
    keep = np.asarray(dropout_sinks.dropout_mask(key, (b, h, start[0] + lq, start[1] + lk), rate))
    np.testing.assert_array_equal(shown, keep[:, :, start[0]:, start[1]:])


def test_dropout_calls_keep_the_mosaic_backward_compiled(monkeypatch):
    """Its backward kernels take dropout: compiled, a dropout call is differentiated by them.
    Both backward routes hash at the ring's offset (pallas_triton's too), so the ring takes
    dropout on mosaic_gpu."""
    called = []
    monkeypatch.setattr(mosaic_gpu, "backward", lambda *a, **k: called.append("mosaic_gpu"))
    monkeypatch.setattr(pallas_triton, "backward", lambda *a, **k: called.append("pallas_triton"))
    masks = masking.MaskInputs(None, None, None, None, None)
    cfg = AttentionConfig(scale=1.0, mask=masking.MaskSpec(), dropout_rate=0.1)
    implementations.get("mosaic_gpu").backward(cfg, jnp.zeros((1, 64, 1, 128)), None, None, None,
                                               masks, None, None, None)
    assert mosaic_gpu.backward_unsupported(cfg) is None and called == ["mosaic_gpu"]
    assert implementations.get("mosaic_gpu").takes_dropout_offset
    assert implementations.get("pallas_triton").takes_dropout_offset


def test_dropout_at_head_dim_128_takes_64_key_tiles():
    """The compiled report's choice (0 spills; 64 x 128 spills in the masked tiles)."""
    from jax_impl.mosaic_gpu.config import DROPOUT_D128
    assert default_config(128, jnp.bfloat16, dropout=True) == DROPOUT_D128 == Config(64, 64, 2)
    assert default_config(64, jnp.bfloat16, dropout=True) == default_config(64, jnp.bfloat16)


# --- A bias and a dense mask (a differentiated bias: pallas_triton's backward) --------------

PAIRWISE_PROBLEMS = [  # lengths that are no multiple of a tile
    Case("bf16-bias-shared-batch-gqa-edges", q_len=150, kv_len=130, q_heads=4, kv_heads=2,
         dtype="bfloat16", bias=True, bias_shape="shared_batch", seed=80),
    Case("fp16-mask-heads-empty-rows-d128", q_len=100, kv_len=140, q_heads=2, kv_heads=1,
         head_dim=128, dtype="float16", mask="bool_heads", empty_rows=True, seed=81),
    Case("bf16-bias-mask-causal-bottomright-lengths-gqa", q_len=140, kv_len=200, q_heads=2,
         kv_heads=1, dtype="bfloat16", bias=True, mask="bool", causal="bottom_right",
         lengths=True, seed=82),
]


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("problem", PAIRWISE_PROBLEMS, ids=lambda p: p.name)
def test_bias_and_mask_match_the_float64_oracle(problem, interpret):
    """The bias and mask tiles come through the ring with K (TMA; past Lq and Lk it reads
    zeros, which the length rule masks). The gradients: a differentiated bias's (dbias too) are
    pallas_triton's backward from the Mosaic forward's RowStats; interpreted, every call's."""
    results = run(problem, DTYPES[problem.dtype], "mosaic_gpu", interpret=interpret)
    assert_judged_correct(results, oracle(problem), baseline(problem), problem.dtype)


@pytest.mark.parametrize("interpret", INTERPRET)
def test_bias_and_mask_row_stats_are_the_references(interpret):
    """RowStats against jax_impl.reference's logsumexp with a float32 bias [1, Hq] and a mask
    [B, 1] over a bottom-right causal window, Lq and Lk no multiple of a tile (Lk = 131 makes
    the bias's rows no multiple of 16 bytes: it is padded): a row that the mask leaves empty,
    one that a -inf bias leaves empty and those before the band all have max = +inf,
    log_sum = 0 and output 0."""
    rng = np.random.default_rng(83)
    b, lq, lk, hq, hkv, d = 2, 150, 131, 2, 1, 64
    q = jnp.asarray(rng.standard_normal((b, lq, hq, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, lk, hkv, d)), jnp.bfloat16) for _ in range(2))
    bias = 2 * rng.standard_normal((1, hq, lq, lk)).astype(np.float32)
    bias[0, 1, 70] = -np.inf
    bias[0, 0, 71, ::3] = -np.inf  # some pairs excluded
    mask = rng.random((b, 1, lq, lk)) < 0.8
    mask[1, :, 100] = False
    spec = masking.MaskSpec(is_causal=True, bottom_right=True, window_left=100)
    masks = masking.MaskInputs(jnp.full((b,), lq, jnp.int32), jnp.full((b,), lk, jnp.int32),
                               None, None, jnp.asarray(mask))
    cfg = AttentionConfig(scale=d ** -0.5, mask=spec, interpret=interpret)
    out, stats = mosaic_gpu.forward(cfg, q, k, v, jnp.asarray(bias), masks)
    want_out, want_lse = reference.attention(q, k, v, jnp.asarray(bias), masks,
                                             dataclasses.replace(cfg, interpret=False))
    want_lse = np.asarray(want_lse)
    empty = want_lse == -np.inf
    assert empty[1, :, 100].all() and empty[:, 1, 70].all() and not empty[:, 0, 70].any()
    np.testing.assert_array_equal(np.asarray(stats.max)[empty], np.inf)
    np.testing.assert_array_equal(np.asarray(stats.log_sum)[empty], 0.0)
    got_out = np.asarray(out.astype(jnp.float32))
    np.testing.assert_array_equal(got_out.transpose(0, 2, 1, 3)[empty], 0.0)
    np.testing.assert_allclose(np.asarray(online_softmax.logsumexp(stats))[~empty],
                               want_lse[~empty], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_out, np.asarray(want_out.astype(jnp.float32)), atol=2e-2)


def test_the_mosaic_backward_takes_a_bias_and_a_mask_but_dbias_with_the_fused_dq(monkeypatch):
    """Whatever the Config chose: the Mosaic backward takes a bias, differentiated or not, and a
    dense mask; only a differentiated bias with BackwardConfig(dq="fused") takes pallas_triton's
    backward (dbias is written by the dQ kernel, which the fused dQ does without), and a
    direct call refuses it. The forward by name takes every such call
    (explain_implementation)."""
    called = []
    monkeypatch.setattr(mosaic_gpu, "backward", lambda *a, **k: called.append("mosaic_gpu"))
    monkeypatch.setattr(pallas_triton, "backward", lambda *a, **k: called.append("pallas_triton"))
    pairwise = jnp.zeros((1, 1, 64, 64))
    fused = Config(64, 64, 2, backward="mosaic_gpu", backward_config=BackwardConfig(dq="fused"))
    separate = Config(64, 64, 2, backward="mosaic_gpu")
    calls = [(pairwise, None, True, separate, "mosaic_gpu"),
             (pairwise, pairwise > 0, True, separate, "mosaic_gpu"),
             (pairwise, None, False, separate, "mosaic_gpu"),
             (None, pairwise > 0, True, separate, "mosaic_gpu"),
             (pairwise, None, True, fused, "pallas_triton"),
             (pairwise, pairwise > 0, False, fused, "mosaic_gpu"),
             (None, None, True, fused, "mosaic_gpu")]
    q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    for bias, mask, gradient, config, expected in calls:
        masks = masking.MaskInputs(None, None, None, None, mask)
        cfg = AttentionConfig(scale=1.0, mask=masking.MaskSpec(), bias_gradient=gradient,
                              block_sizes=config)
        implementations.get("mosaic_gpu").backward(cfg, q, None, None, bias, masks, None,
                                                   None, None)
        reason = mosaic_gpu.backward_unsupported(cfg, has_bias=bias is not None)
        assert (reason is None) == (expected == "mosaic_gpu"), reason
        assert (expected == "pallas_triton") == ("dbias" in (reason or "")), reason
    assert called == [expected for *_, expected in calls]
    monkeypatch.setattr(mosaic_gpu, "_UNAVAILABLE", None)  # judged as on jax >= 0.11
    choice = explain_implementation(q, q, q, pairwise, pairwise > 0, implementation="mosaic_gpu",
                                    platform="cuda")
    assert choice.chosen == "mosaic_gpu", choice


@needs_mosaic
def test_the_mosaic_backward_refuses_dbias_with_the_fused_dq_called_directly():
    q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    masks = masking.MaskInputs(jnp.array([64], jnp.int32), jnp.array([64], jnp.int32), None,
                               None, None)
    cfg = AttentionConfig(scale=1.0, mask=masking.MaskSpec(), block_sizes=Config(
        64, 64, 2, backward_config=BackwardConfig(dq="fused")))
    with pytest.raises(ValueError, match="cannot run this backward: a differentiated bias"):
        mosaic_gpu.backward(cfg, q, q, q, jnp.zeros((1, 1, 64, 64)), masks, None, q, None)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_dropout_beside_a_bias_a_mask_or_segment_ids_keeps_the_mosaic_backward(monkeypatch,
                                                                               head_dim):
    """Every combination of dropout with a bias, a mask and segment ids is differentiated by
    the Mosaic GPU kernels at D=64 and D=128 (before, a bias or mask with dropout at D=128
    took pallas_triton's: its dK/dV spilled 4-96 bytes; their spills now are named in
    docs/limitations.md and held by the compile report's tests)."""
    called = []
    monkeypatch.setattr(mosaic_gpu, "backward", lambda *a, **k: called.append("mosaic_gpu"))
    monkeypatch.setattr(pallas_triton, "backward", lambda *a, **k: called.append("pallas_triton"))
    q = jnp.zeros((1, 64, 1, head_dim), jnp.bfloat16)
    pairwise = jnp.zeros((1, 1, 64, 64))
    ids = jnp.zeros((1, 64), jnp.int32)
    calls = [(bias, mask, segments, gradient) for bias in (None, pairwise)
             for mask in (None, pairwise > 0) for segments in (None, ids)
             for gradient in (False, True)]
    for bias, mask, segments, gradient in calls:
        cfg = AttentionConfig(scale=1.0, mask=masking.MaskSpec(), bias_gradient=gradient,
                              dropout_rate=0.1, block_sizes=Config(64, 64, 2))
        masks = masking.MaskInputs(None, None, segments, segments, mask)
        implementations.get("mosaic_gpu").backward(cfg, q, None, None, bias, masks, None,
                                                   None, None)
        assert mosaic_gpu.backward_unsupported(cfg, has_bias=bias is not None) is None
    assert called == ["mosaic_gpu"] * len(calls)


def test_the_backward_counts_the_bias_and_mask_rings_in_its_shared_memory(monkeypatch):
    """The default backward tiles (64 x 64 x 2) hold a float32 bias and a mask ring beside
    everything else at head_dim 128; the fused dQ's does not, and a forward Config choosing it
    is refused naming backward_config, before any compile."""
    default, fused = BackwardConfig(), BackwardConfig(dq="fused")
    for pairwise_bytes in (1, 2, 3, 4, 5):
        assert default.shared_memory_bytes(128, jnp.bfloat16, True, pairwise_bytes) <= 227 * 1024
        # one ring of CONSUMERS * 64 x 64 pairs per stage, by their bytes per pair
        assert (default.shared_memory_bytes(128, jnp.bfloat16, False, pairwise_bytes)
                - default.shared_memory_bytes(128, jnp.bfloat16)) >= 2 * 2 * 64 * 64 * pairwise_bytes
    assert fused.shared_memory_bytes(128, jnp.bfloat16, False, 5) > 227 * 1024
    monkeypatch.setattr(mosaic_gpu, "_UNAVAILABLE", None)  # judged as on jax >= 0.11
    cfg = AttentionConfig(scale=1.0, mask=masking.MaskSpec(),
                          block_sizes=Config(64, 64, 2, backward_config=fused))
    reason = mosaic_gpu.unsupported(CallFeatures(cfg, 128, dtype=jnp.bfloat16, has_bias=True,
                                                 has_mask=True))
    assert reason and reason.startswith("backward_config=") and "a bias and a mask" in reason
    assert mosaic_gpu.unsupported(CallFeatures(cfg, 128, dtype=jnp.bfloat16)) is None


def test_a_bias_or_mask_takes_the_tiles_the_compile_report_found_clean():
    """The compile report's choice ("bias_mask" rows): at head_dim 64 the default 128 x 64 x 2
    where the ring fits and no dropout is asked (0 spills; with dropout they spill), else
    64 x 64 x 2; at head_dim 128 always 64 x 64 x 2 (a mask spills on 64 x 128 and a 16-bit
    bias does not fit beside it). Whatever is chosen fits the shared memory."""
    from jax_impl.mosaic_gpu.config import PAIRWISE
    assert PAIRWISE == Config(64, 64, 2)
    for head_dim in (64, 128):
        for dropout in (False, True):
            for pairwise_bytes in (1, 2, 3, 4, 5):  # mask, bf16 bias, both, f32 bias, both
                chosen = default_config(head_dim, jnp.bfloat16, dropout=dropout,
                                        pairwise_bytes=pairwise_bytes)
                roomy = head_dim == 64 and not dropout and pairwise_bytes < 5
                assert chosen == (default_config(64, jnp.bfloat16) if roomy else PAIRWISE), (
                    head_dim, dropout, pairwise_bytes)
                assert chosen.shared_memory_bytes(head_dim, jnp.bfloat16,
                                                  pairwise_bytes) <= 227 * 1024


# --- The backward (backward.py) --------------------------------------------------------------

@pytest.mark.parametrize("choice, interpret, expected", [
    (None, False, "mosaic_gpu"), (Config(), False, "mosaic_gpu"),
    (Config(backward="pallas_triton"), False, "pallas_triton"),
    (None, True, "pallas_triton"), (Config(backward="mosaic_gpu"), True, "mosaic_gpu")])
def test_the_backward_is_its_own_unless_the_config_chooses_pallas_triton(monkeypatch, choice,
                                                                          interpret, expected):
    called = []
    monkeypatch.setattr(mosaic_gpu, "backward", lambda *a, **k: called.append("mosaic_gpu"))
    monkeypatch.setattr(pallas_triton, "backward", lambda *a, **k: called.append("pallas_triton"))
    cfg = AttentionConfig(scale=1.0, mask=masking.MaskSpec(), block_sizes=choice,
                          interpret=interpret)
    masks = masking.MaskInputs(None, None, None, None, None)
    q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    implementations.get("mosaic_gpu").backward(cfg, q, None, None, None, masks, *[None] * 3)
    assert called == [expected]
    reason = mosaic_gpu.backward_unsupported(cfg)
    assert (reason is None) == (expected == "mosaic_gpu")
    with pytest.raises(ValueError, match="backward='cuda'"):
        Config(backward="cuda")


@needs_mosaic
@pytest.mark.parametrize("spec", [
    masking.MaskSpec(is_causal=True), masking.MaskSpec(is_causal=True, bottom_right=True),
    masking.MaskSpec(window_left=30, window_right=20, has_q_lengths=True, has_kv_lengths=True),
    masking.MaskSpec(is_causal=True, window_left=50, has_q_lengths=True, has_kv_lengths=True)],
    ids=["causal", "causal-bottom-right", "window-lengths", "causal-window-lengths"])
def test_backward_walks_keep_the_ring_in_step(spec):
    """What makes a warp-specialised kernel hang on a GPU: a compute warpgroup waiting for a
    different number of ring slots than the memory warpgroup fills in an item. Per item, each
    warpgroup's five stretches (``TileWalk.stretches`` of its own split) must cover exactly the
    range that the memory warpgroup streams (``TileWalk.streamed`` of the CTA's range), and its
    own edge and interior tiles must lie inside that range (else clamping would drop them). Over Lq/Lk around the tiles (150/200: the case once seen hanging in the
    interpreter), short lengths and position offsets, for dK/dV's key tiles and dQ's query
    tiles."""
    from jax_impl.mosaic_gpu.tile_walk import TileWalk, band_bounds
    tile, cta = 64, 128  # BackwardConfig's tiles, two compute warpgroups
    for lq, lk, q_len, kv_len, offset in [(150, 200, 150, 200, None), (200, 150, 200, 150, None),
                                           (150, 200, 90, 31, None), (300, 64, 300, 64, 40),
                                           (64, 300, 1, 300, -70), (200, 200, 200, 130, 150)]:
        args = (jnp.int32(q_len), jnp.int32(kv_len), None if offset is None else jnp.int32(offset))
        for pairs, walk_range, walk_split, size in (
                (-(-lk // cta), masking.q_block_range, masking.q_block_split, lk),
                (-(-lq // cta), masking.kv_block_range, masking.kv_block_split, lq)):
            for pair in range(pairs):
                lo, hi = map(int, walk_range(spec, pair * cta, cta, tile, *args))
                start, stop, _ = TileWalk.of(None, (jnp.int32(lo), jnp.int32(hi)), 0, 0,
                                             pair).streamed()
                assert (int(start), int(stop)) == (lo, hi)
                for wg in range(2):
                    split = walk_split(spec, pair * cta + wg * tile, tile, tile, *args)
                    walk = TileWalk.of(None, band_bounds(jnp.int32(lo), jnp.int32(hi), split),
                                       0, 0, pair)
                    steps = sum(max(int(stop) - int(start), 0)
                                for start, stop, _, _ in walk.stretches())
                    assert steps == max(hi - lo, 0), (lq, lk, q_len, kv_len, offset, pair, wg)
                    own_lo, _, _, own_hi = map(int, split)
                    if own_hi > own_lo:
                        assert lo <= own_lo and own_hi <= hi, (lq, lk, pair, wg, split)


def _mosaic_backward_only(monkeypatch, interpret=False):
    """The gradients below must come from the Mosaic GPU kernels, not the Triton fallback.
    Interpreted, they run only with MOSAIC_BACKWARD_INTERPRET=1 (the hang: HANG)."""
    import os
    if interpret and os.environ.get("MOSAIC_BACKWARD_INTERPRET") != "1":
        pytest.skip(HANG + "; MOSAIC_BACKWARD_INTERPRET=1 runs it")

    def refuse(*args, **kwargs):
        raise AssertionError("pallas_triton's backward ran")
    monkeypatch.setattr(pallas_triton, "backward", refuse)


HANG = ("the interpreted Mosaic backward can hang on a 2-core machine: a warpgroup's "
        "computation starves in XLA's CPU runtime while the other two wait on barriers "
        "(the interpreter's threads, not the kernel's protocol: docs/limitations.md)")
MOSAIC_BACKWARD = Config(backward="mosaic_gpu")


# Beside PROBLEMS (which run this backward too when Config(backward="mosaic_gpu") asks for it).
BACKWARD_PROBLEMS = [
    Case("fp16-gqa-window-lengths-softcap", q_len=200, kv_len=140, q_heads=4, kv_heads=2,
         dtype="float16", window=(30, 20), lengths=True, soft_cap=5.0, seed=51),
]


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("problem", PROBLEMS + BACKWARD_PROBLEMS + SEGMENT_PROBLEMS
                         + PACKED_PROBLEMS, ids=lambda p: p.name)
def test_backward_kernels_match_the_float64_oracle(monkeypatch, problem, interpret):
    """PROBLEMS, SEGMENT_PROBLEMS and PACKED_PROBLEMS (the RowStats of a packed forward) too
    when interpreted: interpreted calls route to pallas_triton's backward by default, so only
    Config(backward="mosaic_gpu") differentiates them through these kernels (compiled, the
    forward's tests already do)."""
    if not interpret and problem in PROBLEMS + SEGMENT_PROBLEMS + PACKED_PROBLEMS:
        pytest.skip("compiled, the forward's oracle tests run it")
    _mosaic_backward_only(monkeypatch, interpret)
    results = run(problem, DTYPES[problem.dtype], "mosaic_gpu", interpret=interpret,
                  block_sizes=MOSAIC_BACKWARD)
    assert_judged_correct(results, oracle(problem), baseline(problem), problem.dtype)


PAIRWISE_BACKWARD = Config(64, 64, 2, backward="mosaic_gpu")  # the tiles such calls take


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("problem, constant", [
    *((p, False) for p in PAIRWISE_PROBLEMS), *((p, True) for p in PAIRWISE_PROBLEMS if p.bias)],
    ids=lambda x: x.name if isinstance(x, Case) else ("constant_bias" if x else "dbias"))
def test_a_bias_and_a_mask_in_the_backward_kernels_match_the_float64_oracle(
        monkeypatch, problem, constant, interpret):
    """The bias and the mask stream through both kernels' rings: dQ's tiles as given, dK/dV's
    transposed once by XLA; the mask excludes pairs (dS exactly 0 there, rows with no allowed
    key too). A differentiated bias: the dQ kernel writes dS per tile (dbias, summed over the
    bias's broadcast axes after). A constant one (symbolic zeros tell the backward): no dS."""
    _mosaic_backward_only(monkeypatch, interpret)
    results = run(problem, DTYPES[problem.dtype], "mosaic_gpu", interpret=interpret,
                  block_sizes=PAIRWISE_BACKWARD, constant_bias=constant)
    keep = lambda found: {n: x for n, x in found.items() if n != "dbias" or not constant}
    assert set(results) == set(keep(oracle(problem)))
    assert ("dbias" in results) == (not constant and problem.bias)
    assert_judged_correct(results, keep(oracle(problem)), keep(baseline(problem)),
                          problem.dtype)


# Dropout beside a tile that dK/dV streams with Q and dO: there P^T is dropped beside dP^T.
DROPOUT_STREAMED_PROBLEMS = [
    Case("bf16-dropout-bias-mask-causal-bottomright-lengths-gqa", q_len=140, kv_len=200,
         q_heads=2, kv_heads=1, dtype="bfloat16", bias=True, mask="bool",
         causal="bottom_right", lengths=True, dropout=0.2, seed=72),
    Case("fp16-dropout-segments-window-d128", q_len=150, kv_len=150, q_heads=2, kv_heads=2,
         head_dim=128, dtype="float16", window=(40, 9), segments=True, dropout=0.3, seed=73),
    # causal with one streamed tile that is not a mask: dK/dV drops P^T after dS^T
    Case("bf16-dropout-segments-causal-d128-gqa", q_len=150, kv_len=150, q_heads=2, kv_heads=1,
         head_dim=128, dtype="bfloat16", causal="top_left", segments=True, dropout=0.2, seed=74),
    Case("bf16-dropout-bias-causal", q_len=140, kv_len=140, q_heads=2, kv_heads=2,
         dtype="bfloat16", bias=True, causal="top_left", dropout=0.25, seed=75),
    # causal with a mask alone: dK/dV reads the tile positions at an opaque warpgroup's address
    Case("bf16-dropout-mask-causal-d128", q_len=140, kv_len=140, q_heads=2, kv_heads=2,
         head_dim=128, dtype="bfloat16", mask="bool", causal="top_left", dropout=0.2, seed=76),
]


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("problem", DROPOUT_PROBLEMS + DROPOUT_STREAMED_PROBLEMS,
                         ids=lambda p: p.name)
def test_dropout_gradients_of_the_backward_kernels_match_the_float64_oracle(monkeypatch, problem,
                                                                          interpret):
    """dV from the dropped P^T, dP (dQ's tiles) and dP^T (dK/dV's transposed tiles) dropped by
    the same hash, per query head of a GQA group: the oracle's materialised mask. Beside a
    bias and a mask (dbias too), segment ids, or causal with segment ids, a bias or a mask alone."""
    _mosaic_backward_only(monkeypatch, interpret)
    pairwise = problem.bias or problem.mask
    results = run(problem, DTYPES[problem.dtype], "mosaic_gpu", interpret=interpret,
                  block_sizes=PAIRWISE_BACKWARD if pairwise else MOSAIC_BACKWARD)
    assert_judged_correct(results, oracle(problem), baseline(problem), problem.dtype)


@pytest.mark.parametrize("interpret", INTERPRET)
def test_gradients_repeat_bit_for_bit(monkeypatch, interpret):
    """No atomics: dQ per query tile, dK/dV per key tile with the query group summed in order."""
    _mosaic_backward_only(monkeypatch, interpret)
    rng = np.random.default_rng(52)
    q, ct = (jnp.asarray(rng.standard_normal((2, 190, 4, 64)), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((2, 150, 4, 64)), jnp.bfloat16) for _ in range(2))

    def grads():
        _, vjp = jax.vjp(lambda q, k, v: flash_attention(
            q, k, v, implementation="mosaic_gpu", interpret=interpret, is_causal=True,
            block_sizes=MOSAIC_BACKWARD), q, k, v)
        return [np.asarray(x.astype(jnp.float32)) for x in vjp(ct)]

    first, second = grads(), grads()
    for a, b in zip(first, second):
        assert np.all(np.isfinite(a)) and np.abs(a).max() > 0
        np.testing.assert_array_equal(a, b)


FUSED_DQ = Config(backward="mosaic_gpu", backward_config=BackwardConfig(dq="fused"))


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("backward", [MOSAIC_BACKWARD, FUSED_DQ, "pairwise"],
                         ids=("separate", "fused_dq", "mask_and_constant_bias"))
def test_nonfinite_gradients_follow_the_rule_of_every_implementation(monkeypatch, interpret,
                                                                      backward):
    """A NaN in v and an inf in k at keys some rows may not attend, a NaN query row: the NaN
    pattern and the finite values of dq, dk, dv match the xla path's. Fused, K stays finite
    for dQ += dS K (the keys' poison enters S^T's rows): dQ rows that do not attend the
    poisoned keys stay finite. With a dense mask (and a constant bias), no band: the tiles of
    the NaN query row are interior ones, where only the mask's exclusions keep the row's NaN
    delta from the keys it does not attend (their dK and dV stay finite)."""
    _mosaic_backward_only(monkeypatch, interpret)
    rng = np.random.default_rng(53)
    b, l, h, d = 1, 150, 2, 64
    q, k, v, ct = (rng.standard_normal((b, l, h, d)).astype(np.float32) for _ in range(4))
    q[0, 20, 1, 0] = np.nan
    if backward == "pairwise":
        backward = PAIRWISE_BACKWARD
        options = dict(bias=jnp.asarray(rng.standard_normal((1, h, l, l)), jnp.float32),
                       mask=jnp.asarray(rng.random((b, 1, l, l)) < 0.8))
    else:
        v[0, 100, 0, 5] = np.nan
        k[0, 140, 1, 3] = np.inf
        options = dict(is_causal=True, local_window_size=(60, None))
    q, k, v, ct = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, ct))

    def grads(**kwargs):
        _, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, **options, **kwargs), q, k, v)
        return [np.asarray(x.astype(jnp.float32)) for x in vjp(ct)]

    got = grads(implementation="mosaic_gpu", interpret=interpret, block_sizes=backward)
    want = grads(implementation="xla")
    for name, x, y in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_array_equal(np.isnan(x), np.isnan(y), err_msg=name)
        assert np.isnan(y).any() and not np.isnan(y).all(), name
        finite = ~np.isnan(y)
        np.testing.assert_allclose(x[finite], y[finite], atol=3e-2, err_msg=name)


# --- The fused dQ (BackwardConfig(dq="fused"): dS K added in the dK/dV kernel) -------------

# GQA with window, lengths and soft cap; segment ids with causal (bottom-right), lengths and
# GQA; dropout at head_dim 128 with a window and GQA.
FUSED_DQ_PROBLEMS = [BACKWARD_PROBLEMS[0], SEGMENT_PROBLEMS[0], DROPOUT_PROBLEMS[1]]


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("problem", FUSED_DQ_PROBLEMS, ids=lambda p: p.name)
def test_fused_dq_gradients_match_the_float64_oracle(monkeypatch, problem, interpret):
    """dQ from the dK/dV kernel alone (the dQ kernel must not run): each group member's dS K
    into its own query head's rows, fp32 sums over the key tiles, scaled once after."""
    import importlib
    backward = importlib.import_module("jax_impl.mosaic_gpu.backward")  # the package's
    # attribute of that name is its backward function
    _mosaic_backward_only(monkeypatch, interpret)

    def refuse(*args, **kwargs):
        raise AssertionError("the dQ kernel ran")
    monkeypatch.setattr(backward, "_dq_consumer", refuse)
    results = run(problem, DTYPES[problem.dtype], "mosaic_gpu", interpret=interpret,
                  block_sizes=FUSED_DQ)
    assert_judged_correct(results, oracle(problem), baseline(problem), problem.dtype)


# --- Tile lists, score_mod and mask_mod (forward and backward) -----------------------------
# The kernels walk the lists of non-empty tiles that segment ids or a block_mask leave (full
# tiles without the per-pair mask) and trace score_mod / mask_mod on the WGMMA fragment's
# global indices; judged against torch_ref in float64 with the same rules written as a dense
# mask or bias here. The gradients: the Mosaic backward's (interpreted only with
# MOSAIC_BACKWARD_INTERPRET=1: HANG).

# GQA: dK/dV sums the group's heads, each with its own slope.
MODS_BATCH, MODS_HQ, MODS_HKV, MODS_D = 1, 2, 1, 64
MODS_TILES = Config(64, 64, 2)  # CTAs of 128 query rows, key tiles of 64


def _inputs(seed, length):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((MODS_BATCH, length, MODS_HQ, MODS_D))
    k, v = (rng.standard_normal((MODS_BATCH, length, MODS_HKV, MODS_D)) for _ in range(2))
    cotangent = rng.standard_normal((MODS_BATCH, length, MODS_HQ, MODS_D))
    return tuple(x.astype(np.float16) for x in (q, k, v, cotangent))


def _mosaic(q, k, v, cotangent, interpret, gradients: bool, **kwargs):
    """Out (and dq, dk, dv, and d mod_aux[-1] with ``gradients``: the Mosaic backward's) as
    float64 numpy."""
    if gradients and interpret:
        import os
        if os.environ.get("MOSAIC_BACKWARD_INTERPRET") != "1":
            pytest.skip(HANG + "; MOSAIC_BACKWARD_INTERPRET=1 runs it")
    mod_aux = tuple(kwargs.pop("mod_aux", ()))
    config = Config(64, 64, 2, backward="mosaic_gpu") if gradients else MODS_TILES

    def attend(q, k, v, mod_aux):
        return flash_attention(q, k, v, implementation="mosaic_gpu", interpret=interpret,
                               block_sizes=config, mod_aux=mod_aux, **kwargs)

    q, k, v, cotangent = map(jnp.asarray, (q, k, v, cotangent))
    if not gradients:
        return {"out": np.asarray(attend(q, k, v, mod_aux), np.float64)}
    out, vjp = jax.vjp(attend, q, k, v, mod_aux)
    dq, dk, dv, d_mod_aux = vjp(cotangent)
    found = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    if mod_aux:
        found["d_aux"] = d_mod_aux[-1]
    return {name: np.asarray(x, np.float64) for name, x in found.items()}


def _judge(got, oracle):
    """Each result within 1% of the largest oracle magnitude (float16 inputs, float32 sums)."""
    for name, x in got.items():
        want = oracle[name]
        assert np.all(np.isfinite(x)), name
        error = np.max(np.abs(x - want))
        assert error <= 1e-2 * max(1.0, np.max(np.abs(want))), (name, error)


def _positions(length):
    i = np.arange(length)
    return i[:, None], i[None, :]  # query rows, key columns


# A block_mask of 128 x 128 tiles (every kernel's tiles nest in them: regridded exactly) whose
# classes are chosen here, not derived from the mask_mod: a full tile admits every pair
# whatever the mask_mod says there (FlexAttention's rule), an empty one none; the mask_mod
# decides on the partial ones.
LENGTH, BLOCK = 256, 128
CLASSES = np.array([[2, 0],
                    [1, 1]], np.int8)


def _stripes(b, h, q_idx, kv_idx, period, slopes):
    """A pattern no tile holds whole: keys (q_idx + kv_idx) % period != 0."""
    return (q_idx + kv_idx) % period[b] != 0


def _alibi(score, b, h, q_idx, kv_idx, period, slopes):
    return score + slopes[h] * (kv_idx - q_idx).astype(jnp.float32)


def _block_mask_case():
    period = np.array([3], np.int32)
    slopes = np.array([0.05, 0.2], np.float32)
    classes = jnp.asarray(CLASSES[None, None])
    mask = block_mask_lib.BlockMask.from_tile_classes(classes, LENGTH, LENGTH, BLOCK, BLOCK)
    rows, cols = _positions(LENGTH)
    tile_class = CLASSES[rows // BLOCK, cols // BLOCK]
    dense = (tile_class == 2) | ((tile_class == 1) & ((rows + cols) % period[0] != 0))
    bias = slopes[None, :, None, None] * (cols - rows)
    kwargs = dict(block_mask=mask, mask_mod=_stripes, score_mod=_alibi,
                  mod_aux=(jnp.asarray(period), jnp.asarray(slopes)))
    return kwargs, dense, bias


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("gradients", [False, True], ids=["forward", "gradients"])
def test_a_block_mask_with_mask_mod_and_alibi_score_mod_match_the_oracle(interpret, gradients):
    """Partial tiles take the mask_mod (its period read from mod_aux by the batch index), full
    tiles take every pair, empty ones none; ALiBi's slopes are read from mod_aux by the global
    query head (GQA: the dK/dV kernel's group members). (The slopes' gradient is the xla
    backward's, whose coarser tiles regrid this block_mask conservatively: the mask_mod decides
    there inside the chosen full and empty tiles too. The next test judges it.)"""
    q, k, v, cotangent = _inputs(0, LENGTH)
    kwargs, dense, bias = _block_mask_case()
    got = _mosaic(q, k, v, cotangent, interpret, gradients, **kwargs)
    got.pop("d_aux", None)
    _judge(got, torch_arrays(q, k, v, cotangent, mask=dense[None, None], bias=bias))


def _soft_cap_and_alibi(score, b, h, q_idx, kv_idx, slopes):
    return 4.0 * jnp.tanh(score / 4.0) + slopes[h] * (kv_idx - q_idx).astype(jnp.float32)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("gradients", [False, True], ids=["forward", "gradients"])
def test_packed_documents_with_soft_cap_and_alibi_score_mod_and_causal_mask_mod_match_the_oracle(
        interpret, gradients):
    """Segment ids (packed documents: tiles between documents are empty and skipped, tiles
    inside one are full) with a mask_mod (causal) evaluated on every partial tile and a
    score_mod (a soft cap, its derivative reaching dq and dk, plus ALiBi: the slopes' gradient
    is the oracle's dbias weighted by the distance)."""
    length = 192
    q, k, v, cotangent = _inputs(1, length)
    ids = np.repeat(np.array([[0, 1, 2]], np.int32), [70, 90, 32], axis=1)
    slopes = np.array([0.05, 0.2], np.float32)
    got = _mosaic(q, k, v, cotangent, interpret, gradients, q_segment_ids=jnp.asarray(ids),
                  kv_segment_ids=jnp.asarray(ids), mod_aux=(jnp.asarray(slopes),),
                  mask_mod=lambda b, h, q_idx, kv_idx, slopes: kv_idx <= q_idx,
                  score_mod=_soft_cap_and_alibi)
    rows, cols = _positions(length)
    bias = slopes[None, :, None, None] * (cols - rows)
    oracle = torch_arrays(q, k, v, cotangent, is_causal=True, q_segment_ids=ids,
                          kv_segment_ids=ids, logits_soft_cap=4.0, bias=bias)
    oracle["d_aux"] = np.sum(oracle["dbias"] * (cols - rows), axis=(0, 2, 3))
    _judge(got, oracle)


def _recorded_kernel_operands(monkeypatch):
    """Replaces plgpu.kernel by one that records its operands and returns zeros."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    calls = []

    def kernel(entry, out_type, **_):
        def call(*operands):
            calls.append(operands)
            return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), out_type)
        return call

    monkeypatch.setattr(plgpu, "kernel", kernel)
    return calls


def _given(lists):
    """The tiles listed per (query head, tile) of batch row 0: partial and full ones."""
    counts, _, full_counts, _ = (np.asarray(x) for x in lists)
    return np.broadcast_to((counts + full_counts)[0], (MODS_HQ, counts.shape[-1]))


def _walked(lists, tile: int):
    """The tiles a producer walks per query head of its tile ``tile`` (its one loop)."""
    from jax_impl.mosaic_gpu.tile_walk import TileWalk
    return [int(TileWalk.of(lists, None, 0, h, tile).streamed()[1]) for h in range(MODS_HQ)]


@needs_mosaic
def test_only_the_non_empty_tiles_are_given_to_the_kernels(monkeypatch):
    """Packed documents with causal: the tile counts the forward, dK/dV and dQ kernels are given
    (their producers' loop counts) are those of the tiles holding an allowed pair, fewer than
    the band's (the tiles below the diagonal between documents are empty)."""
    from jax_impl.mosaic_gpu.backward import backward_call
    from jax_impl.mosaic_gpu.forward import Geometry, forward_call
    length = 512
    ids = np.repeat(np.array([[0, 1, 2, 3]], np.int32), [100, 160, 130, 122], axis=1)
    rows, cols = _positions(length)
    allowed = (ids[0][:, None] == ids[0][None, :]) & (cols <= rows)
    non_empty = lambda bq, bk: allowed.reshape(length // bq, bq, length // bk, bk).any((1, 3))
    band = lambda bq, bk: (cols <= rows).reshape(length // bq, bq, length // bk, bk).any((1, 3))
    calls = _recorded_kernel_operands(monkeypatch)
    cfg = AttentionConfig(scale=MODS_D ** -0.5, mask=masking.MaskSpec(is_causal=True))
    q = jnp.ones((MODS_BATCH, length, MODS_HQ, MODS_D), jnp.float16)
    k = jnp.ones((MODS_BATCH, length, MODS_HKV, MODS_D), jnp.float16)
    lengths = jnp.full((MODS_BATCH,), length, jnp.int32)
    seg = jnp.asarray(ids)
    geometry = Geometry(MODS_BATCH, length, length, MODS_HQ, MODS_HKV, MODS_D,
                        jnp.dtype(jnp.float16), MODS_TILES)
    forward_call(cfg, geometry, q, k, k, lengths, lengths, q_segment_ids=seg, kv_segment_ids=seg)
    stats = jnp.zeros((MODS_BATCH, MODS_HQ, length), jnp.float32)
    backward_call(cfg, BackwardConfig(64, 64, 2), q, k, k, q,
                  online_softmax.RowStats(stats, stats), stats,
                  lengths, lengths, q_segment_ids=seg, kv_segment_ids=seg)
    forward, dkdv, dq = calls
    for operands, (bq, bk), by_keys in ((forward, (128, 64), False), (dkdv, (64, 128), True),
                                        (dq, (128, 64), False)):
        lists = operands[-4:]  # the kernels' last operands: no bias, mask, mod_aux or dbias
        tiles = non_empty(bq, bk).T if by_keys else non_empty(bq, bk)
        assert tiles.sum() < band(bq, bk).sum()
        np.testing.assert_array_equal(_given(lists),
                                      np.broadcast_to(tiles.sum(1), (MODS_HQ, len(tiles))))
        assert [_walked(lists, t) for t in range(len(tiles))] == [[int(n)] * MODS_HQ
                                                                 for n in tiles.sum(1)]


@needs_mosaic
def test_a_mod_aux_gathered_by_an_index_array_is_refused_by_name():
    """The kernels read mod_aux by scalar indices (b, h); an index array would be a gather."""
    q = jnp.ones((MODS_BATCH, 128, MODS_HQ, MODS_D), jnp.float16)
    table = jnp.ones((256,), jnp.float32)
    with pytest.raises(TypeError, match=r"mod_aux\[0\] \(shape \(256,\)\) is indexed with an "
                                        r"array.*scalar indices only"):
        flash_attention(q, q[:, :, :1], q[:, :, :1], implementation="mosaic_gpu",
                        interpret=True, mod_aux=(table,),
                        score_mod=lambda s, b, h, q_idx, kv_idx, t: s + t[kv_idx - q_idx + 128])
