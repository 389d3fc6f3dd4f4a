"""Inputs an adversarial user tried, each once silently wrong: every one now right or refused.

B=2, L=32, H=4, D=16 unless said; every result is judged against torch_ref in float64.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conformance import tolerance
from jax_impl import BlockSizes, explain_implementation, kv_cache
from jax_impl.flash_attention import flash_attention
from jax_impl.pallas_triton import heuristics
from _flash_helpers import run_arrays, torch_arrays

BLOCKED = ["xla", "pallas_triton"]
ALL = BLOCKED + ["reference"]
B, L, H, D = 2, 32, 4, 16


def _inputs(seed, shape=(B, L, H, D)):
    rng = np.random.default_rng(seed)
    q, k, v, ct = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    return rng, q, k, v, ct


def _assert_matches_oracle(results, reference, plain, dtype="float32"):
    for name in results:
        assert np.all(np.isfinite(results[name])), f"{name}: {np.sum(~np.isfinite(results[name]))} NaN/inf"
        verdict = tolerance.judge(name, results[name], reference[name], plain[name], dtype)
        assert verdict.passed, verdict


def _judge(implementation, q, k, v, ct, **kwargs):
    results = run_arrays(q, k, v, ct, implementation, **kwargs)
    kwargs.pop("jit_lengths", None)
    _assert_matches_oracle(results, torch_arrays(q, k, v, ct, **kwargs),
                           torch_arrays(q, k, v, ct, dtype=np.float32, **kwargs))
    return results


# --- 1. a query row whose additive bias is entirely -inf (the additive padding mask) ---------

@pytest.mark.parametrize("implementation", ALL)
def test_neg_inf_bias_rows_give_zero_rows_and_finite_gradients(implementation):
    rng, q, k, v, ct = _inputs(0)
    bias = rng.standard_normal((B, H, L, L)).astype(np.float32)
    bias[0, 1, [3, 17]] = -np.inf
    bias[1, :, 5] = -np.inf
    bias[1, 2, 9, ::2] = -np.inf  # a partly -inf row stays a normal row
    results = _judge(implementation, q, k, v, ct, bias=bias)
    assert np.all(results["out"][0, [3, 17], 1] == 0) and np.all(results["out"][1, 5] == 0)
    assert np.all(results["dq"][0, [3, 17], 1] == 0)


def test_the_oracle_itself_has_no_nan_for_neg_inf_bias_rows():
    rng, q, k, v, ct = _inputs(1)
    bias = np.zeros((B, H, L, L), np.float32)
    bias[0, 0, 4] = -np.inf
    reference = torch_arrays(q, k, v, ct, bias=bias)
    assert all(np.all(np.isfinite(x)) for x in reference.values())
    assert np.all(reference["out"][0, 4, 0] == 0) and np.any(reference["out"][0, 5, 0] != 0)


# --- 2. a row fully masked by a huge finite negative bias ------------------------------------

@pytest.mark.parametrize("implementation", BLOCKED)
@pytest.mark.parametrize("magnitude", [-1e9, float(np.finfo(np.float32).min)])
def test_huge_negative_bias_rows_get_the_exact_gradient(implementation, magnitude):
    rng, q, k, v, ct = _inputs(2)
    bias = rng.standard_normal((B, H, L, L)).astype(np.float32)
    bias[0, 1, [3, 17]] = magnitude
    bias[1, :, 5] = magnitude + bias[1, :, 5]
    results = _judge(implementation, q, k, v, ct, bias=bias)
    # The plain fp32 dense computation sees the same rounded logits: a blocked one must agree
    # with it closely, not merely within the (wide) float64 tolerance of this ill-posed row.
    plain = torch_arrays(q, k, v, ct, dtype=np.float32, bias=bias)
    for name in ("out", "dq", "dk", "dv"):
        np.testing.assert_allclose(results[name], plain[name], atol=2e-5 * max(1, np.abs(plain[name]).max()))


# --- 3. lengths past the sequence, traced under jit ------------------------------------------

LONG_LENGTHS = [
    dict(key_value_seq_lengths=[40, 40]),
    dict(query_seq_lengths=[40, 32], key_value_seq_lengths=[32, 32], is_causal=True),
    dict(key_value_seq_lengths=[40, 20], query_seq_lengths=[32, 32], is_causal=True,
         causal_alignment="bottom_right"),
    dict(key_value_seq_lengths=[2**31 - 1, 5], query_seq_lengths=[2**31 - 1, 2**31 - 1],
         is_causal=True, causal_alignment="bottom_right", local_window_size=(4, 2)),
]


@pytest.mark.parametrize("implementation", ALL)
@pytest.mark.parametrize("kwargs", LONG_LENGTHS, ids=range(len(LONG_LENGTHS)))
def test_traced_lengths_past_the_sequence_mean_the_whole_sequence(implementation, kwargs):
    rng, q, k, v, ct = _inputs(3)
    traced = {n: np.asarray(x, np.int32) if "lengths" in n else x for n, x in kwargs.items()}
    clamped = {n: np.minimum(x, L) if "lengths" in n else x for n, x in traced.items()}
    results = run_arrays(q, k, v, ct, implementation, jit_lengths=True, **traced)
    _assert_matches_oracle(results, torch_arrays(q, k, v, ct, **clamped),
                           torch_arrays(q, k, v, ct, dtype=np.float32, **clamped))
    same = run_arrays(q, k, v, ct, implementation, **clamped)
    for name in results:
        np.testing.assert_allclose(results[name], same[name], rtol=0, atol=1e-6)


def test_concrete_int64_lengths_do_not_wrap_before_the_range_check():
    _, q, k, v, _ = _inputs(4)
    with pytest.raises(ValueError, match="key_value_seq_lengths must lie in"):
        flash_attention(q, k, v, key_value_seq_lengths=np.array([2**33, 3], np.int64))


# --- 4. non-finite values at keys and queries that take no part ------------------------------

@pytest.mark.parametrize("implementation", ALL)
@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_nonfinite_values_at_excluded_positions_never_reach_the_result(implementation, poison):
    rng, q, k, v, ct = _inputs(5)
    kv_len, q_len = np.array([20, 27], np.int32), np.array([32, 25], np.int32)
    mask = np.ones((B, 1, 1, L), bool)
    mask[0, ..., [2, 11]] = False  # key padding inside the valid length
    clean = (q.copy(), k.copy(), v.copy())
    for x in (k, v):
        x[0, 20:], x[1, 27:] = poison, poison     # past the kv length: an uninitialised KV cache
        x[0, [2, 11]] = poison                    # masked out in every row
    q[1, 25:] = poison                            # past the query length
    kwargs = dict(mask=mask, key_value_seq_lengths=kv_len, query_seq_lengths=q_len, is_causal=True,
                  causal_alignment="bottom_right")
    results = _judge(implementation, q, k, v, ct, **kwargs)
    unpoisoned = run_arrays(*clean, ct, implementation, **kwargs)
    for name in results:
        np.testing.assert_allclose(results[name], unpoisoned[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("implementation", ALL)
def test_a_nan_at_an_allowed_pair_still_gives_nan_in_that_row(implementation):
    """The rule above must not hide a real NaN: it reaches exactly the rows that attend it."""
    rng, q, k, v, ct = _inputs(6)
    v[0, 7, 2, 3] = np.nan
    results = run_arrays(q, k, v, ct, implementation, is_causal=True)
    out = results["out"]
    assert np.all(np.isnan(out[0, 7:, 2]).any(axis=-1)), "rows 7.. attend key 7"
    assert np.all(np.isfinite(out[0, :7])) and np.all(np.isfinite(out[1])) and np.all(np.isfinite(out[0, :, 3]))
    # The gradients too (the Pallas dQ kernel reads finite copies of k and v and relies on the
    # NaN that delta = rowsum(dO * O) carries for exactly these rows).
    dq = results["dq"]
    assert np.all(np.isnan(dq[0, 7:, 2]).any(axis=-1)), "dq: rows 7.. attend key 7"
    assert np.all(np.isfinite(dq[0, :7])) and np.all(np.isfinite(dq[1])) and np.all(np.isfinite(dq[0, :, 3]))


@pytest.mark.parametrize("implementation", ALL)
@pytest.mark.parametrize("poison", [-np.inf, np.nan])
def test_a_nonfinite_key_reaches_the_dq_of_every_row_that_attends_it(implementation, poison):
    """dq_r sums dS_rc * k_c over the keys row r attends, so a non-finite k_c makes it NaN even
    where S_rc = -inf gives P_rc = 0 (0 * inf), on interior tiles too (no mask here)."""
    rng, q, k, v, ct = _inputs(8)
    k[0, 5, 1, 0] = poison
    dq = run_arrays(q, k, v, ct, implementation)["dq"]
    assert np.all(np.isnan(dq[0, :, 1]).any(axis=-1)), "every row attends key 5"
    assert np.all(np.isfinite(dq[1])) and np.all(np.isfinite(np.delete(dq[0], 1, axis=1)))


# --- 5b. the exact NaN pattern of the non-finite rule, masked and unmasked tiles ---------------
# The oracle's rule (torch_ref.manual_attention, docs/semantics.md): a pair whose query row or key
# row (K or V) holds a non-finite value has a NaN logit, which counts only where the pair is
# allowed; P and dS are exactly 0 at every other pair, also in a NaN row; products read the
# non-finite entries as 0 (their own gradient is 0). Every output and gradient must have the
# oracle's NaNs exactly, and its finite values within tolerance. 16-wide tiles over L=64, so
# that the blocked paths run unmasked interior tiles and masked edge tiles; the split variant
# computes dV and dK in two kernels (heuristics.split_dkdv), as D=256 does by default.

RULE_D = 32
RULE_VARIANTS = {
    "reference": dict(implementation="reference"),
    "xla": dict(implementation="xla", block_sizes=BlockSizes(16, 16)),
    "pallas_triton": dict(implementation="pallas_triton", block_sizes=BlockSizes(16, 16, 16, 16, 16, 16)),
    "pallas_triton-split-dkdv": dict(implementation="pallas_triton",
                                     block_sizes=BlockSizes(16, 16, 16, 64, 16, 16, num_warps_bwd=1)),
}
assert heuristics.split_dkdv(RULE_D, RULE_VARIANTS["pallas_triton-split-dkdv"]["block_sizes"])


def _assert_oracle_nan_pattern(variant, q, k, v, ct, **kwargs):
    """Runs the variant; every result has the oracle's NaNs exactly and is judged elsewhere."""
    options = dict(RULE_VARIANTS[variant])
    results = run_arrays(q, k, v, ct, options.pop("implementation"), **options, **kwargs)
    reference = torch_arrays(q, k, v, ct, **kwargs)
    plain = torch_arrays(q, k, v, ct, dtype=np.float32, **kwargs)
    for name in results:
        nan = np.isnan(reference[name])
        np.testing.assert_array_equal(np.isnan(results[name]), nan, err_msg=f"{variant} {name}: NaN pattern")
        assert np.all(np.isfinite(results[name][~nan])), f"{name}: inf where the oracle is finite"
        verdict = tolerance.judge(name, results[name][~nan], reference[name][~nan], plain[name][~nan],
                                  "float32")
        assert verdict.passed, verdict
    return reference


