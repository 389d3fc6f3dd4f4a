"""cpu_kernel.decode, the fused C++ decode kernel (few query rows against a dense or paged KV
cache): judged against torch_ref's float64 oracle on drawn calls (the paged cache gathered
back to a dense one in numpy here), its RowStats against the oracle's logsumexp and the
regular forward's, the regular backward run from them, bitwise repeatability, what the kernel
must never read (slots and pages past the lengths, page ids past the pages), and the jitted
HLO (no buffer of the cache's size but the inputs: the cache is read where it lies). Its AVX2
and SSE2 builds: test_cpu_kernel.py::test_narrower_simd_builds_agree.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from conformance import tolerance
from conformance.cases import allowed_pairs
from jax_impl import arguments, cpu_kernel, masking
from torch_ref import manual_attention

pytestmark = pytest.mark.skipif(cpu_kernel.unavailable() is not None,
                                reason=f"CPU kernel unavailable: {cpu_kernel.unavailable()}")

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
HEADS = ((4, 1), (8, 2), (2, 2), (6, 3), (4, 4))  # (Hq, Hkv): MQA, GQA, MHA
KEY_LENGTHS = (1, 7, 33, 100, 257, 600, 1500)
HEAD_DIMS = (16, 40, 64, 128, 24)
PAGE_SIZES = (1, 3, 7, 16, 64)


def draw(seed: int) -> dict:
    """One decode call's static configuration and data, drawn from the seed."""
    rng = np.random.default_rng(1000 + seed)
    hq, hkv = HEADS[rng.integers(len(HEADS))]
    c = dict(b=int(rng.integers(1, 3)), lq=1 if rng.random() < 0.4 else int(rng.integers(2, 17)), hq=hq, hkv=hkv,
             lk=int(KEY_LENGTHS[rng.integers(len(KEY_LENGTHS))]), d=int(HEAD_DIMS[rng.integers(len(HEAD_DIMS))]),
             dtype=("float32", "bfloat16", "float16")[rng.integers(3)],
             causal=(None, "top_left", "bottom_right", "bottom_right")[rng.integers(4)],
             window=None, soft_cap=None, sinks=None, q_lengths=None, kv_lengths=None,
             page_size=None, splits=(None, 1, 2, 3)[rng.integers(4)], offset=None)
    if rng.random() < 0.3:
        c["window"] = (int(rng.integers(0, 50)), None if rng.random() < 0.5 else int(rng.integers(0, 8)))
    if rng.random() < 0.3:
        c["soft_cap"] = float(rng.uniform(2.0, 20.0))
    if rng.random() < 0.3:
        c["sinks"] = rng.standard_normal(c["hq"]).astype(np.float32)
    if rng.random() < 0.6:  # 0, partial and full lengths
        c["kv_lengths"] = rng.choice([0, max(1, c["lk"] // 3), c["lk"]], size=c["b"],
                                     p=[0.15, 0.35, 0.5]).astype(np.int32)
    if rng.random() < 0.3:
        c["q_lengths"] = rng.integers(0, c["lq"] + 1, size=c["b"]).astype(np.int32)
    if rng.random() < 0.2 and c["causal"] is not None:
        c["offset"] = rng.integers(-5, 6, size=c["b"]).astype(np.int32)
    if rng.random() < 0.6:
        c["page_size"] = int(PAGE_SIZES[rng.integers(len(PAGE_SIZES))])
    shape = lambda lk: (c["b"], lk, c["hkv"], c["d"])
    np_dtype = NP_DTYPES[c["dtype"]]
    c["q"] = rng.standard_normal((c["b"], c["lq"], c["hq"], c["d"])).astype(np_dtype)
    c["k"] = rng.standard_normal(shape(c["lk"])).astype(np_dtype)
    c["v"] = rng.standard_normal(shape(c["lk"])).astype(np_dtype)
    c["rng"] = rng
    return c


def to_pages(k, v, page_size: int, rng, spare: int = 3):
    """A dense cache [B, Lk, ...] as shuffled pages [num_pages, page_size, ...] (plus ``spare``
    pages of NaN that no table entry names) and the table; Lk rounded up to whole pages, the
    slots past Lk filled with NaN (they lie past every length: never read)."""
    b, lk = k.shape[:2]
    per = -(-lk // page_size)
    num_pages = b * per + spare
    order = rng.permutation(num_pages)[: b * per].astype(np.int32)
    pages = []
    for x in (k, v):
        padded = np.full((b, per * page_size) + x.shape[2:], np.nan, x.dtype)
        padded[:, :lk] = x
        dst = np.full((num_pages, page_size) + x.shape[2:], np.nan, x.dtype)
        dst[order] = padded.reshape((b * per, page_size) + x.shape[2:])
        pages.append(dst)
    return pages[0], pages[1], order.reshape(b, per)


def gather_pages(pages, table):
    """The logical dense cache [B, pages * page_size, ...] that the table reads (numpy)."""
    b, per = table.shape
    return pages[table.reshape(-1)].reshape((b, per * pages.shape[1]) + pages.shape[2:])


def oracle(q, k, v, allowed, *, soft_cap=None, sinks=None, dtype=np.float64):
    """torch_ref.manual_attention on [B, L, H, D] numpy: (out [B, Lq, Hq, D], lse [B, Hq, Lq])."""
    t = lambda x: torch.from_numpy(np.asarray(x, np.float32).astype(np.float64)).to(
        torch.float64 if dtype == np.float64 else torch.float32).transpose(1, 2)
    out, lse = manual_attention(t(q), t(k), t(v), mask=torch.from_numpy(allowed), logits_soft_cap=soft_cap,
                                attention_sinks=None if sinks is None else torch.from_numpy(sinks).double(),
                                return_lse=True)
    return out.transpose(1, 2).double().numpy(), lse.double().numpy()


def run_decode(c: dict, *, jit: bool = False):
    """cpu_kernel.decode on the drawn call, cfg and masks built as flash_attention builds them.
    -> (out, stats, the logical dense k and v the call reads, the allowed pattern)."""
    q, k, v = c["q"], c["k"], c["v"]
    table = None
    if c["page_size"] is not None:
        k, v, table = to_pages(k, v, c["page_size"], c["rng"])
    dense_k = k if table is None else gather_pages(k, table)
    dense_v = v if table is None else gather_pages(v, table)
    lk = dense_k.shape[1]
    kv_lengths = c["kv_lengths"] if c["kv_lengths"] is not None else (
        None if table is None else np.full(c["b"], c["lk"], np.int32))  # the pages' tail is NaN
    call = arguments.validate(q, dense_k, dense_v, is_causal=c["causal"] is not None,
                              causal_alignment=c["causal"] or "top_left", local_window_size=c["window"],
                              query_seq_lengths=c["q_lengths"], key_value_seq_lengths=kv_lengths,
                              logits_soft_cap=c["soft_cap"], attention_sinks=c["sinks"])
    masks = call.masks
    if c["offset"] is not None:
        masks = masks._replace(position_offset=jnp.asarray(c["offset"]))

    def attend(q, k, v, masks, table):
        return cpu_kernel.decode(call.cfg, q, k, v, masks, call.extras, table, splits=c["splits"])

    fn = jax.jit(attend) if jit else attend
    out, stats = fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), masks,
                    None if table is None else jnp.asarray(table))
    allowed = allowed_pairs(c["lq"], lk, np.asarray(masks.q_len), np.asarray(masks.kv_len),
                            c["causal"], c["window"],
                            position_offset=c["offset"])
    return out, stats, dense_k, dense_v, allowed, (call, masks, table)


def judge(name, value, reference, plain, dtype):
    verdict = tolerance.judge(name, np.asarray(value, np.float64), reference, plain, dtype)
    assert verdict.passed, verdict


@pytest.mark.parametrize("seed", range(24))
def test_drawn_calls_match_the_float64_oracle(seed):
    c = draw(seed)
    out, stats, k, v, allowed, _ = run_decode(c)
    assert out.shape == c["q"].shape and out.dtype == jnp.dtype(c["dtype"])
    ref, lse = oracle(c["q"], k, v, allowed, soft_cap=c["soft_cap"], sinks=c["sinks"])
    plain, _ = oracle(c["q"], k, v, allowed, soft_cap=c["soft_cap"], sinks=c["sinks"], dtype=np.float32)
    if c["dtype"] != "float32":  # the same-dtype baseline: the oracle's result rounded to it
        plain = np.asarray(plain.astype(NP_DTYPES[c["dtype"]]), np.float64)
    assert np.all(np.isfinite(np.asarray(out, np.float64)))
    judge("out", out, ref, plain, c["dtype"])
    # RowStats: max + log_sum is the oracle's logsumexp; a row with nothing to attend (and no
    # sink) has max = +inf and log_sum = 0, as the regular forward gives it.
    row_max, log_sum = np.asarray(stats.max, np.float64), np.asarray(stats.log_sum, np.float64)
    empty = ~np.isfinite(lse)
    assert np.all(row_max[empty] == np.inf) and np.all(log_sum[empty] == 0)
    np.testing.assert_allclose((row_max + log_sum)[~empty], lse[~empty], rtol=1e-5, atol=2e-5)


def _dense_call(seed=0, b=2, lq=3, hq=8, hkv=2, lk=300, d=64, **validate_kw):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, lq, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, lk, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, lk, hkv, d)).astype(np.float32)
    validate_kw.setdefault("is_causal", True)
    validate_kw.setdefault("causal_alignment", "bottom_right")
    validate_kw.setdefault("key_value_seq_lengths", np.array([lk - 50, lk], np.int32)[:b])
    call = arguments.validate(q, k, v, **validate_kw)
    return call, q, k, v


