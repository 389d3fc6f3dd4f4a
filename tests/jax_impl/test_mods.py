"""score_mod, mask_mod, mod_aux and block_mask (FlexAttention's model) through flash_attention:
judged against a float64 numpy oracle written here (dense, sharing no code with the library).
``cpu`` runs the mods as compiled row programs in the C++ kernel (its tiles: 96 or 64 query
rows, 128 keys, so that a block_mask of 16 x 16 tiles does not nest in them), ``xla`` traces
them into its tile loop."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_impl import BlockSizes, create_block_mask, explain_implementation, flash_attention
from jax_impl.block_mask import BlockMask, FULL

B, L, H, D = 2, 96, 4, 16
SMALL_TILES = BlockSizes(block_q=32, block_k=16)  # many tiles: empty, partial and full ones


def _oracle(q, k, v, d_out, logits_of, allowed):
    """Dense float64 attention and its gradients by hand. ``logits_of(s)`` maps the scaled
    logits [B, H, Lq, Lk]; ``allowed`` [B, H, Lq, Lk] bool. -> out, dq, dk, dv, d_logits."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    s = logits_of(np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]))
    s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    p = np.where(total > 0, e / np.where(total > 0, total, 1), 0)
    out = np.einsum("bhqk,bkhd->bqhd", p, v)
    dp = np.einsum("bqhd,bkhd->bhqk", d_out, v)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    scale = 1 / np.sqrt(q.shape[-1])
    dq = np.einsum("bhqk,bkhd->bqhd", ds, k) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    dv = np.einsum("bhqk,bqhd->bkhd", p, d_out)
    return out, dq, dk, dv, ds


def _inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(x, (B, L, H, D), jnp.float32) for x in keys]


