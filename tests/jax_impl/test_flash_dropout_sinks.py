"""Attention dropout (hashed keep mask) and attention sinks, judged against torch_ref float64.

The oracle gets dropout's pattern only through ``jax_impl.dropout_mask`` (a bool array), and
applies it itself; it shares no code with jax_impl.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _flash_helpers import run_arrays, torch_arrays
from conformance.tolerance import judge
from jax_impl import BlockSizes, dropout_mask
from jax_impl.flash_attention import flash_attention

TINY_BLOCKS = BlockSizes(16, 16, 16, 32, 32, 16)


def _qkv(b=2, lq=40, lk=48, hq=4, hkv=2, d=16, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    draw = lambda *s: rng.standard_normal(s).astype(dtype)
    return draw(b, lq, hq, d), draw(b, lk, hkv, d), draw(b, lk, hkv, d), draw(b, lq, hq, d)


def _assert_judged(results, oracle, plain, dtype):
    assert set(results) <= set(oracle), (sorted(results), sorted(oracle))
    for name in results:
        assert np.all(np.isfinite(results[name])), f"{name} has NaN/inf"
        verdict = judge(name, results[name], oracle[name], plain[name], dtype)
        assert verdict.passed, verdict


def _with_dsinks(implementation, q, k, v, cotangent, sinks, **kwargs):
    """run_arrays plus d sinks (run_arrays differentiates q, k, v, bias only)."""
    results = run_arrays(q, k, v, cotangent, implementation, attention_sinks=sinks, **kwargs)
    extra = {"interpret": True} if implementation == "pallas_triton" else {}
    dsinks = jax.grad(lambda s: jnp.sum(flash_attention(
        q, k, v, implementation=implementation, attention_sinks=s, **extra, **kwargs).astype(jnp.float32)
        * cotangent.astype(jnp.float32)))(sinks)
    return {**results, "dsinks": np.asarray(dsinks, np.float64)}


# --- Dropout: reproducibility -------------------------------------------------------------

DROPOUT = dict(dropout_rate=0.3, deterministic=False, broadcast_dropout=False, is_causal=True)


def _grads(implementation, q, k, v, cotangent, key, **kwargs):
    return run_arrays(q, k, v, cotangent, implementation, dropout_rng=key, **{**DROPOUT, **kwargs})


def test_same_key_gives_bitwise_same_outputs_and_gradients_and_another_key_does_not():
    q, k, v, ct = _qkv()
    first = _grads("xla", q, k, v, ct, jax.random.key(7))
    again = _grads("xla", q, k, v, ct, jax.random.key(7))
    other = _grads("xla", q, k, v, ct, jax.random.key(8))
    for name in first:
        np.testing.assert_array_equal(first[name], again[name], err_msg=name)
        assert np.max(np.abs(first[name] - other[name])) > 1e-2, name


def test_xla_pallas_and_block_sizes_agree_for_the_same_key():
    """One pattern for any tiling and padding (Lq=40, Lk=48 are no multiple of the tiles)."""
    q, k, v, ct = _qkv(seed=1)
    key = jax.random.key(3)
    base = _grads("xla", q, k, v, ct, key)
    variants = {"xla_tiny_blocks": _grads("xla", q, k, v, ct, key, block_sizes=TINY_BLOCKS),
                "pallas_interpret": _grads("pallas_triton", q, k, v, ct, key, block_sizes=TINY_BLOCKS),
                "reference": _grads("reference", q, k, v, ct, key)}
    for variant, results in variants.items():
        for name in base:
            np.testing.assert_allclose(results[name], base[name], rtol=2e-5, atol=2e-5,
                                       err_msg=f"{variant}: {name}")


def test_dropout_reaches_dv_and_dk_alike_when_they_are_two_kernels():
    """dV and dK computed by two kernels (heuristics.split_dkdv: one warp, D=64) apply the
    same dropout pattern as the xla path."""
    q, k, v, ct = _qkv(lq=40, lk=48, d=64, seed=4)
    key = jax.random.key(5)
    base = _grads("xla", q, k, v, ct, key)
    split = _grads("pallas_triton", q, k, v, ct, key,
                   block_sizes=BlockSizes(16, 16, 16, 32, 16, 16, num_warps_bwd=1))
    for name in base:
        np.testing.assert_allclose(split[name], base[name], rtol=2e-5, atol=2e-5, err_msg=name)


def test_deterministic_or_zero_rate_is_exactly_no_dropout():
    q, k, v, _ = _qkv(seed=2)
    plain = flash_attention(q, k, v, implementation="xla")
    for kwargs in (dict(dropout_rate=0.2, deterministic=True, dropout_rng=jax.random.key(0)),
                   dict(dropout_rate=0.0, deterministic=False)):
        np.testing.assert_array_equal(flash_attention(q, k, v, implementation="xla", **kwargs), plain)
    dropped = flash_attention(q, k, v, implementation="xla", dropout_rate=0.2,
                              dropout_rng=jax.random.key(0))  # deterministic=None: Flax's False
    assert np.max(np.abs(np.asarray(dropped) - np.asarray(plain))) > 1e-2


# --- Dropout: the pattern -----------------------------------------------------------------

def test_keep_rate_over_allowed_pairs_is_within_4_binomial_std():
    rate, shape = 0.1, (2, 4, 256, 256)
    keep = np.asarray(dropout_mask(jax.random.key(11), shape, rate, broadcast_dropout=False))
    allowed = np.tril(np.ones(shape[-2:], bool))  # a causal call's allowed pairs
    n = allowed.sum() * shape[0] * shape[1]
    kept = keep[..., allowed].sum()
    z = (kept - n * (1 - rate)) / np.sqrt(n * rate * (1 - rate))
    assert abs(z) < 4, f"keep rate {kept / n:.5f}, z = {z:.2f}"
    # Each (batch, head) has its own pattern; rows and columns are not copies of each other.
    flat = keep.reshape(8, -1)
    assert all(np.mean(flat[a] != flat[b]) > 0.1 for a in range(8) for b in range(a))
    assert np.mean(keep[0, 0, 1:] != keep[0, 0, :-1]) > 0.1
    assert np.mean(keep[0, 0, :, 1:] != keep[0, 0, :, :-1]) > 0.1


def test_broadcast_dropout_shares_the_pattern_across_batch_and_heads():
    keep = np.asarray(dropout_mask(jax.random.key(1), (3, 2, 4, 32, 32), 0.5))
    assert np.all(keep == keep[:1, :1, :1])
    assert 0.3 < keep.mean() < 0.7


def test_mean_over_keys_approaches_the_no_dropout_output_like_one_over_sqrt_n():
    q, k, v, _ = _qkv(b=1, lq=16, lk=16, seed=4)
    attend = jax.jit(lambda key: flash_attention(q, k, v, implementation="xla", dropout_rate=0.2,
                                                 dropout_rng=key, broadcast_dropout=False))
    exact = np.asarray(flash_attention(q, k, v, implementation="xla"), np.float64)
    outs = np.stack([np.asarray(attend(key), np.float64)
                     for key in jax.random.split(jax.random.key(5), 200)])
    rms = lambda n: float(np.sqrt(np.mean((outs[:n].mean(0) - exact) ** 2)))
    errors = {n: rms(n) for n in (12, 50, 200)}
    # The per-sample deviation sets the 1/sqrt(n) curve: err(n) ~ sigma / sqrt(n).
    sigma = float(np.sqrt(np.mean((outs - exact) ** 2)))
    for n, error in errors.items():
        assert 0.6 < error * np.sqrt(n) / sigma < 1.5, (n, error, sigma)
    assert errors[200] < errors[50] < errors[12]


@pytest.mark.parametrize("implementation, dtype", [("xla", "float32"), ("xla", "bfloat16"),
                                                   ("pallas_triton", "float32")])
def test_dropout_matches_torch_ref_with_the_materialised_mask(implementation, dtype):
    np_dtype = jnp.dtype(dtype)
    q, k, v, ct = (x.astype(np_dtype) for x in _qkv(seed=6))
    key, rate = jax.random.key(21), 0.25
    lengths = np.array([40, 29], np.int32)
    kwargs = dict(is_causal=True, causal_alignment="bottom_right", query_seq_lengths=lengths)
    results = run_arrays(q, k, v, ct, implementation, dropout_rng=key, dropout_rate=rate,
                         broadcast_dropout=False, **kwargs)
    mask = np.asarray(dropout_mask(key, (2, 4, 40, 48), rate, broadcast_dropout=False))
    oracle = torch_arrays(q, k, v, ct, dropout_mask=mask, dropout_rate=rate, **kwargs)
    plain = torch_arrays(q, k, v, ct, dtype=np_dtype, dropout_mask=mask, dropout_rate=rate, **kwargs)
    _assert_judged(results, oracle, plain, dtype)


BAD_KEYS = {  # name: (key, error type)
    "python_int": (lambda: 7, TypeError),
    "float_pair": (lambda: np.random.default_rng(1).random(2).astype(np.float32), TypeError),
    "int32_pair": (lambda: np.random.default_rng(2).integers(0, 99, 2, dtype=np.int32), TypeError),
    "raw_key_of_3_words": (lambda: np.random.default_rng(3).integers(0, 99, 3, dtype=np.uint32), ValueError),
    "uint32_scalar": (lambda: np.uint32(5), ValueError),
    "batch_of_typed_keys": (lambda: jax.random.split(jax.random.key(4), 2), ValueError),
    "batch_of_raw_keys": (lambda: jax.random.split(jax.random.PRNGKey(4), 2), ValueError),
}


@pytest.mark.parametrize("bad", BAD_KEYS)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_malformed_dropout_rng_is_refused_by_name(bad, jit):
    q, k, v, _ = _qkv(1, 16, 16, 2, 2, 16, seed=9)
    make_key, error = BAD_KEYS[bad]
    attend = lambda key: flash_attention(q, k, v, dropout_rng=key, **DROPOUT)
    if jit:
        attend = jax.jit(attend)
    with pytest.raises(error, match=r"dropout_rng must be a single PRNG key: a typed key from "
                                    r"jax.random.key \(shape \(\)\) or raw uint32\[2\] key data "
                                    r"from jax.random.PRNGKey; got "):
        attend(make_key())
    with pytest.raises(error, match=r"^rng must be a single PRNG key"):
        dropout_mask(make_key(), (1, 2, 16, 16), 0.3)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_raw_key_drops_as_its_typed_key_does(jit):
    q, k, v, ct = _qkv(1, 24, 32, 2, 1, 16, seed=10)
    typed = jax.random.key(int(np.random.default_rng().integers(2**31)))
    raw = jax.random.key_data(typed)
    assert raw.dtype == jnp.uint32 and raw.shape == (2,)
    rate, kwargs = 0.3, dict(is_causal=True, broadcast_dropout=False)
    attend = lambda key: flash_attention(q, k, v, dropout_rng=key, dropout_rate=rate, **kwargs)
    if jit:
        attend = jax.jit(attend)
    np.testing.assert_array_equal(np.asarray(attend(raw)), np.asarray(attend(typed)))
    mask = np.asarray(dropout_mask(raw, (1, 2, 24, 32), rate, broadcast_dropout=False))
    np.testing.assert_array_equal(mask, np.asarray(dropout_mask(typed, (1, 2, 24, 32), rate,
                                                                broadcast_dropout=False)))
    oracle = torch_arrays(q, k, v, ct, dropout_mask=mask, dropout_rate=rate, is_causal=True)
    np.testing.assert_allclose(np.asarray(attend(raw), np.float64), oracle["out"], atol=2e-5, rtol=0)


# --- Sinks ----------------------------------------------------------------------------------

SINK_CASES = {
    "causal_gqa": dict(is_causal=True),
    "bottom_right_lengths": dict(is_causal=True, causal_alignment="bottom_right",
                                 key_value_seq_lengths=np.array([48, 17], np.int32)),
    "mask_window": dict(local_window_size=(8, 3)),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", SINK_CASES)
def test_sinks_match_the_float64_oracle_xla(case, dtype):
    _check_sinks("xla", case, dtype)


@pytest.mark.parametrize("case", ["bottom_right_lengths"])
def test_sinks_match_the_float64_oracle_pallas(case):
    _check_sinks("pallas_triton", case, "float32", block_sizes=TINY_BLOCKS)


def test_sinks_match_the_float64_oracle_reference():
    _check_sinks("reference", "causal_gqa", "float32")


def _check_sinks(implementation, case, dtype, **options):
    np_dtype = jnp.dtype(dtype)
    q, k, v, ct = (x.astype(np_dtype) for x in _qkv(seed=8))
    sinks = np.random.default_rng(9).standard_normal(4).astype(np.float32) + 1.0
    kwargs = dict(SINK_CASES[case])
    mask = None
    if case == "mask_window":
        mask = np.random.default_rng(10).random((2, 1, 40, 48)) < 0.7
    results = _with_dsinks(implementation, q, k, v, ct, jnp.asarray(sinks), mask=mask, **kwargs,
                           **options)
    oracle = torch_arrays(q, k, v, ct, attention_sinks=sinks.astype(np.float64), mask=mask, **kwargs)
    plain = torch_arrays(q, k, v, ct, dtype=np_dtype, attention_sinks=sinks.astype(np_dtype),
                         mask=mask, **kwargs)
    _assert_judged(results, oracle, plain, dtype)


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton", "reference"])
def test_a_row_with_no_allowed_key_and_a_sink_gives_zero(implementation):
    q, k, v, ct = _qkv(seed=12)
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0])
    lengths = np.array([48, 0], np.int32)  # batch row 1 has no key at all
    extra = {"interpret": True} if implementation == "pallas_triton" else {}
    out, lse = flash_attention(q, k, v, implementation=implementation, attention_sinks=sinks,
                               key_value_seq_lengths=lengths, return_residual=True, **extra)
    assert np.all(np.asarray(out[1]) == 0)
    np.testing.assert_allclose(np.asarray(lse[1]), np.broadcast_to(sinks, (40, 4)), rtol=1e-6)
    assert np.all(np.isfinite(np.asarray(lse)))
    results = _with_dsinks(implementation, q, k, v, ct, sinks, key_value_seq_lengths=lengths)
    oracle = torch_arrays(q, k, v, ct, attention_sinks=np.asarray(sinks, np.float64),
                          key_value_seq_lengths=lengths)
    for name in results:
        np.testing.assert_allclose(results[name], oracle[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_per_batch_sinks_and_dropout_together_match_the_oracle():
    q, k, v, ct = _qkv(seed=13)
    sinks = np.random.default_rng(14).standard_normal((2, 4)).astype(np.float32)
    key, rate = jax.random.key(2), 0.2
    results = _with_dsinks("xla", q, k, v, ct, jnp.asarray(sinks), dropout_rng=key, dropout_rate=rate)
    mask = np.asarray(dropout_mask(key, (2, 4, 40, 48), rate))
    oracle = torch_arrays(q, k, v, ct, attention_sinks=sinks.astype(np.float64),
                          dropout_mask=mask, dropout_rate=rate)
    plain = torch_arrays(q, k, v, ct, dtype=np.float32, attention_sinks=sinks, dropout_mask=mask,
                         dropout_rate=rate)
    _assert_judged(results, oracle, plain, "float32")


# --- Through the conformance harness's cases (identical dropout pattern on both sides) -------

from conformance.cases import get_suite  # noqa: E402
from _flash_helpers import assert_judged_correct, baseline, oracle, run  # noqa: E402

TRAINING = {case.name: case for case in get_suite("training")}


@pytest.mark.parametrize("name", TRAINING)
def test_training_conformance_case_passes_xla(name):
    case = TRAINING[name]
    extra = dict(dropout_rng=jax.random.key(case.seed), broadcast_dropout=False) if case.dropout else {}
    results = run(case, jnp.dtype(case.dtype), "xla", **extra)
    assert_judged_correct(results, {n: x for n, x in oracle(case).items() if n in results},
                          baseline(case), case.dtype)


def test_pallas_triton_hashes_dropout_at_the_ring_offset():
    """The ring hands each step ``dropout_offset`` = the global (query, key) index of its local
    (0, 0); the kernels (forward, dK/dV, dQ) must draw that slice of the one-device pattern.
    Judged against torch_ref float64 given the global mask's slice."""
    from jax_impl import arguments, pallas_triton

    q, k, v, ct = _qkv(b=2, lq=24, lk=40, hq=4, hkv=2, d=16, seed=9)
    key, rate, (q0, k0) = jax.random.key(31), 0.3, (300, 57)
    call = arguments.validate(q, k, v, dropout_rng=key, dropout_rate=rate, is_causal=True,
                              causal_alignment="bottom_right", broadcast_dropout=False,
                              implementation="pallas_triton", interpret=True,
                              block_sizes=TINY_BLOCKS)
    extras = call.extras._replace(dropout_offset=jnp.asarray((q0, k0), jnp.int32))
    qj, kj, vj, ctj = map(jnp.asarray, (q, k, v, ct))
    out, stats = pallas_triton.forward(call.cfg, qj, kj, vj, None, call.masks, extras)
    delta = jnp.einsum("bqhd,bqhd->bhq", ctj, out)
    dq, dk, dv, _, _ = pallas_triton.backward(call.cfg, qj, kj, vj, None, call.masks, stats, ctj,
                                           delta, extras)
    results = {name: np.asarray(x, np.float64) for name, x in
               dict(out=out, dq=dq, dk=dk, dv=dv).items()}
    full = dropout_mask(key, (2, 4, q0 + 24, k0 + 40), rate, broadcast_dropout=False)
    mask = np.asarray(full)[:, :, q0:, k0:]
    kwargs = dict(is_causal=True, causal_alignment="bottom_right", dropout_mask=mask,
                  dropout_rate=rate)
    oracle = torch_arrays(q, k, v, ct, **kwargs)
    plain = torch_arrays(q, k, v, ct, dtype=np.float32, **kwargs)
    _assert_judged(results, oracle, plain, "float32")
    unshifted = np.asarray(pallas_triton.forward(call.cfg, qj, kj, vj, None, call.masks,
                                                 call.extras)[0])
    assert np.max(np.abs(unshifted - results["out"])) > 1e-2  # the offset changes the pattern
