"""Structural facts: what the VJP keeps, how memory grows, what the GPU kernels lower to."""
from __future__ import annotations

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_impl import BlockSizes, explain_implementation, masking, pallas_triton, platform, xla
from jax_impl.config import AttentionConfig
from jax_impl.dropout_sinks import SinksAndDropout
from jax_impl.flash_attention import flash_attention
from jax_impl.pallas_triton import heuristics
from jax_impl.pallas_triton.export import export_for_cuda



def _random(shape, seed, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


@pytest.mark.parametrize("options", [dict(implementation="xla"),
                                     dict(implementation="pallas_triton", interpret=True),
                                     dict()], ids=["xla", "pallas_triton", "default"])
def test_vjp_residuals_hold_no_score_sized_array(options):
    lq, lk = 160, 192
    q, k, v = _random((1, lq, 2, 16), 0), _random((1, lk, 1, 16), 1), _random((1, lk, 1, 16), 2)
    fn = lambda q, k, v: flash_attention(q, k, v, is_causal=True, **options)
    _, vjp_fn = jax.vjp(fn, q, k, v)
    residuals = jax.tree_util.tree_leaves(vjp_fn)
    sizes = [np.size(r) for r in residuals]
    assert residuals, "vjp kept nothing: the test inspects the wrong object"
    assert max(sizes) < lq * lk, f"a residual has {max(sizes)} >= Lq*Lk={lq * lk} elements"
    # The dense reference, by contrast, keeps the probabilities: the check can fail.
    _, dense_vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, is_causal=True,
                                                           implementation="reference"), q, k, v)
    assert max(np.size(r) for r in jax.tree_util.tree_leaves(dense_vjp)) >= lq * lk


def _temp_bytes(fn, *shapes):
    compiled = jax.jit(fn).lower(*shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
def test_xla_memory_grows_linearly_dense_quadratically(backward):
    def measure(implementation, length):
        shape = jax.ShapeDtypeStruct((1, length, 4, 64), jnp.float32)
        attend = lambda q, k, v: flash_attention(q, k, v, implementation=implementation)
        if backward:
            fn = lambda q, k, v: jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * q),
                                          argnums=(0, 1, 2))(q, k, v)
        else:
            fn = attend
        return _temp_bytes(fn, shape, shape, shape)

    lengths = (2048, 4096, 8192)
    blocked = [measure("xla", n) for n in lengths]
    dense = [measure("reference", n) for n in lengths]
    for small, large in zip(blocked, blocked[1:]):
        assert large / small < 2.6, f"xla temporaries {blocked} grow faster than linearly"
    for small, large in zip(dense, dense[1:]):
        assert large / small > 3.5, f"dense temporaries {dense} should grow quadratically"
    assert blocked[-1] * 8 < dense[-1]


@pytest.mark.parametrize("batch,heads,kv_heads,per_step", [(1, 8, 8, 1), (1, 8, 2, 4), (2, 4, 4, 2)])
def test_xla_loop_steps_cover_one_kv_head_block(batch, heads, kv_heads, per_step):
    """The CPU path runs the heads one block after another: every logits tile (the q.k^T
    product in the lowered program, forward and backward) covers ``per_step`` (batch row,
    query head) pairs, not all B * Hq of them (the caches hold one step's tiles)."""
    length, d = 1024, 32
    q, k = (jax.ShapeDtypeStruct((batch, length, h, d), jnp.float32) for h in (heads, kv_heads))
    attend = lambda q, k, v: flash_attention(q, k, v, implementation="xla")
    grads = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * q), argnums=(0, 1, 2))
    block_q, block_k = (min(n, length) for n in xla.DENSE_BLOCKS)
    for fn in (attend, grads):
        hlo = jax.jit(fn).lower(q, k, k).as_text()
        # the logits tile: a dot_general to [..., block_q, block_k] float32
        tiles = re.findall(rf"stablehlo.dot_general [^\n]*-> tensor<((?:\d+x)*){block_q}x{block_k}xf32>", hlo)
        assert tiles, f"no [{block_q}, {block_k}] logits tile found: the test reads the wrong program"
        pairs = {int(np.prod([int(n) for n in t.rstrip("x").split("x") if n] or [1])) for t in tiles}
        assert pairs == {per_step}, f"logits tiles cover {pairs} (batch, head) pairs per step"


