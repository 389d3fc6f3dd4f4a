"""pallas_triton.decode, the split-K decode kernel (dense caches, and pages read in place
through a page table), in the Pallas interpreter against torch_ref.manual_attention and
torch_ref.paged_attention in float64; its program count; and (pip triton) its compile for
sm_90a without spills."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_ref
from jax_impl import dropout_sinks, explain_implementation, flash_attention, kv_cache, masking
from jax_impl.config import AttentionConfig
from jax_impl.pallas_triton import decoding as pallas_decode
from jax_impl.pallas_triton.layout import tiles
from test_decode import HEADS_FIRST, _inputs, _oracle


def test_decode_kernel_matches_the_oracle_with_gradients():
    """Through flash_attention (interpret=True): the decode kernel forward, the Triton backward
    from its RowStats."""
    rng, (q, k, v), cot = _inputs(21, 2, 2, 4, 2, 520, 16)
    lengths = jnp.asarray([520, 301], jnp.int32)
    kw = dict(is_causal=True, causal_alignment="bottom_right", key_value_seq_lengths=lengths)
    assert explain_implementation(q, k, v, implementation="pallas_triton", interpret=True, **kw).path == "decode"
    out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, implementation="pallas_triton",
                                                       interpret=True, **kw), q, k, v)
    expected, expected_grads = _oracle(q, k, v, cot, **kw)
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5)
    for got, want in zip(vjp(jnp.asarray(cot)), expected_grads):
        np.testing.assert_allclose(np.asarray(got), want, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("lq,hq,hkv,window,cap,sinks", [
    (1, 8, 2, (150, 0), None, True), (16, 2, 1, None, 3.0, False), (3, 3, 3, (40, 5), None, True)],
    ids=["gqa_window_sinks", "mqa_16_rows_softcap", "mha_window_right"])
def test_decode_kernel_features(lq, hq, hkv, window, cap, sinks):
    b, lk, d = 2, 300, 24  # D and Lk not tile multiples
    rng, (q, k, v), _ = _inputs(lq + hq, b, lq, hq, hkv, lk, d)
    kv_len = np.array([300, 130], np.int32)
    offsets = np.array([0, 7], np.int32)
    spec = masking.MaskSpec(is_causal=True, bottom_right=True, has_kv_lengths=True,
                            window_left=None if window is None else window[0],
                            window_right=None if window is None else window[1])
    cfg = AttentionConfig(scale=0.3, mask=spec, logits_soft_cap=cap, interpret=True)
    sink_values = rng.standard_normal((1, hq)).astype(np.float32) if sinks else None
    masks = masking.MaskInputs(jnp.full((b,), lq, jnp.int32), jnp.asarray(kv_len), None, None, None,
                               jnp.asarray(offsets))
    out, _ = pallas_decode.decode(cfg, q, k, v, masks, dropout_sinks.SinksAndDropout(
        sinks=None if sink_values is None else jnp.asarray(sink_values)))
    i, j = np.arange(lq)[None, :, None], np.arange(lk)[None, None, :]
    diagonal = i + (kv_len - lq + offsets)[:, None, None]
    allowed = (j < kv_len[:, None, None]) & (j <= diagonal)
    if window is not None:
        allowed &= (j >= diagonal - window[0]) & (j <= diagonal + window[1])
    expected = torch_ref.manual_attention(
        *(HEADS_FIRST(x) for x in (q, k, v)), scale=0.3, logits_soft_cap=cap,
        mask=torch.tensor(allowed[:, None]),
        attention_sinks=None if sink_values is None else torch.tensor(sink_values[0], dtype=torch.float64))
    np.testing.assert_allclose(np.asarray(out), expected.permute(0, 2, 1, 3).numpy(), atol=2e-5)


def test_decode_kernel_fills_an_h100():
    """B=1, Hkv=8, one query row, 65,536 keys: at least 132 programs (one per SM)."""
    block_k = 64
    runs = pallas_decode.decode_runs(1, 8, tiles(65536, block_k))
    assert runs * 1 * 8 >= 132


@pytest.mark.parametrize("page_size", [None, 16, 64], ids=["dense", "pages16", "pages64"])
def test_decode_kernel_compiles_for_sm90a_without_spills(page_size):
    pytest.importorskip("triton", reason="pip triton (the `test` extra) compiles the kernel for sm_90a")
    from tools import compile_report
    kernel, grid = compile_report.decode_kernel(page_size=page_size)
    assert grid[0] * grid[1] * grid[2] >= 132, grid
    facts = compile_report.compile_kernel(kernel)
    assert facts["ptxas_ok"], facts["error"]
    assert facts["spill_stores"] == 0 and facts["spill_loads"] == 0, facts


# --- Pages read in place -----------------------------------------------------------------

T = lambda x: torch.tensor(np.asarray(x, np.float64))


def _pages(seed, *, b, lq, hq, hkv, d, page_size, per_sequence, spare=3):
    rng = np.random.default_rng(seed)
    num_pages = b * per_sequence + spare
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    table = kv_cache.make_page_table(b, per_sequence, num_pages=num_pages, key=jax.random.key(seed))
    return rng, draw(b, lq, hq, d), draw(num_pages, page_size, hkv, d), draw(num_pages, page_size, hkv, d), table


@pytest.mark.parametrize("page_size,per_sequence,lq,hq,hkv,d,options", [
    (16, 12, 2, 8, 2, 24, dict(is_causal=True, causal_alignment="bottom_right", sinks=True)),
    (64, 4, 1, 4, 1, 16, dict(is_causal=True, causal_alignment="bottom_right", logits_soft_cap=3.0,
                              local_window_size=(90, 0))),
    (48, 5, 3, 3, 3, 32, dict(is_causal=True)),  # a page of three 16-key tiles; MHA; top-left
], ids=["pages16_gqa_sinks", "pages64_mqa_softcap_window", "pages48_mha"])
def test_paged_decode_kernel_matches_the_oracle(page_size, per_sequence, lq, hq, hkv, d, options):
    """Through flash_attention(implementation='pallas_triton', interpret=True): shuffled pages
    (spare ones unread), per-row lengths, judged by torch_ref.paged_attention in float64."""
    rng, q, k_pages, v_pages, table = _pages(page_size + lq, b=2, lq=lq, hq=hq, hkv=hkv, d=d,
                                             page_size=page_size, per_sequence=per_sequence)
    options = dict(options)
    sinks = jnp.asarray(rng.standard_normal(hq), jnp.float32) if options.pop("sinks", False) else None
    capacity = page_size * per_sequence
    lengths = jnp.asarray([capacity - 7, int(rng.integers(lq + 1, capacity // 2))], jnp.int32)
    out = flash_attention(q, k_pages, v_pages, page_table=table, key_value_seq_lengths=lengths,
                          attention_sinks=sinks, implementation="pallas_triton", interpret=True, **options)
    kw = {n: x for n, x in options.items()}
    expected = torch_ref.paged_attention(
        T(q).permute(0, 2, 1, 3), T(k_pages), T(v_pages), torch.tensor(np.asarray(table)),
        key_value_seq_lengths=torch.tensor(np.asarray(lengths)),
        attention_sinks=None if sinks is None else T(sinks), **kw).permute(0, 2, 1, 3).numpy()
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=0)


def test_paged_decode_kernel_reads_pages_in_place():
    """Outside the kernel the traced call gathers nothing and makes no array as large as the
    gathered cache [B, Lk, Hkv, D] other than elementwise ones over the pages (the non-finite
    check): the kernel receives the pages and the table, and picks each tile's page itself."""
    b, hkv, d, page_size, per_sequence = 2, 2, 16, 16, 128  # the runs' partials stay smaller
    _, q, k_pages, v_pages, table = _pages(5, b=b, lq=1, hq=4, hkv=hkv, d=d, page_size=page_size,
                                           per_sequence=per_sequence, spare=5)
    gathered = b * per_sequence * page_size * hkv * d
    jaxpr = jax.make_jaxpr(lambda q, k, v, t: flash_attention(
        q, k, v, page_table=t, implementation="pallas_triton", interpret=True))(q, k_pages, v_pages, table)
    shapes, primitives, kernels = [], set(), []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            primitives.add(eqn.primitive.name)
            shapes.extend(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
            if eqn.primitive.name == "pallas_call":
                kernels.append([tuple(v.aval.shape) for v in eqn.invars])
                continue
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    assert kernels and any(k_pages.shape in shapes for shapes in kernels), kernels
    assert "gather" not in primitives
    assert all(shape == k_pages.shape for shape in shapes if np.prod(shape) >= gathered), \
        sorted(set(shapes), key=np.prod)[-3:]


def test_page_sizes_the_kernel_cannot_tile_run_on_xla():
    """Page sizes that are not multiples of 16 (a key tile lies within one page, Triton's dot
    takes at least 16 keys): refused by name for implementation='pallas_triton', and the
    automatic choice on a GPU takes xla's decode path for them."""
    for page_size, per_sequence in ((1, 64), (24, 4)):
        _, q, k_pages, v_pages, table = _pages(page_size, b=2, lq=1, hq=4, hkv=2, d=16,
                                               page_size=page_size, per_sequence=per_sequence)
        with pytest.raises(ValueError, match=f"page_size={page_size} is not a multiple of 16"):
            flash_attention(q, k_pages, v_pages, page_table=table, implementation="pallas_triton",
                            interpret=True)
        choice = explain_implementation(q, k_pages, v_pages, page_table=table, platform="cuda")
        assert choice.chosen == "xla" and "multiple of 16" in choice.reasons["pallas_triton"]
    _, q, k_pages, v_pages, table = _pages(0, b=2, lq=1, hq=4, hkv=2, d=16, page_size=32, per_sequence=4)
    choice = explain_implementation(q, k_pages, v_pages, page_table=table, platform="cuda")
    assert choice.chosen == "pallas_triton" and choice.path == "decode"


def test_paged_decode_kernel_clamps_traced_page_ids():
    """Under jit a page id past the pages (or negative) reads a clamped page, never out of
    bounds: the answer is the oracle's on the clamped table."""
    _, q, k_pages, v_pages, table = _pages(9, b=2, lq=1, hq=4, hkv=2, d=16, page_size=16, per_sequence=6)
    wild = table.at[0, 2].set(10 ** 6).at[1, 0].set(-3)
    call = jax.jit(lambda t: flash_attention(q, k_pages, v_pages, page_table=t,
                                             implementation="pallas_triton", interpret=True))
    clamped = np.clip(np.asarray(wild), 0, k_pages.shape[0] - 1)
    expected = torch_ref.paged_attention(T(q).permute(0, 2, 1, 3), T(k_pages), T(v_pages),
                                         torch.tensor(clamped)).permute(0, 2, 1, 3).numpy()
    np.testing.assert_allclose(np.asarray(call(wild)), expected, atol=2e-5, rtol=0)