@pytest.mark.parametrize("variant", RULE_VARIANTS)
@pytest.mark.parametrize("where, poison", [("k", np.inf), ("k", -np.inf), ("v", np.nan)],
                         ids=["k-inf", "k-neg-inf", "v-nan"])
def test_a_nonfinite_key_without_any_mask_makes_every_row_nan(variant, where, poison):
    """No mask at all (every tile unmasked): every row attends key 3, so every row is NaN, with
    every gradient. IEEE arithmetic alone would leave the rows whose q.k_3 is -inf finite
    (P = 0), and a NaN in one entry of v_3 only that column of the output."""
    rng, q, k, v, ct = _inputs(20, (2, 64, 2, RULE_D))
    {"k": k, "v": v}[where][0, 3, 0, 0] = poison
    reference = _assert_oracle_nan_pattern(variant, q, k, v, ct)
    assert np.isnan(reference["out"][0, :, 0]).all() and np.isfinite(reference["out"][1]).all()


@pytest.mark.parametrize("variant", RULE_VARIANTS)
def test_a_nan_query_row_reaches_only_the_keys_it_attends(variant):
    """Causal: query 40's NaN makes its row, its dq (0 at the NaN entry itself) and dk, dv of
    keys 0..40 NaN; keys 41.. take no part in row 40 (dS = 0 there, though the row's delta is
    NaN: 0 * NaN must not reach them), so their gradients stay finite."""
    rng, q, k, v, ct = _inputs(21, (2, 64, 2, RULE_D))
    q[0, 40, 1, 5] = np.nan
    reference = _assert_oracle_nan_pattern(variant, q, k, v, ct, is_causal=True)
    attends = np.arange(64) <= 40
    for name in ("dk", "dv"):
        np.testing.assert_array_equal(np.isnan(reference[name][0, :, 1]).any(-1), attends)


