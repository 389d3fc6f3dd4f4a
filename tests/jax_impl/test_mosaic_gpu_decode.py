"""implementation="mosaic_gpu" on a decode call (few query rows against a long or paged KV
cache): the table gives it pallas_triton's split-K decode kernel, and explain_implementation
says so and why. The table and explain's answers on any jax (the kernel judged available where
jax is older than 0.11); the numbers, with jax >= 0.11, in the Pallas interpreter against the
float64 torch oracle."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_ref
from jax_impl import implementations, kv_cache, mosaic_gpu, pallas_triton
from jax_impl.config import AttentionConfig
from jax_impl.flash_attention import explain_implementation, flash_attention
from jax_impl.call_features import CallFeatures
from jax_impl.masking import MaskSpec
from jax_impl.mosaic_gpu.config import Config

needs_mosaic = pytest.mark.skipif(mosaic_gpu.unavailable() is not None,
                                  reason=f"mosaic_gpu: {mosaic_gpu.unavailable()}")
BF16_DECODE = CallFeatures(AttentionConfig(scale=0.1, mask=MaskSpec(is_causal=True, bottom_right=True)),
                           64, dtype=jnp.bfloat16)


def _draw(seed, *shapes, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


def test_the_entry_decodes_with_pallas_tritons_split_k_kernel():
    impl = implementations.get("mosaic_gpu")
    assert impl.decode is not None and impl.decode_takes_pages
    assert impl.decode_unsupported is pallas_triton.decode_unsupported
    assert impl.pages_unsupported is pallas_triton.pages_unsupported
    assert "pallas_triton's split-K kernel" in impl.decode_note
    assert "mosaic_gpu" in implementations.paged_capable()
    path = lambda **kw: implementations.decode_path(impl, features=BF16_DECODE, **kw)
    assert path(lq=1, lk=65536) is None and path(lq=16, lk=512) is None
    assert path(lq=17, lk=65536).startswith("17 query rows: the decode kernel packs at most 16")
    assert path(lq=1, lk=100) == "100 keys (the decode path starts at 512)"
    pages = lambda page_size: implementations.paged_unsupported(
        impl, lq=1, dtype=jnp.bfloat16, page_size=page_size, head_dim=128)
    assert pages(16) is None and pages(64) is None
    assert "page_size=24 is not a multiple of 16" in pages(24)
    assert "at most 16" in implementations.paged_unsupported(impl, lq=17, dtype=jnp.bfloat16)


def test_explain_says_the_decode_path_is_the_triton_kernel_and_why(monkeypatch):
    """As on jax >= 0.11: a dense decode call and a paged one by name take the decode path, and
    the reason names pallas_triton's split-K kernel; a long query still runs the regular path."""
    monkeypatch.setattr(mosaic_gpu, "_UNAVAILABLE", None)
    q, k = _draw(0, (1, 1, 8, 128), (1, 4096, 2, 128))
    choice = explain_implementation(q, k, k, implementation="mosaic_gpu", platform="cuda",
                                    is_causal=True, causal_alignment="bottom_right")
    assert (choice.chosen, choice.path) == ("mosaic_gpu", "decode"), choice
    assert choice.path_reason == ("1 query rows against 4096 keys, no bias, mask, segment ids or "
                                  f"dropout; {implementations.MOSAIC_GPU_DECODE_NOTE}")
    pages = k.reshape(256, 16, 2, 128)
    paged = explain_implementation(q, pages, pages, implementation="mosaic_gpu", platform="cuda",
                                   page_table=jnp.arange(256, dtype=jnp.int32)[None])
    assert paged.path == "decode" and "pallas_triton's split-K kernel" in paged.path_reason
    long_q = jnp.concatenate([q] * 64, axis=1)
    regular = explain_implementation(long_q, k, k, implementation="mosaic_gpu", platform="cuda")
    assert regular.path == "regular" and "split-K" not in regular.path_reason
    # The automatic choice on a GPU stays pallas_triton (its own kernel: no note).
    auto = explain_implementation(q, k, k, platform="cuda")
    assert (auto.chosen, auto.path) == ("pallas_triton", "decode") and "split-K" not in auto.path_reason


def test_where_the_kernel_is_not_offered_explain_names_the_reason():
    """What this jax says: by name, the call is refused with the reason (jax < 0.11); left to
    the automatic choice, explain answers for a decode call without crashing."""
    q, k = _draw(1, (1, 1, 8, 128), (1, 4096, 2, 128))
    auto = explain_implementation(q, k, k, platform="cuda")
    assert (auto.chosen, auto.path) == ("pallas_triton", "decode")
    why = mosaic_gpu.unavailable()
    if why is None:
        assert explain_implementation(q, k, k, implementation="mosaic_gpu", platform="cuda").path == "decode"
        return
    assert auto.reasons["mosaic_gpu"] == why
    with pytest.raises(ValueError, match=r"implementation='mosaic_gpu' cannot run this call on platform='cuda': "
                                         r"the Mosaic GPU kernel needs jax >= 0\.11"):
        explain_implementation(q, k, k, implementation="mosaic_gpu", platform="cuda")


def _oracle(q, k, v, kv_lengths):
    heads_first = lambda x: torch.tensor(np.asarray(x, np.float64)).permute(0, 2, 1, 3)
    out = torch_ref.manual_attention(heads_first(q), heads_first(k), heads_first(v), is_causal=True,
                                     causal_alignment="bottom_right",
                                     key_value_seq_lengths=torch.tensor(kv_lengths))
    return out.permute(0, 2, 1, 3).numpy()


@needs_mosaic
def test_interpreted_decode_matches_the_oracle_dense_and_paged():
    """B=2, 2 query rows, GQA 4/2, 640 keys (lengths 640 and 300), bf16, with the caller's Mosaic
    tiles: the split-K kernel's result (bitwise pallas_triton's) within bf16 error of float64."""
    b, lq, hq, hkv, lk, d, page_size = 2, 2, 4, 2, 640, 64, 16
    q, k, v = _draw(2, (b, lq, hq, d), (b, lk, hkv, d), (b, lk, hkv, d))
    lengths = np.array([640, 300], np.int32)
    kw = dict(is_causal=True, causal_alignment="bottom_right", key_value_seq_lengths=jnp.asarray(lengths),
              interpret=True)
    out = flash_attention(q, k, v, implementation="mosaic_gpu", block_sizes=Config(), **kw)
    triton = flash_attention(q, k, v, implementation="pallas_triton", **kw)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(triton, np.float32))
    expected = _oracle(q, k, v, lengths)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=2e-2, rtol=2e-2)
    # The same keys in shuffled pages of 16.
    per_sequence = lk // page_size
    table = kv_cache.make_page_table(b, per_sequence, num_pages=b * per_sequence + 3, key=jax.random.key(5))
    pages = lambda x: jnp.zeros((b * per_sequence + 3, page_size, hkv, d), x.dtype).at[
        np.asarray(table).reshape(-1)].set(x.reshape(b * per_sequence, page_size, hkv, d))
    paged = flash_attention(q, pages(k), pages(v), implementation="mosaic_gpu", page_table=table, **kw)
    np.testing.assert_allclose(np.asarray(paged, np.float64), expected, atol=2e-2, rtol=2e-2)