def test_stats_are_the_forward_ones_and_the_backward_runs_from_them():
    call, q, k, v = _dense_call(attention_sinks=np.linspace(-1, 1, 8).astype(np.float32))
    q, k, v = map(jnp.asarray, (q, k, v))
    out, stats = cpu_kernel.decode(call.cfg, q, k, v, call.masks, call.extras, None, splits=3)
    f_out, f_stats = cpu_kernel.forward(call.cfg, q, k, v, None, call.masks, call.extras)
    np.testing.assert_allclose(out, f_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats.max, f_stats.max, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(stats.log_sum, f_stats.log_sum, rtol=1e-5, atol=1e-5)
    d_out = jnp.asarray(np.random.default_rng(5).standard_normal(out.shape), jnp.float32)
    delta = jnp.einsum("blhd,blhd->bhl", d_out, out)
    grads = cpu_kernel.backward(call.cfg, q, k, v, None, call.masks, stats, d_out, delta, call.extras)
    expected = cpu_kernel.backward(call.cfg, q, k, v, None, call.masks, f_stats, d_out,
                                   jnp.einsum("blhd,blhd->bhl", d_out, f_out), call.extras)
    for got, want in zip(grads[:3], expected[:3]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("paged", [False, True])
def test_repeated_calls_give_the_same_bits(paged):
    c = draw(3)
    c.update(splits=None, page_size=16 if paged else None, lk=600, dtype="float32", lq=4)
    rng = np.random.default_rng(7)
    c["q"] = rng.standard_normal((c["b"], 4, c["hq"], c["d"])).astype(np.float32)
    c["k"] = rng.standard_normal((c["b"], 600, c["hkv"], c["d"])).astype(np.float32)
    c["v"] = rng.standard_normal((c["b"], 600, c["hkv"], c["d"])).astype(np.float32)
    c["q_lengths"], c["kv_lengths"] = None, None
    first = [np.asarray(x) for x in jax.tree.leaves(run_decode(dict(c, rng=np.random.default_rng(1)), jit=True)[:2])]
    for _ in range(3):
        again = [np.asarray(x) for x in jax.tree.leaves(run_decode(dict(c, rng=np.random.default_rng(1)), jit=True)[:2])]
        for a, b in zip(first, again):
            assert a.tobytes() == b.tobytes()


def test_every_split_count_gives_the_same_answer():
    call, q, k, v = _dense_call(lk=2000, key_value_seq_lengths=np.array([1999, 1234], np.int32))
    q, k, v = map(jnp.asarray, (q, k, v))
    one = cpu_kernel.decode(call.cfg, q, k, v, call.masks, call.extras, None, splits=1)
    for splits in (2, 5, 64):  # 64: more splits than tiles in the key range, most of them empty
        many = cpu_kernel.decode(call.cfg, q, k, v, call.masks, call.extras, None, splits=splits)
        np.testing.assert_allclose(many[0], one[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(many[1].max, one[1].max, rtol=1e-6)
        np.testing.assert_allclose(many[1].log_sum, one[1].log_sum, rtol=1e-5, atol=1e-6)


def test_traced_lengths_and_page_ids_are_clamped_and_never_read_out_of_bounds():
    """Under jit lengths cannot be checked: past the table they mean the whole table, below 0
    nothing; a page id past the pages, where no length reaches, is never read (and the kernel
    clamps every id it reads). Pages no table entry names hold NaN: they are never read."""
    rng = np.random.default_rng(11)
    b, lq, hq, hkv, d, page = 2, 2, 4, 2, 32, 16
    q = rng.standard_normal((b, lq, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, 64, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, 64, hkv, d)).astype(np.float32)
    kp, vp, table = to_pages(k, v, page, rng)
    call = arguments.validate(q, k, v, is_causal=True, causal_alignment="bottom_right",
                              key_value_seq_lengths=np.array([64, 64], np.int32))

    @jax.jit
    def attend(kv_len, table):  # traced lengths clamped as flash_attention clamps them
        kv_len = masking.lengths("key_value_seq_lengths", kv_len, (b,), table.shape[1] * page)
        return cpu_kernel.decode(call.cfg, jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp),
                                 call.masks._replace(kv_len=kv_len), call.extras, table)[0]

    full = np.asarray(attend(jnp.array([64, 64], jnp.int32), jnp.asarray(table)))
    past = np.asarray(attend(jnp.array([10**6, 64], jnp.int32), jnp.asarray(table)))
    np.testing.assert_array_equal(past, full)
    none = np.asarray(attend(jnp.array([-5, 64], jnp.int32), jnp.asarray(table)))
    assert np.all(none[0] == 0) and np.array_equal(none[1], full[1])
    # Row 0 needs 20 keys: pages 0 and 1 of its table; the rest of its table may be anything.
    short = np.asarray(attend(jnp.array([20, 64], jnp.int32), jnp.asarray(table)))
    wild = table.copy()
    wild[0, 2:] = [10**9, -(10**9)]
    assert np.array_equal(np.asarray(attend(jnp.array([20, 64], jnp.int32), jnp.asarray(wild))), short)
    allowed = allowed_pairs(lq, 64, [lq, lq], [20, 64], "bottom_right", None)
    ref, _ = oracle(q, k, v, allowed)
    plain, _ = oracle(q, k, v, allowed, dtype=np.float32)
    judge("out", short, ref, plain, "float32")


def test_a_non_finite_key_reaches_exactly_the_rows_that_attend_it():
    call, q, k, v = _dense_call(lq=4, key_value_seq_lengths=np.array([250, 300], np.int32))
    k = k.copy()
    v = v.copy()
    k[0, 240, 1, 3] = np.nan   # attended by every row of batch 0's heads on kv head 1
    v[0, 270, 0, 0] = np.inf   # past batch 0's length: never reaches a result
    k[1, 299, 0, 5] = np.inf   # the last key: only the last query row (bottom-right) sees it
    out = np.asarray(cpu_kernel.decode(call.cfg, *map(jnp.asarray, (q, k, v)), call.masks, call.extras, None)[0])
    allowed = allowed_pairs(4, 300, [4, 4], [250, 300], "bottom_right", None)
    ref, _ = oracle(q, k, v, allowed)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    assert np.isnan(out[0, :, 4:]).all() and np.isnan(out[1, 3, :4]).all() and not np.isnan(out[1, :3]).any()
    finite = ~np.isnan(ref)
    np.testing.assert_allclose(out[finite], ref[finite], rtol=2e-5, atol=2e-5)


def _large_buffers(hlo: str, elements: int) -> list[str]:
    """The HLO instructions other than parameters whose result holds >= ``elements`` values."""
    found = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = (\S+?)\[([\d,]*)\]", line)
        if m is None or " parameter(" in line:
            continue
        size = int(np.prod([int(x) for x in m.group(2).split(",") if x] or [1]))
        if size >= elements:
            found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize("layout", ["dense", "paged", "bfloat16"])
def test_the_jitted_hlo_holds_no_copy_of_the_cache(layout):
    rng = np.random.default_rng(2)
    b, lk, hkv, d = 2, 1024, 2, 64
    dtype = ml_dtypes.bfloat16 if layout == "bfloat16" else np.float32
    q = rng.standard_normal((b, 1, 8, d)).astype(dtype)
    k = rng.standard_normal((b, lk, hkv, d)).astype(dtype)
    call = arguments.validate(q, k, k, is_causal=True, causal_alignment="bottom_right",
                              key_value_seq_lengths=np.array([lk, 700], np.int32))
    table = None
    if layout == "paged":
        k, _, table = to_pages(k, k, 16, rng, spare=0)

    def attend(q, k, v, masks, table):
        return cpu_kernel.decode(call.cfg, q, k, v, masks, call.extras, table)

    hlo = jax.jit(attend).lower(q, k, k, call.masks, table).compile().as_text()
    assert "jax_flash_attention_cpu_decode" in hlo
    assert _large_buffers(hlo, k.size) == []


def test_bad_calls_are_refused_with_a_reason():
    call, q, k, v = _dense_call()
    q, k, v = map(jnp.asarray, (q, k, v))
    with pytest.raises(ValueError, match="no dense mask"):
        cpu_kernel.decode(call.cfg, q, k, v, call.masks._replace(mask=jnp.ones((1, 1, 3, 300), bool)),
                          call.extras, None)
    with pytest.raises(ValueError, match="at most 16"):
        cpu_kernel.decode(call.cfg, jnp.zeros((2, 17, 8, 64)), k, v, call.masks, call.extras, None)
    with pytest.raises(ValueError, match="page_table"):
        cpu_kernel.decode(call.cfg, q, k, v, call.masks, call.extras, jnp.zeros((3, 4), jnp.int32))
    assert "at most 16" in cpu_kernel.decode_unsupported(q_len=17)
    assert "dropout" in cpu_kernel.decode_unsupported(dropout_rate=0.1)
    assert cpu_kernel.decode_unsupported(q_len=4, dtype=jnp.bfloat16) is None
    assert cpu_kernel.decode_splits(2, 16384, threads=2) == 4
    assert cpu_kernel.decode_splits(1, 300, threads=16) == 1  # too few keys to split