def _documents(seed=0):
    """[B, L] ascending document ids, different cuts per row."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.integers(0, 4, (B, L)), axis=1).astype(np.int32)


POSITIONS = np.arange(L)
DISTANCE = np.abs(POSITIONS[:, None] - POSITIONS[None, :])  # [Lq, Lk]


def _alibi(score, b, h, q_idx, kv_idx, slopes):
    return score - slopes[h] * jnp.abs(q_idx - kv_idx)


def _bucket(relative):  # T5-like: the sign and a coarse log of the distance, 8 buckets
    return jnp.where(relative > 0, 4, 0) + jnp.minimum(jnp.abs(relative) // 8, 3)


def _bucket_np(relative):
    return np.where(relative > 0, 4, 0) + np.minimum(np.abs(relative) // 8, 3)


def _t5(score, b, h, q_idx, kv_idx, table):
    return score + table[_bucket(kv_idx - q_idx), h]


def _documents_causal(b, h, q_idx, kv_idx, doc):
    return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)


@pytest.mark.parametrize("implementation", ["xla", "cpu"])
def test_soft_cap_as_a_score_mod_equals_the_built_in_soft_cap(implementation):
    q, k, v, d_out = (4 * x for x in _inputs(3))
    cap = 2.0
    mod = lambda s, b, h, q_idx, kv_idx: cap * jnp.tanh(s / cap)
    f = lambda q, k, v, **kw: flash_attention(q, k, v, implementation=implementation, is_causal=True,
                                              **kw)
    got = jax.vjp(lambda *x: f(*x, score_mod=mod), q, k, v)
    want = jax.vjp(lambda *x: f(*x, logits_soft_cap=cap), q, k, v)
    for a, b in zip((got[0], *got[1](d_out)), (want[0], *want[1](d_out))):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "cpu"])
def test_rows_with_no_allowed_key_give_zero_output_and_gradients(implementation):
    q, k, v, d_out = _inputs(4)
    slopes = jnp.linspace(0.1, 0.4, H)
    blocked = lambda b, h, q_idx, kv_idx, slopes: (q_idx % 5 != 0) & (kv_idx < q_idx + 7)
    f = lambda q, k, v, s: flash_attention(q, k, v, mask_mod=blocked, score_mod=_alibi,
                                           mod_aux=(s,), implementation=implementation,
                                           block_sizes=SMALL_TILES if implementation == "xla" else None)
    out, vjp = jax.vjp(f, q, k, v, slopes)
    dq, dk, dv, d_slopes = vjp(d_out)
    for x in (out, dq, dk, dv, d_slopes):
        assert np.isfinite(np.asarray(x)).all()
    np.testing.assert_array_equal(np.asarray(out)[:, ::5], 0)
    np.testing.assert_array_equal(np.asarray(dq)[:, ::5], 0)


@pytest.mark.parametrize("implementation", ["xla", "cpu"])
def test_mod_aux_gradient_is_bitwise_repeatable_under_jit_and_vmap(implementation):
    q, k, v, d_out = _inputs(5)
    table = jax.random.normal(jax.random.key(7), (8, H))
    tiles = SMALL_TILES if implementation == "xla" else None
    loss = lambda q, table: (flash_attention(q, k, v, score_mod=_t5, mod_aux=(table,),
                                             implementation=implementation, block_sizes=tiles)
                             * d_out).sum()
    grad = jax.jit(jax.grad(loss, argnums=1))
    first, second = grad(q, table), grad(q, table)
    np.testing.assert_array_equal(first, second)
    batched = jax.vmap(grad, in_axes=(None, 0))(q, jnp.stack([table, table]))
    np.testing.assert_array_equal(batched[0], batched[1])
    np.testing.assert_allclose(batched[0], first, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "cpu"])
def test_three_block_masks_of_one_shape_compile_once(implementation):
    q, k, v, _ = _inputs(6)
    f = jax.jit(lambda q, k, v, doc, bm: flash_attention(
        q, k, v, mask_mod=_documents_causal, mod_aux=(doc,), block_mask=bm,
        implementation=implementation))
    outs = []
    for seed in range(3):
        doc = jnp.asarray(_documents(10 + seed))
        bm = create_block_mask(_documents_causal, B, None, L, L, block_size=32, mod_aux=(doc,))
        outs.append(f(q, k, v, doc, bm))
    assert f._cache_size() == 1
    assert not np.allclose(outs[0], outs[1])


def _call(**kwargs):
    q, k, v, _ = _inputs(7)
    return flash_attention(q, k, v, implementation="xla", **kwargs)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(score_mod=lambda s, b, h, q, kv: s > 0), TypeError, "score_mod must return a float array"),
    (dict(score_mod=lambda s, b, h, q, kv: jnp.zeros((3, 5))), ValueError, "score_mod returned shape"),
    (dict(mask_mod=lambda b, h, q, kv: q - kv), TypeError, "mask_mod must return a bool array"),
    (dict(score_mod=3), TypeError, "score_mod must be a function"),
    (dict(mod_aux=jnp.ones(3), score_mod=lambda s, b, h, q, kv, x: s), TypeError, "mod_aux must be a tuple"),
    (dict(mod_aux=(jnp.ones(3),)), ValueError, "mod_aux was given without score_mod or mask_mod"),
    (dict(mod_aux=(jnp.ones(3),), score_mod=lambda s, b, h, q, kv: s), TypeError,
     "every mod receives all of them"),
    (dict(mask_mod=lambda b, h, q, kv: kv <= q,
          block_mask=create_block_mask(lambda b, h, q, kv: kv <= q, 1, 1, L, 2 * L)),
     ValueError, "block_mask was built for"),
    (dict(block_mask=create_block_mask(lambda b, h, q, kv: kv <= q, 1, 1, L, L, block_size=32)),
     ValueError, "block_mask has partial tiles"),
    (dict(mask_mod=lambda b, h, q, kv: kv <= q,
          block_mask=create_block_mask(lambda b, h, q, kv: kv <= q, 3, 1, L, L)),
     ValueError, "block_mask has \\(B, H\\)=\\(3, 1\\)"),
    (dict(mod_aux=(None,), score_mod=lambda s, b, h, q, kv, x: s), TypeError,
     "mod_aux\\[0\\] must be an array"),
    (dict(score_mod=lambda s, b, h, q, kv: s + q.reshape(-1)[:1]), ValueError,
     "score_mod is not elementwise"),
    (dict(mask_mod=lambda b, h, q, kv: kv[..., :1] <= q), ValueError, "mask_mod is not elementwise"),
])
def test_bad_mods_are_refused_by_name(kwargs, error, message):
    with pytest.raises(error, match=message):
        _call(**kwargs)


def test_a_mod_closing_over_a_traced_array_is_refused():
    slopes = jnp.linspace(0.1, 0.4, H)

    @jax.jit
    def f(slopes):
        return _call(score_mod=lambda s, b, h, q, kv: s - slopes[h] * jnp.abs(q - kv))

    with pytest.raises(ValueError, match="score_mod closes over a traced array"):
        f(slopes)


def test_a_block_mask_with_a_paged_cache_is_refused():
    q = jnp.ones((1, 1, 2, 16))
    pages = jnp.ones((4, 16, 2, 16))
    full = BlockMask.from_tile_classes(jnp.full((1, 1, 1, 1), FULL, jnp.int8), 1, 32, 16, 32)
    with pytest.raises(ValueError, match="block_mask cannot be used with page_table"):
        flash_attention(q, pages, pages, page_table=jnp.zeros((1, 2), jnp.int32), block_mask=full)


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton"])
def test_explain_counts_the_tiles_a_block_mask_leaves(implementation):
    q, k, v, _ = _inputs(8)
    doc = _documents(8)
    bm = create_block_mask(_documents_causal, B, None, L, L, block_size=16, mod_aux=(jnp.asarray(doc),))
    choice = explain_implementation(q, k, v, mask_mod=_documents_causal, mod_aux=(jnp.asarray(doc),),
                                    block_mask=bm, implementation=implementation,
                                    interpret=implementation == "pallas_triton",
                                    block_sizes=BlockSizes(block_q=16, block_k=16))
    allowed = (doc[:, :, None] == doc[:, None, :]) & (POSITIONS[None, :] <= POSITIONS[:, None])
    tiles = allowed.reshape(B, L // 16, 16, L // 16, 16)
    full, visited = tiles.all((2, 4)).sum() * H, tiles.any((2, 4)).sum() * H
    assert choice.tiles.startswith(f"{visited:,} of {B * H * (L // 16) ** 2:,} tiles of 16x16 "
                                   f"({visited - full:,} partial, {full:,} full")


@pytest.mark.parametrize("implementation", [None, "pallas_triton"])
def test_decode_and_a_paged_cache_take_the_mods(implementation):
    """Few query rows against a long cache (GQA: the decode path packs each kv head's query
    heads as rows, and the mods must still see each query head): xla's decode path (chosen on
    the CPU) and the Pallas Triton decode kernel in the interpreter."""
    b, lq, hq, hkv, pages, page = 2, 3, 4, 2, 6, 128
    lk = pages * page
    keys = jax.random.split(jax.random.key(9), 4)
    q, d_out = (jax.random.normal(x, (b, lq, hq, D)) for x in keys[:2])
    k, v = (jax.random.normal(x, (b, lk, hkv, D)) for x in keys[2:])
    slopes = jnp.asarray([0.01, 0.02, 0.05, 0.1])
    score_mod = lambda s, b, h, q_idx, kv_idx, slopes: s - slopes[h] * jnp.abs(q_idx + lk - lq - kv_idx)
    mask_mod = lambda b, h, q_idx, kv_idx, slopes: (kv_idx % 7 != b) & (kv_idx % 5 != h)
    kw = dict(score_mod=score_mod, mask_mod=mask_mod, mod_aux=(slopes,),
              implementation=implementation, interpret=implementation is not None)
    rows, cols = np.arange(lq)[:, None] + lk - lq, np.arange(lk)[None, :]
    heads = np.arange(hq)[:, None, None]
    allowed = (cols % 7 != np.arange(b)[:, None, None, None]) & (cols % 5 != heads)
    want = _oracle(q, np.repeat(k, 2, 2), np.repeat(v, 2, 2), d_out,
                   lambda s: s - np.asarray(slopes, np.float64)[:, None, None] * np.abs(rows - cols),
                   np.broadcast_to(allowed, (b, hq, lq, lk)))[0]
    assert explain_implementation(q, k, v, **kw).path == "decode"
    np.testing.assert_allclose(flash_attention(q, k, v, **kw), want, atol=2e-5, rtol=1e-4)
    table = jnp.asarray(np.random.default_rng(9).permutation(b * pages).reshape(b, pages), jnp.int32)
    pool_k, pool_v = (jnp.zeros((b * pages, page, hkv, D)).at[table.reshape(-1)].set(
        x.reshape(b * pages, page, hkv, D)) for x in (k, v))
    np.testing.assert_allclose(flash_attention(q, pool_k, pool_v, page_table=table, **kw), want,
                               atol=2e-5, rtol=1e-4)


def test_a_mask_mod_without_a_block_mask_still_skips_its_empty_tiles():
    """flash_attention evaluates the mask_mod chunk-wise into a BlockMask of its own."""
    length = 512
    q = jax.random.normal(jax.random.key(10), (B, length, H, D))
    doc = jnp.asarray(np.repeat(np.arange(4), 128)[None].repeat(B, 0), jnp.int32)
    tiles = BlockSizes(block_q=128, block_k=128)
    choice = explain_implementation(q, q, q, mask_mod=_documents_causal, mod_aux=(doc,),
                                    implementation="xla", block_sizes=tiles)
    assert choice.tiles.startswith(f"{4 * B * H:,} of {16 * B * H:,} tiles of 128x128 "
                                   f"({4 * B * H:,} partial, 0 full")


def test_the_cpu_default_runs_the_mods_in_its_kernel_and_refuses_what_its_programs_lack():
    """On a CPU the automatic choice runs ALiBi in the C++ kernel; a mod its row programs
    cannot express (a reduction over a whole mod_aux array) runs on xla, and explain says why."""
    q, k, v, d_out = _inputs(11)
    slopes = jax.random.uniform(jax.random.key(12), (H,), minval=0.05, maxval=0.5)
    assert explain_implementation(q, k, v, score_mod=_alibi, mod_aux=(slopes,)).chosen == "cpu"
    normalised = lambda s, b, h, q_idx, kv_idx, slopes: s - slopes[h] / slopes.sum() * jnp.abs(q_idx - kv_idx)
    choice = explain_implementation(q, k, v, score_mod=normalised, mod_aux=(slopes,))
    assert choice.chosen == "xla"
    assert "cpu" in choice.reasons and "whole mod_aux array" in choice.reasons["cpu"]
    out = flash_attention(q, k, v, score_mod=normalised, mod_aux=(slopes,))
    want = _oracle(q, k, v, d_out, lambda s: s - (np.asarray(slopes, np.float64) / np.asarray(slopes, np.float64).sum())[None, :, None, None] * DISTANCE,
                   np.ones((B, H, L, L), bool))[0]
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("implementation", ["xla", "cpu"])
def test_a_zero_dimensional_mod_aux_is_a_scalar_and_gets_its_gradient(implementation):
    """A learnable temperature: a 0-d mod_aux entry used as a scalar, its gradient the sum of
    dS times the logits."""
    q, k, v, d_out = _inputs(13)
    temperature = jax.random.uniform(jax.random.key(14), (), minval=0.5, maxval=2.0)
    mod = lambda s, b, h, q_idx, kv_idx, t: s * t
    f = lambda q, k, v, t: flash_attention(q, k, v, score_mod=mod, mod_aux=(t,), is_causal=True,
                                           implementation=implementation)
    out, vjp = jax.vjp(f, q, k, v, temperature)
    causal = np.broadcast_to(POSITIONS[None, :] <= POSITIONS[:, None], (B, H, L, L))
    t64 = float(temperature)
    want = _oracle(q, k, v, d_out, lambda s: s * t64, causal)
    scaled = np.einsum("bqhd,bkhd->bhqk", np.asarray(q, np.float64), np.asarray(k, np.float64)) / np.sqrt(D)
    d_t = (want[4] * np.where(causal, scaled, 0)).sum()
    # the oracle's dq, dk are of the logits after the mod: times d(s t)/ds = t before it
    for got, expected in zip((out, *vjp(d_out)), (want[0], want[1] * t64, want[2] * t64, want[3], d_t)):
        np.testing.assert_allclose(got, expected, atol=2e-5 * max(1, np.abs(expected).max()), rtol=1e-4)


@pytest.mark.parametrize("mod", ["alibi", "t5"])
def test_score_mods_compile_without_a_score_sized_buffer_at_4096(mod):
    """ALiBi and a T5 table on the CPU default at L=4096, forward and forward+backward (the
    table's gradient too): the C++ kernel runs them, and the compiled temporaries (O(L D H):
    about 8 MiB) stay far below one [L, L] float32 (64 MiB; the scores of both heads: 128)."""
    n, heads = 4096, 2
    x = jax.ShapeDtypeStruct((1, n, heads, 64), jnp.float32)
    score_mod, shape = (_alibi, (heads,)) if mod == "alibi" else (_t5, (8, heads))
    table = jax.random.uniform(jax.random.key(13), shape, minval=0.05, maxval=0.5)
    q = jax.random.normal(jax.random.key(14), x.shape, x.dtype)
    assert explain_implementation(q, q, q, score_mod=score_mod, mod_aux=(table,), is_causal=True,
                                  platform="cpu").chosen == "cpu"
    aux = jax.ShapeDtypeStruct(shape, jnp.float32)
    call = lambda q, k, v, a: flash_attention(q, k, v, score_mod=score_mod, mod_aux=(a,), is_causal=True)
    loss = lambda q, k, v, a: jnp.sum(call(q, k, v, a))
    for f in (call, jax.grad(loss, argnums=(0, 1, 2, 3))):
        compiled = jax.jit(f).lower(x, x, x, aux).compile()
        assert compiled.memory_analysis().temp_size_in_bytes < 16 * 2**20, mod


def test_create_block_mask_refuses_a_shared_batch_or_head_that_the_rule_reads():
    """B=None (or H=None) means one mask for all; a mask_mod that reads b (h) would be
    evaluated for the first only, and its FULL tiles then skip the rule for the others."""
    for kwargs, name in ((dict(B=None, H=2), "B"), (dict(B=2, H=None), "H")):
        rule = (lambda b, h, q, kv: (kv <= q) | (b == 1)) if name == "B" else (
            lambda b, h, q, kv: (kv <= q) | (h == 1))
        with pytest.raises(ValueError, match=f"{name}=None .* reads"):
            create_block_mask(rule, kwargs["B"], kwargs["H"], L, L, block_size=32)
    create_block_mask(lambda b, h, q, kv: kv <= q, None, None, L, L, block_size=32)


def test_explain_refuses_a_named_implementation_as_flash_attention_does():
    q, k, v, _ = _inputs(8)
    with pytest.raises(ValueError, match="implementation='mosaic_tpu' cannot run this call on "
                                         "platform='cpu'.*needs a TPU"):
        explain_implementation(q, k, v, implementation="mosaic_tpu", platform="cpu")


@pytest.mark.parametrize("implementation", [None, "cpu", "xla", "reference"])
def test_an_empty_batch_with_mods_gives_the_empty_result(implementation):
    empty = jnp.zeros((0, L, H, D))
    slopes = jnp.linspace(0.1, 0.4, H)
    out = flash_attention(empty, empty, empty, score_mod=_alibi, mod_aux=(slopes,),
                          implementation=implementation)
    assert out.shape == empty.shape


def test_the_cpu_kernel_reads_static_indices_and_refuses_callbacks_by_name():
    """A mod reading ``a[0]`` (a static slice) runs in the C++ kernel; one calling
    jax.debug.print is refused there by name (the automatic choice runs it on xla)."""
    q, k, v, _ = _inputs(9)
    scales = jnp.asarray([0.7, 1.3])
    by_index = lambda s, b, h, q_idx, kv_idx, x: s * x[0] + x[1]
    assert explain_implementation(q, k, v, platform="cpu", score_mod=by_index,
                                  mod_aux=(scales,)).chosen == "cpu"
    np.testing.assert_allclose(
        flash_attention(q, k, v, score_mod=by_index, mod_aux=(scales,), implementation="cpu"),
        flash_attention(q, k, v, scale=0.7 / np.sqrt(D), implementation="cpu"), rtol=1e-5, atol=1e-6)

    def printing(s, b, h, q_idx, kv_idx):
        jax.debug.print("{}", s.shape)
        return s

    with pytest.raises(ValueError, match="debug_print.*cannot call back into Python"):
        flash_attention(q, k, v, score_mod=printing, implementation="cpu")
    assert explain_implementation(q, k, v, platform="cpu", score_mod=printing).chosen == "xla"