@pytest.mark.parametrize("variant", RULE_VARIANTS)
@pytest.mark.parametrize("soft_cap", [None, 5.0], ids=["no-cap", "soft-cap"])
def test_a_nan_value_at_an_allowed_key_beside_poison_at_excluded_keys(variant, soft_cap):
    """A NaN in v at key 9, which rows 9.. attend (causal), in a call whose excluded positions
    hold NaN and inf too (past the lengths, at masked keys; whole rows and single entries): the
    NaN reaches exactly the rows that attend key 9 and their keys' gradients; the excluded
    poison reaches nothing, not even through the soft cap's derivative (a kernel that folds a
    row's poison into its operand has a NaN cap term at every pair of that row)."""
    rng, q, k, v, ct = _inputs(22, (2, 64, 2, RULE_D))
    kv_len, q_len = np.array([50, 64], np.int32), np.array([64, 45], np.int32)
    mask = np.ones((2, 1, 1, 64), bool)
    mask[:, ..., [4, 21]] = False
    k[0, 50:], v[0, 56:] = np.inf, np.nan       # past the kv length: whole rows
    k[0, 53, 1, 7], v[0, 51, 0, 2] = np.nan, -np.inf  # ... and single entries
    k[:, 4, 1, 3], v[:, 21, 0, 5] = -np.inf, np.nan   # masked out in every row
    q[1, 50:], q[1, 47, 0, 1] = np.inf, np.nan        # past the query length
    v[0, 9, 1, 3] = np.nan
    reference = _assert_oracle_nan_pattern(
        variant, q, k, v, ct, mask=mask, is_causal=True, key_value_seq_lengths=kv_len,
        query_seq_lengths=q_len, logits_soft_cap=soft_cap)
    assert np.isnan(reference["out"][0, 9:50, 1]).any(-1).all() and not np.isnan(reference["out"][1]).any()
    assert not np.isnan(reference["dk"][1]).any() and not np.isnan(reference["dq"][1]).any()


