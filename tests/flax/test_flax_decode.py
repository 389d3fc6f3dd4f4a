"""KV-cache decoding: linen ``decode=True`` with flash_attention, a query block against a long
cache (``causal_alignment="bottom_right"`` + ``key_value_seq_lengths``), and a structural check
that a decode step allocates no [Lcache, Lcache] buffer."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from _flax_attn_helpers import FEATURES, linen_mha, random_inputs
from conformance.tolerance import judge
from jax_impl.flash_attention import flash_attention


def _decode_steps(attention_fn, params, cache, xs):
    """Feed xs [B, T, F] one position at a time through a decode=True module; outputs [B, T, F]."""
    module = linen_mha(attention_fn, decode=True)

    @jax.jit
    def step(cache, x_t):
        out, mutated = module.apply({"params": params, "cache": cache}, x_t, mutable=["cache"])
        return mutated["cache"], out

    outs = []
    for t in range(xs.shape[1]):
        cache, out = step(cache, xs[:, t:t + 1])
        outs.append(out)
    return jnp.concatenate(outs, axis=1), cache


def test_linen_decode_matches_default_attention_step_by_step():
    max_len, steps = 16, 6
    xs, _ = random_inputs(21, (2,), max_len, max_len)
    variables = jax.jit(linen_mha(decode=True).init)(jax.random.PRNGKey(22), xs)
    params, cache = variables["params"], variables["cache"]
    assert cache["cached_key"].shape == (2, max_len, 4, 16)
    flash_out, flash_cache = _decode_steps(flash_attention, params, cache, xs[:, :steps])
    default_out, _ = _decode_steps(nn.dot_product_attention, params, cache, xs[:, :steps])
    assert int(flash_cache["cache_index"]) == steps
    # Two float32 forward passes of the same math (the float64-oracle verdicts live in
    # test_flax_attention_fn.py); 1e-5 is float32 rounding over a 16-long softmax and 3 Denses.
    np.testing.assert_allclose(flash_out, default_out, rtol=1e-5, atol=1e-5)
    # And decode is causal attention one row at a time: the same rows as one full causal pass.
    full = linen_mha(flash_attention).apply({"params": params}, xs[:, :steps],
                                            mask=nn.make_causal_mask(jnp.ones((2, steps))))
    np.testing.assert_allclose(flash_out, full, rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(flash_out[:, 1:] - flash_out[:, :1]))) > 1e-2  # steps differ


def _dense_float64(q, k, v, kv_len):
    """Independent numpy oracle: query i of Lq may see key j when j < kv_len[b] and
    j <= i + kv_len[b] - Lq (the last query aligned with the last valid key)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, lq, hq, d = q.shape
    k = np.repeat(k, hq // k.shape[2], axis=2)
    v = np.repeat(v, hq // v.shape[2], axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    i = np.arange(lq)[:, None]
    j = np.arange(k.shape[1])[None, :]
    allowed = (j[None] < kv_len[:, None, None]) & (j[None] <= i[None] + kv_len[:, None, None] - lq)
    logits = np.where(allowed[:, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("lq", [1, 4])
def test_query_block_against_long_cache_bottom_right(lq):
    cache_len, hq, hkv, d = 512, 4, 2, 16
    keys = jax.random.split(jax.random.PRNGKey(lq), 3)
    q = jax.random.normal(keys[0], (2, lq, hq, d), jnp.float32)
    k = jax.random.normal(keys[1], (2, cache_len, hkv, d), jnp.float32)
    v = jax.random.normal(keys[2], (2, cache_len, hkv, d), jnp.float32)
    kv_len = np.array([137, cache_len], np.int32)  # a part-filled cache and a full one

    def attend(implementation):
        return jax.jit(lambda q, k, v, n: flash_attention(
            q, k, v, is_causal=True, causal_alignment="bottom_right", key_value_seq_lengths=n,
            implementation=implementation))(q, k, v, kv_len)

    oracle = _dense_float64(q, k, v, kv_len)
    verdict = judge("out", attend(None), oracle, attend("reference"), "float32")
    assert verdict.passed, verdict
    # The cache past kv_len must not leak in: poisoning it changes nothing.
    k_bad = k.at[0, kv_len[0]:].set(1e4)
    poisoned = jax.jit(lambda k: flash_attention(
        q, k, v, is_causal=True, causal_alignment="bottom_right",
        key_value_seq_lengths=kv_len))(k_bad)
    np.testing.assert_array_equal(np.asarray(poisoned), np.asarray(attend(None)))


_SHAPE = re.compile(r"\b[a-z]+[0-9]*\[([0-9,]+)\]")


def _largest_buffer(compiled_hlo: str) -> int:
    """Element count of the largest array shape anywhere in the compiled HLO."""
    return max(int(np.prod([int(n) for n in dims.split(",")]))
               for dims in _SHAPE.findall(compiled_hlo))


def test_decode_step_allocates_no_square_score_buffer():
    cache_len, batch = 512, 2
    square = cache_len * cache_len
    xs, _ = random_inputs(31, (batch,), cache_len, cache_len)
    variables = jax.jit(linen_mha(decode=True).init)(jax.random.PRNGKey(32), xs)

    def decode_hlo(attention_fn):
        module = linen_mha(attention_fn, decode=True)
        step = jax.jit(lambda v, x_t: module.apply(v, x_t, mutable=["cache"]))
        return step.lower(variables, xs[:, :1]).compile().as_text()

    flash_largest = _largest_buffer(decode_hlo(flash_attention))
    # The cache itself ([B, Lcache, H, D]) is the largest thing a decode step needs.
    assert flash_largest <= batch * cache_len * FEATURES < square, flash_largest
    # Positive control: the detector sees Flax's dense [B, H, L, L] scores in a full pass.
    dense = linen_mha(nn.dot_product_attention)
    full_hlo = jax.jit(lambda x: dense.apply({"params": variables["params"]}, x,
                                             mask=nn.make_causal_mask(x[..., 0]))
                       ).lower(xs).compile().as_text()
    assert _largest_buffer(full_hlo) >= square