@pytest.mark.parametrize("is_causal", [False, True], ids=["dense", "causal"])
def test_xla_tile_products_transpose_no_tile(is_causal):
    """The CPU path's products take their tiles as they are: Q^T, K^T, V^T and dO^T are
    transposed once per call, so the compiled program (forward and backward) copies or
    transposes nothing of a logits tile's size (XLA:CPU's dot would copy P^T and dS^T for
    dV = P^T dO and dK = dS^T Q, and K^T for S = Q K^T, at every tile)."""
    length, d = 1024, 64
    shape = jax.ShapeDtypeStruct((1, length, 1, d), jnp.float32)  # every input smaller than a tile
    attend = lambda q, k, v: flash_attention(q, k, v, is_causal=is_causal, implementation="xla")
    grads = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * q), argnums=(0, 1, 2))
    block_q, block_k = (min(n, length) for n in (xla.BANDED_BLOCKS if is_causal else xla.DENSE_BLOCKS))
    for fn in (attend, grads):
        hlo = jax.jit(fn).lower(shape, shape, shape).compile().as_text()
        dots = re.findall(r"= f32\[([\d,]+)\]\S* dot\(", hlo)
        assert any(int(np.prod([int(n) for n in s.split(",")])) == block_q * block_k for s in dots), \
            "no logits-tile product found: the test reads the wrong program"
        moved = [m.group(0)[:120] for m in re.finditer(r"= \w+\[([\d,]*)\]\S* (copy|transpose)\([^\n]*", hlo)
                 if int(np.prod([int(n) for n in m.group(1).split(",") if n] or [1])) >= block_q * block_k]
        assert not moved, moved[:3]