@pytest.mark.parametrize("variant", RULE_VARIANTS)
def test_an_additive_neg_inf_bias_excludes_its_keys_from_a_nan_row_gradient(variant):
    """Keys 48.. masked by an additive -inf bias (an additive padding mask) and a NaN in v at
    key 5, which every row attends: every row is NaN, yet keys 48.. take part in none, so their
    dk, dv and dbias stay finite (P = 0 at a -inf logit, and dS exactly 0 there, not 0 * NaN)."""
    rng, q, k, v, ct = _inputs(23, (2, 64, 2, RULE_D))
    bias = rng.standard_normal((2, 2, 64, 64)).astype(np.float32)
    bias[..., 48:] = -np.inf
    v[0, 5, 1, 3] = np.nan
    reference = _assert_oracle_nan_pattern(variant, q, k, v, ct, bias=bias)
    assert np.isnan(reference["dk"][0, :48, 1]).any(-1).all() and np.isfinite(reference["dk"][0, 48:]).all()
    assert np.isfinite(reference["dbias"][0, 1, :, 48:]).all()


# --- 5c. huge logits: the row max cancels exactly ----------------------------------------------
# q, k ~ N(0, 1) * sqrt(magnitude), D = 16, scale 1/4: the logits S = q.k / 4 are of order
# `magnitude`, far apart, so each row's softmax is one-hot. The float32 exponent
# S log2(e) - max log2(e) rounds its two terms apart (hundreds at 1e9): P of the max must come
# out exactly 1, forward (else inf or 0: NaN, an empty row) and backward (else dv is off).
# Up to the dtype's limit: float16 q and k near its largest values, bfloat16 logits near
# float32's.

HUGE_D = 16
HUGE = [("float32", 1e3), ("float32", 1e6), ("float32", 1e9), ("float16", 1e8),
        ("bfloat16", 1e9), ("bfloat16", 1e36)]
HUGE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
HUGE_VARIANTS = {
    "reference": dict(implementation="reference"),
    "xla": dict(implementation="xla", block_sizes=BlockSizes(16, 16)),
    "pallas_triton": dict(implementation="pallas_triton", block_sizes=BlockSizes(16, 16, 16, 16, 16, 16)),
    "cpu": dict(implementation="cpu"),
}


def _huge_inputs(seed, dtype, magnitude, q_shape, kv_shape):
    rng = np.random.default_rng(seed)
    draw = lambda shape, size: (rng.standard_normal(shape) * size).astype(HUGE_DTYPES[dtype])
    size = np.sqrt(magnitude)
    return rng, draw(q_shape, size), draw(kv_shape, size), draw(kv_shape, 1.0), draw(q_shape, 1.0)


def _assert_huge_logits_match_oracle(results, reference, plain, dtype, q, k, v, ct):
    """No non-finite value, and within conformance's tolerance; for dq and dk that tolerance
    gets a float32 floor. At a one-hot row dS = P (dP - delta) is the difference of two
    float32 sums of the same products dO . v (delta = rowsum(dO * O) is summed outside the
    kernels), which may round apart by D ulps: dq, dk = scale dS k reach scale |k| times that,
    where the float64 oracle's dS cancels exactly (the plain 16-bit baseline's too)."""
    largest = lambda *xs: max(float(np.abs(np.asarray(x, np.float64)).max()) for x in xs)
    rounding = HUGE_D * np.finfo(np.float32).eps * HUGE_D ** -0.5 * largest(q, k) * \
        HUGE_D * largest(ct) * largest(v)
    for name in results:
        bad = ~np.isfinite(results[name])
        assert not bad.any(), f"{name}: {bad.sum()} NaN/inf"
        verdict = tolerance.judge(name, results[name], reference[name], plain[name], dtype)
        floor = rounding if name in ("dq", "dk") else 0.0
        assert verdict.passed or verdict.error <= floor, (verdict, floor)


@pytest.mark.parametrize("variant", HUGE_VARIANTS)
@pytest.mark.parametrize("dtype, magnitude", HUGE, ids=[f"{d}-{m:.0e}" for d, m in HUGE])
def test_huge_logits_give_the_oracles_output_and_gradients(variant, dtype, magnitude):
    """Causal, GQA, two 16-wide tiles each way (a row max that grows from tile to tile)."""
    _, q, k, v, ct = _huge_inputs(30, dtype, magnitude, (1, 32, 2, HUGE_D), (1, 32, 1, HUGE_D))
    options = dict(HUGE_VARIANTS[variant])
    results = run_arrays(q, k, v, ct, options.pop("implementation"), is_causal=True, **options)
    _assert_huge_logits_match_oracle(results, torch_arrays(q, k, v, ct, is_causal=True),
                                     torch_arrays(q, k, v, ct, dtype=HUGE_DTYPES[dtype], is_causal=True),
                                     dtype, q, k, v, ct)


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton", "cpu"])
def test_huge_logits_on_the_decode_path(implementation):
    """Two query rows of 4 heads against 512 keys: the decode path (split over the keys, runs
    merged), its output alone and with gradients (differentiated, the regular forward runs, so
    the backward recomputes the same logits)."""
    dtype = "float32"
    _, q, k, v, ct = _huge_inputs(31, dtype, 1e9, (1, 2, 4, HUGE_D), (1, 512, 2, HUGE_D))
    kwargs = dict(is_causal=True, causal_alignment="bottom_right")
    extra = {"interpret": True} if implementation == "pallas_triton" else {}
    assert explain_implementation(q, k, v, implementation=implementation, **extra, **kwargs).path == "decode"
    expected = torch_arrays(q, k, v, ct, **kwargs)
    out = np.asarray(flash_attention(q, k, v, implementation=implementation, **extra, **kwargs), np.float64)
    np.testing.assert_allclose(out, expected["out"], rtol=0, atol=float(np.finfo(np.float32).eps))
    results = run_arrays(q, k, v, ct, implementation, **kwargs)
    _assert_huge_logits_match_oracle(results, expected,
                                     torch_arrays(q, k, v, ct, dtype=HUGE_DTYPES[dtype], **kwargs),
                                     dtype, q, k, v, ct)


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton", "cpu"])
def test_huge_logits_on_a_paged_cache(implementation):
    """bfloat16 logits near float32's limit, pages of 16 slots, shuffled; judged by the oracle
    on the gathered dense cache."""
    dtype, magnitude = "bfloat16", 1e36
    _, q, k_pages, v_pages, ct = _huge_inputs(32, dtype, magnitude, (2, 1, 4, HUGE_D), (7, 16, 2, HUGE_D))
    table = np.asarray(kv_cache.make_page_table(2, 3, num_pages=7, key=jax.random.key(32)))
    extra = {"interpret": True} if implementation == "pallas_triton" else {}
    out = flash_attention(q, k_pages, v_pages, page_table=table, implementation=implementation, **extra)
    gathered = lambda pages: pages[table].reshape(2, 3 * 16, 2, HUGE_D)
    expected = torch_arrays(q, gathered(k_pages), gathered(v_pages), ct)["out"]
    out = np.asarray(out, np.float64)
    assert np.all(np.isfinite(out)), f"{np.sum(~np.isfinite(out))} NaN/inf"
    np.testing.assert_allclose(out, expected, rtol=0, atol=float(np.finfo(HUGE_DTYPES[dtype]).eps))