def test_head_blocks_run_as_independent_chains(monkeypatch):
    """With 2 host threads, 8 blocks of heads run as 2 independent loops of 4 (XLA:CPU runs
    independent loops concurrently), and the blocks' results come back in order; sequences
    shorter than CHAIN_MIN_PAIRS keep one loop."""
    monkeypatch.setattr(platform, "host_threads", lambda: 2)
    monkeypatch.setattr(xla, "CHAIN_MIN_PAIRS", 16 * 16)
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 16, 8, 4)), jnp.float32)
    fn = lambda x: x * 2.0 + x[:, :1]  # per block: [1, 16, 1, 4]
    jaxpr = jax.make_jaxpr(lambda q: xla._over_head_blocks(fn, q, q, (q,), (2,)))(q)
    loops = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert len(loops) == 2 and all(e.params["length"] == 4 for e in loops)
    stacked = xla._over_head_blocks(fn, q, q, (q,), (2,))
    expected = jnp.stack([fn(q[:, :, h:h + 1]) for h in range(8)])
    np.testing.assert_array_equal(np.asarray(stacked), np.asarray(expected))
    monkeypatch.setattr(xla, "CHAIN_MIN_PAIRS", 16 * 16 + 1)
    jaxpr = jax.make_jaxpr(lambda q: xla._over_head_blocks(fn, q, q, (q,), (2,)))(q)
    assert [e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"] == [8]


FEATURES = {
    "plain": dict(),
    "everything": dict(mask=True, bias=True, segments=True, lengths=True, is_causal=True,
                       causal_alignment="bottom_right", local_window_size=(64, 8),
                       logits_soft_cap=20.0, gqa=True),
    # Dropout (per batch and head: the hash's uint32 arithmetic) and sinks in every kernel.
    "dropout_sinks": dict(dropout=True, sinks=True, gqa=True, is_causal=True, lengths=True),
}


def _export_gradients(head_dim, dtype, lq, lk, features, block_sizes=None):
    dtype = jnp.dtype(dtype)
    hq, hkv, b = 4, (2 if features.get("gqa") else 4), 2
    sd = jax.ShapeDtypeStruct
    shapes = [sd((b, lq, hq, head_dim), dtype), sd((b, lk, hkv, head_dim), dtype),
              sd((b, lk, hkv, head_dim), dtype), sd((1, hq, lq, lk), jnp.float32)]
    extra = {}
    if features.get("mask"):
        extra["mask"] = jnp.asarray(np.random.default_rng(0).random((b, 1, lq, lk)) < 0.8)
    if features.get("segments"):
        extra["q_segment_ids"] = jnp.zeros((b, lq), jnp.int32).at[:, lq // 2:].set(1)
        extra["kv_segment_ids"] = jnp.zeros((b, lk), jnp.int32).at[:, lk // 2:].set(1)
    if features.get("lengths"):
        extra["key_value_seq_lengths"] = jnp.array([lk, lk // 2], jnp.int32)
    if features.get("dropout"):
        extra.update(dropout_rate=0.1, dropout_rng=jax.random.key(0), broadcast_dropout=False)
    if features.get("sinks"):
        extra["attention_sinks"] = jnp.linspace(-1.0, 1.0, hq)
    static = {n: features[n] for n in ("is_causal", "causal_alignment", "local_window_size",
                                       "logits_soft_cap") if n in features}

    def loss(q, k, v, bias):
        out = flash_attention(q, k, v, bias if features.get("bias") else None,
                              implementation="pallas_triton", block_sizes=block_sizes,
                              **static, **extra)
        return jnp.sum(out.astype(jnp.float32))

    exported = export_for_cuda(jax.grad(loss, argnums=(0, 1, 2, 3)), *shapes)
    return exported.mlir_module()


HEURISTIC_CONFIGS = list(heuristics.all_default_configs().items())


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("config, selector", HEURISTIC_CONFIGS,
                         ids=[f"d{d}-{t}{'-causal' if c else ''}" for _, (d, t, c) in HEURISTIC_CONFIGS])
def test_every_heuristic_config_lowers_to_triton_for_cuda(config, selector, features):
    head_dim, dtype, _ = selector
    length = 2 * max(config.block_q, config.block_k)  # long enough that no tile is clipped
    module = _export_gradients(head_dim, dtype, length, length + 3, FEATURES[features])
    kernels = re.findall(r'name = "(flash_attention_\w+)"', module)
    # 16-bit D=256 computes dV and dK in two kernels (heuristics.split_dkdv); the rest in one.
    split = head_dim == 256 and jnp.dtype(dtype).itemsize == 2
    backward = ["backward_dk", "backward_dv"] if split else ["backward_dkdv"]
    assert sorted(set(kernels)) == sorted(f"flash_attention_{k}" for k in [*backward, "backward_dq", "forward"])


@pytest.mark.parametrize("lq, lk, head_dim", [(1, 1, 8), (37, 129, 40), (129, 17, 256)])
def test_clipped_tiles_and_odd_shapes_lower_for_cuda(lq, lk, head_dim):
    module = _export_gradients(head_dim, "bfloat16", lq, lk, FEATURES["everything"])
    assert "flash_attention_forward" in module


def test_user_block_sizes_lower_for_cuda():
    blocks = BlockSizes(32, 16, 16, 32, 32, 16, num_warps=8, num_warps_bwd=2, num_stages=3)
    assert "flash_attention_backward_dq" in _export_gradients(64, "float16", 100, 70, {}, blocks)


def _triton_ir(precision, dtype=jnp.float32, head_dim=64, bias=False, length=64, **options):
    """What Pallas prints (debug=True) while lowering the three kernels for CUDA: each kernel's
    jaxpr, then its Triton IR (TTIR). ``bias``: also a bias, sinks and dropout seeds."""
    cfg = AttentionConfig(scale=head_dim ** -0.5, mask=masking.MaskSpec(is_causal=True), debug=True,
                          precision=precision, **options)
    masks = masking.MaskInputs(jnp.array([length], jnp.int32), jnp.array([length], jnp.int32),
                               None, None, None)

    extras = SinksAndDropout(jnp.ones((1, 1), jnp.float32), jnp.ones((1, 1), jnp.uint32)) if bias else None

    def fwd_bwd(q, b):
        b = b if bias else None
        out, stats = pallas_triton.forward(cfg, q, q, q, b, masks, extras)
        delta = jnp.zeros(stats.max.shape, jnp.float32)
        return pallas_triton.backward(cfg, q, q, q, b, masks, stats, out, delta, extras)

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        export_for_cuda(
            fwd_bwd, jax.ShapeDtypeStruct((1, length, 1, head_dim), dtype),
            jax.ShapeDtypeStruct((1, 1, length, length), jnp.float32))
    return printed.getvalue()


def _triton_modules(ir: str) -> dict:
    """Kernel name -> its TTIR, from ``_triton_ir``'s printout (the jaxprs left out)."""
    parts = re.split(r"\nThe (Triton module|kernel jaxpr) for pallas_call (\w+)", ir)
    modules = {name: body for kind, name, body in zip(parts[1::3], parts[2::3], parts[3::3])
               if kind == "Triton module"}
    assert sorted(modules) == ["flash_attention_backward_dkdv", "flash_attention_backward_dq",
                               "flash_attention_forward"], sorted(modules)
    return modules


def test_fp32_dots_are_full_precision_not_tf32():
    ir = _triton_ir(jax.lax.Precision.HIGHEST)
    assert ir.count("tt.dot") >= 2 + 4 + 3  # forward, dK/dV and dQ kernels
    assert "inputPrecision = tf32" not in ir
    # The check can fail: asking for DEFAULT precision does produce TF32 dots.
    assert "inputPrecision = tf32" in _triton_ir(jax.lax.Precision.DEFAULT)


def test_precision_presets_reach_every_triton_dot():
    presets = jax.lax.DotAlgorithmPreset
    dots = _triton_ir(jax.lax.Precision.HIGHEST).count("= tt.dot ")
    tf32x3 = _triton_ir(presets.TF32_TF32_F32_X3)  # 3xTF32 on the tensor cores
    assert tf32x3.count("= tt.dot ") == tf32x3.count("inputPrecision = tf32x3") == dots
    # BF16_BF16_F32_X6: each fp32 dot becomes six bfloat16 dots of split operands.
    x6 = _triton_ir(presets.BF16_BF16_F32_X6)
    assert len(re.findall(r"= tt\.dot .*xbf16>", x6)) == 6 * dots
    assert "inputPrecision = tf32" not in x6


def test_gpu_only_precision_lowers_for_cuda_through_xla():
    """XLA:CPU refuses TF32 dots, but the xla implementation exported for CUDA carries the
    3xTF32 algorithm on its dots (the CPU guard does not block the CUDA lowering)."""
    q = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32)
    loss = lambda q: jnp.sum(flash_attention(q, q, q, implementation="xla", is_causal=True,
                                             precision=jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3))
    module = export_for_cuda(jax.grad(loss), q).mlir_module()
    algorithms = re.findall(r"algorithm = <lhs_precision_type = (\w+),.*?num_primitive_operations = (\d+)", module)
    assert algorithms and set(algorithms) == {("tf32", "3")}


# P = exp2((S - m) * log2(e)): jnp.exp2 lowers to Triton's math.exp2 or, for float32 on this JAX, to
# libdevice's __nv_exp2f; both are one PTX ex2.approx. exp (__nv_expf or math.exp) costs a
# range reduction of about ten instructions around the same ex2.approx.
EXP2 = re.compile(r'math\.exp2 |symbol = "__nv_exp2f"')
EXP = re.compile(r'math\.exp |symbol = "__nv_expf"')


@pytest.mark.parametrize("features", [dict(), dict(bias=True, logits_soft_cap=20.0, dropout_rate=0.1)],
                         ids=["plain", "bias-softcap-dropout-sinks"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_every_kernel_computes_p_with_exp2_never_exp(dtype, head_dim, features):
    modules = _triton_modules(_triton_ir(jax.lax.Precision.HIGHEST, dtype, head_dim, **features))
    for name, ttir in modules.items():
        assert EXP2.search(ttir), f"{name}: no exp2"
        assert not EXP.search(ttir), f"{name}: exp: {EXP.search(ttir).group(0)}"


@pytest.mark.parametrize("length, head_dim", [(100, 24), (100, 64), (128, 64)],
                         ids=["odd-length-and-head-dim", "odd-length", "whole-tiles"])
def test_tiles_past_the_arrays_are_masked_loads_and_stores(length, head_dim):
    """Where the last tiles reach past the sequence or the head dim, the tile loads and stores
    of the three kernels carry a mask (they read zeros there and write nothing): every store,
    every load of a q/k/v/dO tile when the head dim has a tail, some loads when only the length
    has one (interior tiles end below it: no mask). Whole tiles: no mask at all. An unmasked
    store would overwrite another head's rows on a GPU, which the interpreter cannot show (its
    padded copy takes the write); an unmasked load reads the interpreter's NaN padding, which
    the interpret-mode correctness tests do see."""
    modules = _triton_modules(_triton_ir(jax.lax.Precision.HIGHEST, jnp.bfloat16, head_dim,
                                         bias=True, length=length))
    for name, ttir in modules.items():
        # tt.load %ptr[, %mask, %other] / tt.store %ptr, %value[, %mask] : tensor<SHAPE x!tt.ptr<T>>
        accesses = [(op, operands.count("%") == 3, shape) for op, operands, shape in
                    re.findall(r"tt\.(load|store) ([^:]*): tensor<([0-9x]+)x!tt\.ptr", ttir)]
        stores = [masked for op, masked, _ in accesses if op == "store"]
        loads = [masked for op, masked, _ in accesses if op == "load"]
        feature_tiles = [masked for op, masked, shape in accesses
                         if op == "load" and shape.endswith("x32")]  # [T, 32]: q/k/v/dO at D=24
        assert stores and (len(feature_tiles) >= 2 or head_dim == 64), name
        if length % 128 == 0 and head_dim == 64:
            assert not any(loads) and not any(stores), name
        else:
            assert all(stores) and any(loads), name
            assert all(feature_tiles), name


def test_odd_shapes_reach_the_kernels_without_padding_copies():
    """The user's q, k, v, dO, bias and segment ids go to the kernels as they are, and their
    outputs come back as they are: no pad and no slice anywhere in the lowered program."""
    module = _export_gradients(40, "bfloat16", 100, 77, dict(bias=True, segments=True, is_causal=True))
    assert "flash_attention_backward_dq" in module
    assert not re.findall(r"stablehlo\.(pad|slice|dynamic_slice)\b", module)


def _transposed_values_after_exp2(ttir: str):
    """The operands of the tt.trans ops that depend on an exp2, i.e. on P or dS."""
    defs = dict(re.findall(r"^\s*(%\w+)(?::\d+)? = (.*)$", ttir, re.MULTILINE))
    memo = {}

    def after_exp2(value):
        if value not in memo:
            memo[value] = False  # a cycle (loop-carried value) adds nothing
            line = defs.get(value, "")
            memo[value] = bool(EXP2.search(line)) or any(
                after_exp2(v) for v in re.findall(r"%\w+", line.split(" : ")[0]))
        return memo[value]

    return [v for v in re.findall(r"tt\.trans (%\w+)", ttir) if after_exp2(v)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_dkdv_kernel_transposes_no_computed_tile(dtype):
    """dK/dV works on S^T = K Q^T: dV += P^T dO and dK += dS^T Q need no transpose of P or dS
    (a transposed operand that is a loaded Q or dO tile is free: Triton reads it from shared
    memory in the other order)."""
    modules = _triton_modules(_triton_ir(jax.lax.Precision.HIGHEST, dtype, 64, bias=True))
    dkdv = modules["flash_attention_backward_dkdv"]
    assert "tt.trans" in dkdv  # the loaded Q and dO (and bias) tiles
    assert _transposed_values_after_exp2(dkdv) == []
    # The check can fail (the kernel's former dot(P, dO, trans_a=True) failed it): a
    # transpose of a value computed from an exp2 is found.
    fake = "%1 = tt.extern_elementwise %0 {symbol = \"__nv_exp2f\"}\n%2 = tt.trans %1 {order}\n"
    assert _transposed_values_after_exp2(fake) == ["%1"]


def _first_program_tiles(spec: masking.MaskSpec, length=256, head_dim=64):
    """Kernel name -> the sequence tile (block index along L of its first tiled operand: q for
    the forward and dQ, k for dK/dV) that the grid's program 0 takes, read from the index maps
    of the pallas_calls that the kernels are built with."""
    cfg = AttentionConfig(scale=0.125, mask=spec, interpret=True, block_sizes=BlockSizes(
        64, 64, 64, 64, 64, 64))
    masks = masking.MaskInputs(jnp.array([length], jnp.int32), jnp.array([length], jnp.int32),
                               None, None, None)

    def fwd_bwd(q):
        out, stats = pallas_triton.forward(cfg, q, q, q, None, masks)
        return pallas_triton.backward(cfg, q, q, q, None, masks, stats, out, stats.max)

    jaxpr = jax.make_jaxpr(fwd_bwd)(jax.ShapeDtypeStruct((1, length, 1, head_dim), jnp.bfloat16))
    tiles = {}
    for eqn in jaxpr.jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            operand = 1 if eqn.params["name"].endswith("dkdv") else 0  # k, or q
            index_map = eqn.params["grid_mapping"].block_mappings[operand].index_map_jaxpr
            blocks = jax.core.eval_jaxpr(index_map.jaxpr, index_map.consts, 0, 0, 0)
            tiles[eqn.params["name"]] = int(blocks[1])
    return tiles


@pytest.mark.parametrize("spec, query_last, key_last", [
    (masking.MaskSpec(is_causal=True), True, False),
    (masking.MaskSpec(is_causal=True, bottom_right=True, window_left=32), True, False),
    (masking.MaskSpec(window_left=32), False, True),
    (masking.MaskSpec(), False, False),
], ids=["causal", "causal-window", "left-window", "none"])
def test_programs_take_the_heaviest_tiles_first(spec, query_last, key_last):
    """Causal: the last query tile sees the most keys, so program 0 of the forward and dQ grids
    takes it; key tile 0 is seen by the most queries, so dK/dV keeps its order. A band bounded
    below only is the mirror image. Without a band every tile costs the same: no reordering."""
    last = 256 // 64 - 1
    assert _first_program_tiles(spec) == {
        "flash_attention_forward": last if query_last else 0,
        "flash_attention_backward_dq": last if query_last else 0,
        "flash_attention_backward_dkdv": last if key_last else 0}


def test_pallas_triton_refuses_to_lower_for_cpu_and_says_what_to_use():
    q = _random((1, 16, 1, 16), 0)
    with pytest.raises(NotImplementedError, match="implementation='xla'.*interpret=True"):
        jax.jit(lambda q: flash_attention(q, q, q, implementation="pallas_triton"))(q)


def test_explain_implementation_names_the_choice_and_every_reason():
    q = _random((1, 16, 2, 64), 0)
    on_cpu = explain_implementation(q, q, q, platform="cpu")
    assert on_cpu.chosen == "cpu" and "cpu is eligible" in on_cpu.reasons["xla"]
    assert "CUDA" in on_cpu.reasons["pallas_triton"]
    with_bias = explain_implementation(q, q, q, jnp.zeros((16, 16)), platform="cpu")
    assert with_bias.chosen == "cpu"  # the CPU kernel takes every feature
    odd_tiles = explain_implementation(q, q, q, platform="cpu", block_sizes=BlockSizes(block_k=32))
    assert odd_tiles.chosen == "xla" and "block_k=32" in odd_tiles.reasons["cpu"]
    on_gpu = explain_implementation(q, q, q, platform="cuda")
    assert on_gpu.chosen == "pallas_triton" and on_gpu.reasons["pallas_triton"] is None
    assert on_gpu.reasons["xla"] and on_gpu.reasons["reference"]
    wide = _random((1, 16, 1, 512), 1)
    too_wide = explain_implementation(wide, wide, wide, platform="cuda")
    assert too_wide.chosen == "xla" and "head_dim=512" in too_wide.reasons["pallas_triton"]
    requested = explain_implementation(q, q, q, platform="cuda", implementation="reference")
    assert requested.chosen == "reference" and "requested" in requested.reasons["pallas_triton"]


def test_default_path_on_cuda_lowers_the_pallas_kernels():
    sd = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
    exported = export_for_cuda(lambda q, k, v: flash_attention(q, k, v), sd, sd, sd)
    assert "flash_attention_forward" in exported.mlir_module()
    cpu = jax.jit(lambda q, k, v: flash_attention(q, k, v)).lower(sd, sd, sd).as_text()
    assert "flash_attention_forward" not in cpu