# --- 6. every JAX transformation of the default implementation -------------------------------

def test_default_implementation_survives_vmap_scan_remat_and_grad():
    _, q, *_ = _inputs(7, (3, 2, 16, 2, 16))
    f = lambda x: flash_attention(x, x, x, is_causal=True)
    loss = lambda x: jnp.sum(f(x) ** 2)
    per_example = np.stack([np.asarray(jax.grad(loss)(x)) for x in q])
    np.testing.assert_allclose(jax.vmap(f)(q), np.stack([f(x) for x in q]), atol=1e-6)
    np.testing.assert_allclose(jax.vmap(jax.grad(loss))(q), per_example, atol=1e-5)
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.grad(jax.checkpoint(loss))))(q), per_example, atol=1e-5)
    scanned = jax.grad(lambda xs: jax.lax.scan(lambda c, x: (c + loss(x), None), 0.0, xs)[0])(q)
    np.testing.assert_allclose(scanned, per_example, atol=1e-5)


# --- obscure errors become results or clear messages -----------------------------------------

@pytest.mark.parametrize("implementation", [None] + ALL)
def test_batch_size_zero_gives_an_empty_result(implementation):
    extra = {"interpret": True} if implementation == "pallas_triton" else {}
    x = jnp.zeros((0, 8, 2, 16))
    out, lse = flash_attention(x, x, x, implementation=implementation, return_residual=True, **extra)
    assert out.shape == (0, 8, 2, 16) and lse.shape == (0, 8, 2)
    grad = jax.grad(lambda x: flash_attention(x, x, x, implementation=implementation, **extra).sum())(x)
    assert grad.shape == x.shape


@pytest.mark.parametrize("implementation", [None, "xla", "pallas_triton"])
def test_second_order_derivatives_say_which_implementation_supports_them(implementation):
    extra = {"interpret": True} if implementation == "pallas_triton" else {}
    _, q, *_ = _inputs(8, (1, 8, 2, 16))
    inner = jax.grad(lambda x: flash_attention(x, x, x, implementation=implementation, **extra).sum())
    with pytest.raises(NotImplementedError, match="first-order VJP.*implementation='reference'"):
        jax.grad(lambda x: inner(x).sum())(q)
    reference = jax.grad(lambda x: flash_attention(x, x, x, implementation="reference").sum())
    assert np.all(np.isfinite(jax.grad(lambda x: reference(x).sum())(q)))


@pytest.mark.parametrize("kwargs, match", [
    (dict(logits_soft_cap="5"), "logits_soft_cap='5' must be None or a positive finite Python float"),
    (dict(local_window_size=2.5), "local_window_size=2.5 must be an int"),
    (dict(local_window_size=True), "local_window_size=True must be an int"),
    (dict(local_window_size=(1, 2.0)), r"local_window_size=\(1, 2.0\) must be an int"),
])
def test_static_arguments_of_the_wrong_kind_are_refused_by_name(kwargs, match):
    _, q, *_ = _inputs(9, (1, 8, 2, 16))
    with pytest.raises(ValueError, match=match):
        flash_attention(q, q, q, **kwargs)


def test_a_traced_soft_cap_is_refused_like_a_traced_scale():
    _, q, *_ = _inputs(10, (1, 8, 2, 16))
    with pytest.raises(ValueError, match=r"logits_soft_cap=.* \(it is static"):
        jax.jit(lambda c: flash_attention(q, q, q, logits_soft_cap=c))(2.0)
