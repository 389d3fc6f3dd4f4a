"""The CPU kernel outside XLA, under AddressSanitizer and UBSan: ``cpu_harness/harness.cc``
calls ``flash_cpu.h`` on exact-size heap buffers (XLA's buffers may have slack that hides an
overrun) and checks the tile-range functions exhaustively.

Each drawn call is laid out here in numpy as the kernel reads it (the same layouts
``jax_impl/cpu_kernel/__init__.py`` makes), run in a subprocess (a crash is a failure with its
input), and judged against torch_ref.manual_attention in float64 given the allowed pattern as a
dense mask (conformance.cases.allowed_pairs: the rules in numpy, position offsets included).
"""
from __future__ import annotations

import json
import platform
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import cpu_fuzz
import jax
import jax.numpy as jnp
from benchmarks import cpu_peak
from conformance import tolerance
from conformance.cases import allowed_pairs
from jax_impl import dropout_mask, dropout_sinks
from jax_impl.cpu_kernel import build
from _flash_helpers import torch_arrays

HERE = Path(__file__).parent / "cpu_harness"
KERNEL_DIR = Path(build.SOURCE).parent
UNBOUNDED = 1 << 30
PANEL = 64

# The harness is built for this machine: bfloat16 products where it has AVX512-BF16.
BF16_PRODUCTS = cpu_peak.features()["avx512_bf16"] and build.MARCH == "native"

pytestmark = [pytest.mark.skipif(platform.system() != "Linux" or build._compiler() is None,
                                 reason="the sanitizers need Linux and a C++ compiler"),
              # a comparison of non-finite values must not warn: the suite prints no warning of its own
              pytest.mark.filterwarnings("error::RuntimeWarning")]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    binary = tmp_path_factory.mktemp("harness") / "harness"
    command = [build._compiler(), "-O1", "-std=c++17", f"-march={build.MARCH}",
               *build.SANITIZER_FLAGS, f"-I{KERNEL_DIR}", str(HERE / "harness.cc"), "-o",
               str(binary), "-lpthread"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return binary


def _run(binary, *args):
    result = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=300,
                            env={"ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
                                 "UBSAN_OPTIONS": "print_stacktrace=1"})
    report = result.stderr[-4000:]
    assert "Sanitizer" not in report and "runtime error" not in report, report
    return result, report


def test_tile_ranges_hold_every_allowed_pair_and_stay_in_bounds(harness):
    """Problem::KeySpan / QuerySpan over every small (rows, lengths, band, tile): inside the
    sequence, lo a tile multiple, every allowed pair inside, tight where the band allows any."""
    result, report = _run(harness, "spans")
    assert result.returncode == 0, report
    assert "ranges checked" in result.stdout


def _draw(seed: int) -> dict:
    """One call's shapes and features, drawn so that padded edges, empty rows, every band
    side and every feature turn up often."""
    rng = np.random.default_rng(seed)
    pick = lambda *xs: xs[rng.integers(len(xs))]
    hkv = int(pick(1, 2))
    c = dict(seed=seed, B=int(pick(1, 2)), Lq=int(pick(1, 7, 63, 65, 130)), Lk=int(pick(1, 9, 64, 97, 200)),
             Hkv=hkv, Hq=hkv * int(pick(1, 2, 3)), D=int(pick(8, 16, 24, 40)),
             causal=pick(None, "top_left", "bottom_right"),
             window=pick(None, (int(rng.integers(0, 40)), None), (None, int(rng.integers(0, 9))),
                         (int(rng.integers(0, 40)), int(rng.integers(0, 9)))),
             lengths=bool(rng.random() < 0.5), segments=bool(rng.random() < 0.25),
             offset=bool(rng.random() < 0.25), mask=pick(None, (1, 1), (2, 1), (1, 2)),
             bias=pick(None, (1, 1), (2, 2), (1, 2)), soft_cap=pick(None, 2.5),
             dropout=pick(0.0, 0.0, 0.3), sinks=bool(rng.random() < 0.3),
             nonfinite=bool(rng.random() < 0.3), block_q=int(pick(16, 64, 96)),
             block_k=int(pick(64, 128)), threads=int(pick(1, 3)))
    c["tiles"] = bool(rng.random() < (0.8 if c["segments"] else 0.3))  # tile classes given
    c["bf16"] = BF16_PRODUCTS and bool(rng.random() < 0.4)  # bfloat16 products (bf16_dot.h)
    return c


def _case(c: dict):
    """numpy inputs, the allowed pattern, and the oracle's keyword arguments."""
    rng = np.random.default_rng(c["seed"] + 1)
    b, lq, lk, hq, hkv, d = (c[n] for n in ("B", "Lq", "Lk", "Hq", "Hkv", "D"))
    q, ct = (rng.standard_normal((b, lq, hq, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, lk, hkv, d)).astype(np.float32) for _ in range(2))
    if c.get("bf16"):  # bfloat16 values, so that the oracle sees what the kernel reads
        q, ct, k, v = (x.astype(ml_dtypes.bfloat16).astype(np.float32) for x in (q, ct, k, v))
    q_len = rng.integers(0, lq + 1, b) if c["lengths"] else np.full(b, lq)
    kv_len = rng.integers(0, lk + 1, b) if c["lengths"] else np.full(b, lk)
    if c["nonfinite"]:  # anywhere: at allowed pairs (NaN rows) and excluded ones (no effect)
        for x in (q, k, v):
            x[tuple(rng.integers(0, n) for n in x.shape)] = rng.choice([np.nan, np.inf, -np.inf])
    offset = rng.integers(-lk, lk + 1, b) if c["offset"] else np.zeros(b, int)
    # The band d_lo <= j - i <= d_hi (docs/semantics.md), offsets included.
    base = (kv_len - q_len if c["causal"] == "bottom_right" else 0) + offset
    left, right = c["window"] or (None, None)
    d_hi = np.full(b, UNBOUNDED) if right is None and not c["causal"] else np.minimum(
        base if c["causal"] else UNBOUNDED, base + right if right is not None else UNBOUNDED)
    d_lo = np.full(b, -UNBOUNDED) if left is None else base - left
    arrays = dict(q_len=q_len, kv_len=kv_len, d_lo=d_lo, d_hi=d_hi)
    params = dict(B=b, Lq=lq, Lk=lk, Hq=hq, Hkv=hkv, scale=1 / np.sqrt(d), soft_cap=c["soft_cap"] or 0,
                  dropout_rate=c["dropout"], block_q=c["block_q"], block_k=c["block_k"],
                  threads=c["threads"], flags=0)
    oracle = {}
    q_seg = kv_seg = mask = None
    if c["segments"]:
        q_seg, kv_seg = (np.sort(rng.integers(0, 3, (b, n)), axis=1) for n in (lq, lk))
        arrays.update(q_seg=q_seg, kv_seg=kv_seg)
        params["flags"] |= 1
    if c["mask"]:
        mb, mh = c["mask"]  # 1: broadcast over that axis
        mask = rng.random((b if mb > 1 else 1, hq if mh > 1 else 1, lq, lk)) < 0.8
        arrays["mask"] = mask
        params.update(mask_b=mask.shape[0], mask_h=mask.shape[1])
        params["flags"] |= 2
    if c["bias"]:
        bb, bh = c["bias"]
        bias = rng.standard_normal((b if bb > 1 else 1, hq if bh > 1 else 1, lq, lk)).astype(np.float32)
        bias[rng.random(bias.shape) < 0.05] = -np.inf  # an additive -inf excludes a pair
        arrays["bias"] = bias
        params.update(bias_b=bias.shape[0], bias_h=bias.shape[1])
        params["flags"] |= 4 | 16
        oracle["bias"] = np.broadcast_to(bias, (b, hq, lq, lk)).copy()
    if c["sinks"]:
        sinks = rng.standard_normal((1, hq)).astype(np.float32)
        arrays["sinks"] = sinks
        params.update(sinks_b=1, sinks_h=hq)
        params["flags"] |= 8
        oracle["attention_sinks"] = sinks[0]
    if c["dropout"]:
        key = jax.random.key(c["seed"])
        arrays["seeds"] = np.asarray(dropout_sinks.head_seeds(dropout_sinks.key_words(key), b, hq, False))
        params.update(seeds_b=b, seeds_h=hq)
        oracle.update(dropout_rate=c["dropout"], dropout_mask=np.asarray(
            dropout_mask(key, (b, hq, lq, lk), c["dropout"], broadcast_dropout=False)))
    if c["soft_cap"]:
        oracle["logits_soft_cap"] = c["soft_cap"]
    # The oracle's pattern from the rules (not from the band handed to the kernel).
    allowed = allowed_pairs(lq, lk, q_len, kv_len, c["causal"], c["window"], offset, q_seg, kv_seg, mask)
    oracle["mask"] = np.broadcast_to(allowed, (b, allowed.shape[1], lq, lk)).copy()
    if c["tiles"]:  # the exact classes of the pattern, on the grid both passes run on
        tiles = cpu_fuzz.tile_classes_of(oracle["mask"], c["block_q"], c["block_k"])
        arrays["tiles"] = tiles
        params.update(tiles_b=b, tiles_h=tiles.shape[1])
        params["flags"] |= 32
    return (q, k, v, ct), arrays, params, oracle


def _pairs(x):
    """float32 holding bfloat16 values [..., 2n] -> uint32 [..., n], values 2i and 2i + 1 in one
    word (2i in the low half)."""
    return np.ascontiguousarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)).view(np.uint32)


def _pad(x, dp):
    return np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dp - x.shape[-1])])


def _write(directory: Path, name: str, x, dtype):
    np.ascontiguousarray(x, dtype).tofile(directory / f"{name}.bin")


def _read(directory: Path, name: str, shape):
    return np.fromfile(directory / f"{name}.bin", np.float32).reshape(shape)


def _kernel(binary, directory: Path, c: dict, tensors, arrays, params):
    """The harness's forward and backward, laid out back as flash_attention returns them."""
    q, k, v, ct = tensors
    b, lq, lk, hq, hkv, d = (c[n] for n in ("B", "Lq", "Lk", "Hq", "Hkv", "D"))
    dp = -(-d // 16) * 16
    qp, kp, vp, ctp = (_pad(x, dp) for x in (q, k, v, ct))
    heads = lambda x: np.swapaxes(x, 1, 2)  # [B, L, H, Dp] -> [B, H, L, Dp]
    kpad = np.pad(kp, ((0, 0), (0, -lk % PANEL), (0, 0), (0, 0)))
    kt = np.transpose(kpad.reshape(b, -1, PANEL, hkv, dp), (0, 3, 1, 4, 2))  # K^T panels
    chunks = 1 + c["seed"] % 3
    params = dict(params, D=dp, chunks=chunks)
    (directory / "params.txt").write_text("".join(f"{n} {float(x)!r}\n" for n, x in params.items()))
    for name, x in arrays.items():
        _write(directory, name, x, np.bool_ if name == "mask" else np.uint32 if name == "seeds"
               else np.float32 if name in ("bias", "sinks") else np.int8 if name == "tiles"
               else np.int32)
    if c.get("bf16"):  # bfloat16 pairs (bf16_dot.h), as cpu_kernel's _pairs and _value_pairs
        params["bf16"] = 1
        (directory / "params.txt").write_text("".join(f"{n} {float(x)!r}\n" for n, x in params.items()))
        operand = lambda x: _pairs(x)
        kt = np.transpose(_pairs(kpad).reshape(b, -1, PANEL, hkv, dp // 2), (0, 3, 1, 4, 2))
        vpad = np.pad(heads(vp), ((0, 0), (0, 0), (0, -lk % PANEL), (0, 0)))
        v_forward = _pairs(np.swapaxes(vpad.reshape(b, hkv, -1, 2, dp), -1, -2))
    else:
        operand, v_forward = (lambda x: x), heads(vp)
    store = lambda name, x: _write(directory, name, x, x.dtype if x.dtype == np.uint32 else np.float32)
    for name, x in (("q", operand(qp)), ("kt", kt), ("v", v_forward)):
        store(name, x)
    result, report = _run(binary, "run", str(directory))
    assert result.returncode == 0, report
    out = _read(directory, "out", (b, lq, hq, dp))
    delta = np.sum(out * ctp, axis=-1).transpose(0, 2, 1)  # rowsum(dO * O), [B, Hq, Lq]
    for name, x in (("q_heads", heads(qp)), ("k", heads(kp)), ("d_out", heads(ctp)), ("v_heads", heads(vp))):
        if name != "v_heads" or c.get("bf16"):
            store(name, operand(x))
    store("delta", delta)
    result, report = _run(binary, "run", str(directory))
    assert result.returncode == 0, report
    unheads = lambda x: np.swapaxes(x, 1, 2)[..., :d]
    results = dict(out=out[..., :d],
                   dq=unheads(_read(directory, "dq_parts", (chunks, b, hq, lq, dp)).sum(0)) * params["scale"],
                   dk=unheads(_read(directory, "dk", (b, hkv, lk, dp))),
                   dv=unheads(_read(directory, "dv", (b, hkv, lk, dp))))
    if "bias" in arrays:
        dbias = _read(directory, "dbias", (b, hq, lq, lk))
        bias_shape = arrays["bias"].shape
        axes = tuple(a for a in (0, 1) if bias_shape[a] == 1 and dbias.shape[a] > 1)
        results["dbias"] = dbias.sum(axis=axes, keepdims=True) if axes else dbias
    return {n: x.astype(np.float64) for n, x in results.items()}


@pytest.mark.parametrize("first", range(0, 60, 12))
def test_drawn_calls_on_exact_buffers_match_the_float64_oracle(harness, tmp_path, first):
    """Twelve drawn calls per test: no sanitizer report, outputs and gradients within
    conformance's tolerance of the oracle, NaN exactly where the oracle has NaN."""
    for seed in range(first, first + 12):
        c = _draw(seed)
        tensors, arrays, params, oracle_kwargs = _case(c)
        directory = tmp_path / str(seed)
        directory.mkdir()
        results = _kernel(harness, directory, c, tensors, arrays, params)
        bias = oracle_kwargs.pop("bias", None)
        reference = torch_arrays(*tensors, bias=bias, **oracle_kwargs)
        dtype = "bfloat16" if c["bf16"] else "float32"
        plain = torch_arrays(*tensors, bias=bias, dtype=ml_dtypes.bfloat16 if c["bf16"] else np.float32,
                             **oracle_kwargs)
        if bias is not None:
            reference["dbias"] = reference["dbias"].sum(
                axis=tuple(a for a in (0, 1) if arrays["bias"].shape[a] == 1), keepdims=True)
            plain["dbias"] = plain["dbias"].sum(
                axis=tuple(a for a in (0, 1) if arrays["bias"].shape[a] == 1), keepdims=True)
        for name in results:  # d sinks: computed outside the kernel (recompute_vjp)
            nan = np.isnan(reference[name])
            assert np.array_equal(np.isnan(results[name]), nan), (name, json.dumps(c))
            zero = lambda x: np.where(nan | ~np.isfinite(np.asarray(x, np.float64)), 0, np.asarray(x, np.float64))
            if not zero(reference[name]).any() and not zero(plain[name]).any():
                # 0 by structure (each row attends one key: softmax's gradient cancels), which
                # the plain baseline hits exactly: no bar. Bounded as cpu_fuzz.judge bounds it,
                # by sqrt(eps) of the call's largest result (bf16 products round P where it
                # meets V, so that O's rounding differs from dP's: dS keeps ~eps of dP).
                largest = max(1.0, *(float(np.max(np.abs(np.where(np.isfinite(x), x, 0.0))))
                                     for x in reference.values()))
                bound = float(np.sqrt(ml_dtypes.finfo(ml_dtypes.bfloat16 if c["bf16"] else np.float32).eps))
                assert np.max(np.abs(zero(results[name]))) <= bound * largest, (name, json.dumps(c))
                continue
            verdict = tolerance.judge(name, zero(results[name]), zero(reference[name]), zero(plain[name]), dtype)
            assert verdict.passed, (verdict, json.dumps(c))
        shutil.rmtree(directory)


def test_decode_on_exact_buffers_matches_the_float64_oracle(harness, tmp_path):
    """The decode kernel on exact-size caches (dense and paged, float32 and bfloat16, a
    head_dim to pad, lengths that leave pages unread, more splits than keys): no sanitizer
    report, out within conformance's tolerance of the oracle."""
    import ml_dtypes
    from conformance.cases import allowed_pairs
    from torch_ref import attention_forward, manual_attention

    for seed in range(8):
        rng = np.random.default_rng(500 + seed)
        b, lq, (hq, hkv), dk = int(rng.integers(1, 3)), int(rng.choice([1, 3, 16])), \
            [(4, 1), (8, 2), (2, 2)][seed % 3], int(rng.choice([24, 64]))
        dp = -(-dk // 16) * 16
        paged, bf16 = seed % 2 == 1, seed % 4 >= 2
        page = int(rng.choice([1, 5, 16]))
        pages = int(rng.integers(1, 12))
        lk = pages * page if paged else int(rng.integers(1, 90))
        cache_dtype = ml_dtypes.bfloat16 if bf16 else np.float32
        q = rng.standard_normal((b, lq, hq, dk)).astype(np.float32)
        k, v = (rng.standard_normal((b, lk, hkv, dk)).astype(cache_dtype) for _ in range(2))
        products = bf16 and BF16_PRODUCTS and seed % 8 >= 4  # the stats' max on bfloat16 pairs
        if products:
            q = q.astype(ml_dtypes.bfloat16).astype(np.float32)
        kv_len = rng.integers(0, lk + 1, b).astype(np.int32)
        q_len = np.full(b, lq, np.int32)
        params = dict(B=b, Lq=lq, Hq=hq, Hkv=hkv, Dp=dp, Dk=dk, paged=int(paged), cache_type=int(bf16),
                      splits=int(rng.choice([1, 3, 200])), threads=2, scale=dk ** -0.5,
                      soft_cap=float(rng.choice([0.0, 5.0])), has_sinks=seed % 3 == 0, Lk=lk,
                      bf16_products=int(products))
        directory = tmp_path / f"decode{seed}"
        directory.mkdir()
        if paged:
            num_pages = b * pages + 1
            order = rng.permutation(num_pages)[: b * pages].astype(np.int32)
            table = order.reshape(b, pages)
            kp, vp = (np.zeros((num_pages, page, hkv, dk), cache_dtype) for _ in range(2))
            kp[order] = k.reshape(b * pages, page, hkv, dk)
            vp[order] = v.reshape(b * pages, page, hkv, dk)
            unread = page * np.arange(pages)[None, :] >= kv_len[:, None]  # past the length
            table = np.where(unread, 10**6, table).astype(np.int32)  # any id there: never read
            params.update(num_pages=num_pages, page_size=page, pages=pages)
            _write(directory, "table", table, np.int32)
            k_cache, v_cache = kp, vp
        else:
            k_cache, v_cache = k, v
        raw = np.uint16 if bf16 else np.float32
        _write(directory, "k", k_cache.view(raw), raw)
        _write(directory, "v", v_cache.view(raw), raw)
        # Bottom-right causal: the band d_lo = -inf, d_hi = kv_len - q_len.
        _write(directory, "q_len", q_len, np.int32)
        _write(directory, "kv_len", kv_len, np.int32)
        _write(directory, "d_lo", np.full(b, -UNBOUNDED), np.int32)
        _write(directory, "d_hi", kv_len - q_len, np.int32)
        sinks = rng.standard_normal(hq).astype(np.float32)
        if params["has_sinks"]:
            _write(directory, "sinks", sinks, np.float32)
        _write(directory, "q", _pad(q, dp), np.float32)
        (directory / "params.txt").write_text("".join(f"{n} {float(x)!r}\n" for n, x in params.items()))
        result, report = _run(harness, "decode", str(directory))
        assert result.returncode == 0, report
        out = _read(directory, "out", (b, lq, hq, dp))[..., :dk].astype(np.float64)
        allowed = allowed_pairs(lq, lk, q_len, kv_len, "bottom_right", None)
        kw = dict(mask=allowed, logits_soft_cap=params["soft_cap"] or None,
                  attention_sinks=sinks if params["has_sinks"] else None)
        kw = {n: x for n, x in kw.items() if x is not None}
        k64, v64 = (np.asarray(x, np.float64) for x in (k, v))
        reference = attention_forward(manual_attention, q.astype(np.float64), k64, v64, **kw)
        plain = attention_forward(manual_attention, q, k64.astype(np.float32), v64.astype(np.float32), **kw)
        verdict = tolerance.judge("out", out, reference, plain, "float32")
        assert verdict.passed, (verdict, seed, params)


def test_exp2_is_within_two_ulp_and_exactly_zero_at_and_below_minus_127(harness, tmp_path):
    """The kernels' 2^x (every probability is one) against float64 exp2, on fresh draws over
    [-130, 0.5] (the logits minus a row max) and the edges: within 2 ulp wherever the result is
    a normal float, down to 2^-126 (no early flush to 0); exactly 0 at x <= -127 and at -inf
    (a masked pair adds nothing, an empty row sums to 0); NaN stays NaN; 2^0 is exactly 1."""
    rng = np.random.default_rng()
    edges = np.array([-np.inf, np.nan, -130.0, -127.5, -127.0, -126.0, -125.9, -125.0, -100.0,
                      -0.5, -1e-30, 0.0, 0.25, 0.5], np.float32)
    x = np.concatenate([edges, rng.uniform(-130.0, 0.5, 20000).astype(np.float32),
                        rng.uniform(-127.0, -125.0, 2000).astype(np.float32)])
    x.tofile(tmp_path / "x.bin")
    result, report = _run(harness, "exp2", str(tmp_path), str(x.size))
    assert result.returncode == 0, report
    y = np.fromfile(tmp_path / "exp2.bin", np.float32)
    exact = np.exp2(x.astype(np.float64))
    normal = exact >= np.finfo(np.float32).tiny
    ulps = np.abs(y[normal] - exact[normal]) / np.spacing(exact[normal].astype(np.float32))
    assert ulps.max() <= 2.0, (ulps.max(), x[normal][ulps.argmax()])
    assert np.all(y[x <= -127.0] == 0.0)
    assert np.isnan(y[np.isnan(x)]).all() and (y[x == 0.0] == 1.0).all()


# --- the mods' row programs (mod_program.py compiles, mod_program.h runs) ---------------------

KEYS = 77  # one row of keys: nine SIMD vectors and a tail
_I32 = np.iinfo(np.int32)


def _row_inputs(rng):
    """Float and int32 arrays over the keys, drawn with the values that decide semantics mixed
    in: NaN, +-inf, +-0, huge and tiny normals; int32 extremes, zeros, -1, counts past 32."""
    def floats():
        x = rng.standard_normal(KEYS).astype(np.float32) * rng.choice([1, 10, 1e4], KEYS)
        picks = rng.random(KEYS) < 0.3
        x[picks] = rng.choice(np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30, 1e-30,
                                        0.5, 1.5, -2.5, 3e9], np.float32), picks.sum())
        return x.astype(np.float32)

    def ints():
        x = rng.integers(-1000, 1000, KEYS).astype(np.int32)
        picks = rng.random(KEYS) < 0.3
        x[picks] = rng.choice(np.array([0, -1, 1, 31, 32, 33, -33, _I32.min, _I32.max], np.int32),
                              picks.sum())
        return x

    return floats(), floats(), ints(), ints()


def _bits(x):  # int32 results travel as float32 bits (bitcast_convert_type)
    return jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.float32)


# (name, score_mod(s, b, h, q, kv, fa, fb, ia, ib, table), how results compare: None equal
# values (NaN to NaN), "bits" equal int32 bits, a number: within that many ulps)
_F = lambda f: (lambda s, b, h, q, kv, fa, fb, ia, ib, table: f(fa[kv], fb[kv], s))
_I = lambda f: (lambda s, b, h, q, kv, fa, fb, ia, ib, table: _bits(f(ia[kv], ib[kv])))
PROGRAM_CASES = [
    ("add sub mul div", _F(lambda x, y, s: (x + y) * (x - s) / y), None),
    ("max min with NaN", _F(lambda x, y, s: jnp.maximum(x, y) - jnp.minimum(y, s)), None),
    ("neg abs sign", _F(lambda x, y, s: -jnp.abs(x) * jnp.sign(y) + jnp.sign(x)), None),
    ("floor ceil round", _F(lambda x, y, s: jnp.floor(x) + jnp.ceil(y) * 1e-3 + jnp.round(x)
                            + jax.lax.round(y, jax.lax.RoundingMethod.AWAY_FROM_ZERO)), None),
    ("is_finite select_n compare", _F(lambda x, y, s: jnp.where(jnp.isfinite(x), x, -s)
                                      + jnp.where(x < y, 1.0, 0.0) + jnp.where(x >= s, 2.0, 0.5)
                                      + jax.lax.select_n(jnp.abs(jnp.int32(s) % 3), x, y, s)), None),
    ("integer_pow square clamp", _F(lambda x, y, s: x ** 3 + y ** -2 + jnp.square(s)
                                    + jax.lax.clamp(-1.0, x, 2.0) + jnp.clip(y, -3, 3)), None),
    ("convert float to int", _F(lambda x, y, s: _bits(x.astype(jnp.int32) + (y * 1e9).astype(jnp.int32))), "bits"),
    ("int add sub mul wrap", _I(lambda a, b: (a + b) * (a - b) * 65599), "bits"),
    ("int div rem (XLA at 0, -1)", _I(lambda a, b: jax.lax.div(a, b) * 7 + jax.lax.rem(a, b)), "bits"),
    ("floor_divide mod", _I(lambda a, b: a // jnp.where(b == 0, 3, b) + a % jnp.where(b == 0, 5, b)), "bits"),
    ("int max min neg abs sign", _I(lambda a, b: jnp.maximum(a, b) - jnp.minimum(-a, jnp.abs(b)) + jnp.sign(a)), "bits"),
    ("bitwise", _I(lambda a, b: (a & b) ^ (a | 77) ^ ~b), "bits"),
    ("shifts past 32", _I(lambda a, b: jax.lax.shift_left(a, b) ^ jax.lax.shift_right_arithmetic(a, b)
                          ^ jax.lax.shift_right_logical(a, b)), "bits"),
    ("int compare to float", _I(lambda a, b: jnp.where(a < b, a, b) + (a == b).astype(jnp.int32)
                                 + (a.astype(jnp.float32) * 0.5).astype(jnp.int32)), "bits"),
    ("gathers: clamped, wrapped and uniform", lambda s, b, h, q, kv, fa, fb, ia, ib, table:
        table[ia[kv] % 7 - 3, kv % 6] + table[-1, h] * fa[q] + fb[jnp.clip(kv - q, 0, KEYS - 1)], None),
]
# (name, jnp function, its float64 numpy oracle, the range x and y are drawn from) of two
# keys' float32 values: within 4 ulps of the exact value (XLA's own exp2 is 15 ulps off at
# 2^60, so XLA is no oracle here).
TRANSCENDENTAL_CASES = [
    ("pow", lambda x, y: jnp.power(x, y), np.power, (0.01, 50.0), (-8.0, 8.0)),
    ("rem", jax.lax.rem, np.fmod, (-1e4, 1e4), (-30.0, 30.0)),
    ("atan2", jnp.arctan2, np.arctan2, (-10.0, 10.0), (-10.0, 10.0)),
    ("sqrt", lambda x, y: jnp.sqrt(x), lambda x, y: np.sqrt(x), (0.0, 1e6), (0, 1)),
    ("rsqrt", lambda x, y: jax.lax.rsqrt(x), lambda x, y: 1 / np.sqrt(x), (1e-6, 1e6), (0, 1)),
    ("exp", lambda x, y: jnp.exp(x), lambda x, y: np.exp(x), (-87.0, 88.0), (0, 1)),
    ("exp2", lambda x, y: jnp.exp2(x), lambda x, y: np.exp2(x), (-126.0, 127.0), (0, 1)),
    ("expm1", lambda x, y: jnp.expm1(x), lambda x, y: np.expm1(x), (-5.0, 5.0), (0, 1)),
    ("log", lambda x, y: jnp.log(x), lambda x, y: np.log(x), (1e-30, 1e30), (0, 1)),
    ("log1p", lambda x, y: jnp.log1p(x), lambda x, y: np.log1p(x), (-0.999, 1e3), (0, 1)),
    ("tanh", lambda x, y: jnp.tanh(x), lambda x, y: np.tanh(x), (-12.0, 12.0), (0, 1)),
    ("logistic", lambda x, y: jax.nn.sigmoid(x), lambda x, y: 1 / (1 + np.exp(-x)), (-80.0, 80.0), (0, 1)),
    ("sin", lambda x, y: jnp.sin(x), lambda x, y: np.sin(x), (-100.0, 100.0), (0, 1)),
    ("cos", lambda x, y: jnp.cos(x), lambda x, y: np.cos(x), (-100.0, 100.0), (0, 1)),
]
GRADIENT_CASES = [
    ("ALiBi: a uniform read", lambda s, b, h, q, kv, fa, fb, ia, ib, table: s + fa[h] * (kv - q)),
    ("T5: a read along the row", lambda s, b, h, q, kv, fa, fb, ia, ib, table:
        s + table[jnp.clip(kv - q, -2, 2) + 2, h % 5]),
    ("per-key scale and a leaky relu", lambda s, b, h, q, kv, fa, fb, ia, ib, table:
        jnp.where(s > 0, s, 0.1 * s) * fb[kv] + fa[kv] ** 2),
    ("soft cap", lambda s, b, h, q, kv, fa, fb, ia, ib, table: 3.0 * jnp.tanh(s / 3.0)),
]


class _Config:  # what mod_program reads of an AttentionConfig
    def __init__(self, score_mod=None, mask_mod=None):
        self.score_mod, self.mask_mod = score_mod, mask_mod
        self.has_mods = True
        self.aux_gradients = None  # every floating mod_aux entry differentiated


def _run_programs(harness, tmp_path, cfg, aux, s, kv, ct, b, h, q):
    from jax_impl.cpu_kernel import mod_program
    programs = mod_program.compile_mods(cfg, aux)
    packed = np.asarray(programs.aux(aux))
    for name, x in (("words", programs.words), ("aux", packed), ("s", s), ("kv", kv), ("ct", ct)):
        np.ascontiguousarray(x).tofile(tmp_path / f"{name}.bin")
    (tmp_path / "params.txt").write_text(
        f"n {KEYS}\nb {b}\nh {h}\nq {q}\nwords {programs.words.size}\naux {packed.size}\n")
    result, report = _run(harness, "mods", str(tmp_path))
    assert result.returncode == 0, report
    read = lambda name, dtype=np.float32: np.fromfile(tmp_path / f"{name}.bin", dtype)
    return programs, read


def _aux_arrays(rng):
    fa, fb, ia, ib = _row_inputs(rng)
    table = rng.standard_normal((4, 6)).astype(np.float32)
    return tuple(jnp.asarray(x) for x in (fa, fb, ia, ib, table))


def _within_ulps(got, want, ulps):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    finite = np.isfinite(got) & np.isfinite(want)  # only finite pairs are subtracted (inf - inf warns)
    apart = np.abs(np.where(finite, got, 0).astype(np.float64) - np.where(finite, want, 0))
    return same | (finite & (apart <= ulps * np.spacing(np.abs(want)) + 1e-37))


@pytest.mark.parametrize("name, mod, ulps", PROGRAM_CASES, ids=[c[0] for c in PROGRAM_CASES])
def test_mod_programs_compute_what_xla_computes(harness, tmp_path, name, mod, ulps):
    """Each primitive the programs take, on fresh draws with NaN, infinities, zeros, int32
    extremes, zero divisors and shift counts past 32 mixed in: the row program (the kernels'
    interpreter, under the sanitizers) against XLA's own evaluation of the same jnp code, bit
    for bit (ulps for the transcendental functions, whose libraries differ)."""
    rng = np.random.default_rng()
    aux = _aux_arrays(rng)
    s = _row_inputs(rng)[0]
    kv = rng.permutation(KEYS).astype(np.int32)
    b, h, q = (int(x) for x in rng.integers(0, 4, 3))
    _, read = _run_programs(harness, tmp_path, _Config(score_mod=mod), aux, s, kv,
                            np.zeros(KEYS, np.float32), b, h, q)
    want = jax.jit(jax.vmap(mod, in_axes=(0, None, None, None, 0) + (None,) * 5))(
        s, b, h, q, kv, *aux)
    got, want = read("score"), np.asarray(want)
    if ulps == "bits":
        np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    elif ulps is None:
        np.testing.assert_array_equal(got, want)
    else:
        ok = _within_ulps(got, want, ulps)
        assert ok.all(), (got[~ok], want[~ok])


@pytest.mark.parametrize("name, f, exact_f, x_range, y_range", TRANSCENDENTAL_CASES,
                         ids=[c[0] for c in TRANSCENDENTAL_CASES])
def test_mod_programs_transcendental_functions_are_within_4_ulps(harness, tmp_path, name, f,
                                                               exact_f, x_range, y_range):
    rng = np.random.default_rng()
    aux = list(_aux_arrays(rng))
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)
    for entry, (low, high) in ((0, x_range), (1, y_range)):
        x = rng.uniform(low, high, KEYS).astype(np.float32)
        x[:len(specials)] = specials  # what each function does at NaN, infinities, zeros
        aux[entry] = jnp.asarray(rng.permutation(x))
    kv = rng.permutation(KEYS).astype(np.int32)
    mod = lambda s, b, h, q, kv, fa, fb, ia, ib, table: f(fa[kv], fb[kv])
    _, read = _run_programs(harness, tmp_path, _Config(score_mod=mod), tuple(aux),
                            np.zeros(KEYS, np.float32), kv, np.zeros(KEYS, np.float32), 0, 0, 0)
    x, y = (np.asarray(aux[entry], np.float64)[kv] for entry in (0, 1))
    with np.errstate(all="ignore"):
        exact = exact_f(x, y)
    got = read("score")
    ok = _within_ulps(got, exact.astype(np.float32), 4)
    assert ok.all(), (x[~ok], y[~ok], got[~ok], exact[~ok])


@pytest.mark.parametrize("name, mod", GRADIENT_CASES, ids=[c[0] for c in GRADIENT_CASES])
def test_mod_programs_backward_matches_jax_grad(harness, tmp_path, name, mod):
    """The backward's program: score_mod(S), d score_mod / dS and the mod_aux cotangent that
    the scatter-adds sum (cotangent 0 at some keys: excluded pairs add nothing) against
    jax.grad of the same mod."""
    rng = np.random.default_rng()
    fa, fb = (rng.uniform(-2, 2, KEYS).astype(np.float32) for _ in range(2))
    ia, ib = (rng.integers(-50, 50, KEYS).astype(np.int32) for _ in range(2))
    table = rng.standard_normal((5, 6)).astype(np.float32)
    aux = tuple(jnp.asarray(x) for x in (fa, fb, ia, ib, table))
    s = rng.standard_normal(KEYS).astype(np.float32) * 3
    kv = rng.permutation(KEYS).astype(np.int32)
    ct = rng.standard_normal(KEYS).astype(np.float32) * (rng.random(KEYS) < 0.8)
    b, h, q = 1, int(rng.integers(0, 6)), int(rng.integers(0, KEYS))
    programs, read = _run_programs(harness, tmp_path, _Config(score_mod=mod), aux, s, kv, ct, b, h, q)
    row = jax.vmap(mod, in_axes=(0, None, None, None, 0) + (None,) * 5)
    value, slope = jax.vmap(jax.value_and_grad(mod), in_axes=(0, None, None, None, 0) + (None,) * 5)(
        s, b, h, q, kv, *aux)
    floats = (0, 1, 4)
    d_aux = jax.grad(lambda *f: jnp.sum(ct * row(s, b, h, q, kv, f[0], f[1], ia, ib, f[2])),
                     argnums=(0, 1, 2))(fa, fb, table)
    np.testing.assert_allclose(read("value"), value, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(read("slope"), slope, rtol=2e-6, atol=1e-6)
    got = programs.cotangents(jnp.asarray(read("d_aux")), aux)
    for entry, want in zip(floats, d_aux):
        np.testing.assert_allclose(got[entry], want, rtol=1e-5, atol=1e-5 * max(1, np.abs(want).max()))
    assert got[2] is None and got[3] is None  # int32 entries


def test_mask_mod_program_matches_xla(harness, tmp_path):
    rng = np.random.default_rng()
    aux = _aux_arrays(rng)
    mask = lambda b, h, q, kv, fa, fb, ia, ib, table: ((ia[kv] > ib[kv]) | (kv <= q)) & ~(fa[kv] != fa[kv])
    kv = rng.permutation(KEYS).astype(np.int32)
    b, h, q = 0, 1, int(rng.integers(0, KEYS))
    _, read = _run_programs(harness, tmp_path, _Config(mask_mod=mask), aux, np.zeros(KEYS, np.float32),
                            kv, np.zeros(KEYS, np.float32), b, h, q)
    want = jax.vmap(mask, in_axes=(None, None, None, 0) + (None,) * 5)(b, h, q, kv, *aux)
    np.testing.assert_array_equal(read("mask", np.int32) != 0, want)


# --- diagonal hoisting: values of kv_idx - q_idx computed once per tile ---------------------

_M = 4  # the T5 table's clip
# score_mods (s, b, h, q, kv, table [2M+1, 6], slopes [6], fq [per query], fk [per key]) and
# mask_mods (b, h, q, kv, same aux): each with a value of kv_idx - q_idx only, mixed with others.
TILE_CASES = [
    ("T5 table", lambda s, b, h, q, kv, table, slopes, fq, fk:
        s + table[jnp.clip(kv - q, -_M, _M) + _M, h], None),
    ("ALiBi", lambda s, b, h, q, kv, table, slopes, fq, fk: s + slopes[h] * (kv - q), None),
    ("q - kv, and no score", lambda s, b, h, q, kv, table, slopes, fq, fk:
        table[jnp.where(q - kv > 0, jnp.minimum(q - kv, _M), _M + jnp.minimum(kv - q, _M)), h % 6], None),
    ("diagonal mixed with query-only and key-only values", lambda s, b, h, q, kv, table, slopes, fq, fk:
        s * fk[kv] + table[jnp.clip(kv - q, -_M, _M) + _M, (h + b) % 6] * fq[q]
        + (kv - q).astype(jnp.float32) * slopes[h] * 0.5 - fq[kv - q] + (kv + q) * 1e-3, None),
    ("mask_mod on kv - q (a window)", None, lambda b, h, q, kv, table, slopes, fq, fk:
        (kv - q <= 0) & (kv - q > -37)),
    ("mask_mod: a diagonal or a query rule", None, lambda b, h, q, kv, table, slopes, fq, fk:
        ((q - kv) % 3 != 0) | (q < 9) | (table[jnp.clip(kv - q, -_M, _M) + _M, h] > 0.5)),
    ("T5 with a diagonal mask_mod", lambda s, b, h, q, kv, table, slopes, fq, fk:
        s + table[jnp.clip(kv - q, -_M, _M) + _M, h], lambda b, h, q, kv, table, slopes, fq, fk:
        jnp.abs(kv - q) < 50),
]


def _tile_aux(rng):
    return (jnp.asarray(rng.standard_normal((2 * _M + 1, 6)).astype(np.float32)),
            jnp.asarray(rng.uniform(-1, 1, 6).astype(np.float32)),
            jnp.asarray(rng.standard_normal(400).astype(np.float32)),
            jnp.asarray(rng.standard_normal(400).astype(np.float32)))


@pytest.mark.parametrize("name, score_mod, mask_mod", TILE_CASES, ids=[c[0] for c in TILE_CASES])
def test_tile_programs_on_ragged_tiles_match_xla_and_jax_grad(harness, tmp_path, name, score_mod,
                                                             mask_mod):
    """The programs as the forward and backward run them on a tile (the diagonal values once
    per tile, each row reading its slice) over tiles of 1 to 70 rows and 1 to 150 keys at any
    offset (d of both signs, edges not a multiple of the SIMD width): the forward's score and
    the mask bit for bit against XLA on the grid, the backward's value, slope and the mod_aux
    cotangent (the sum over the tile's rows of the hoisted reads' scatter) against jax.grad."""
    from jax_impl.cpu_kernel import mod_program
    rng = np.random.default_rng()
    aux = _tile_aux(rng)
    programs = mod_program.compile_mods(_Config(score_mod=score_mod, mask_mod=mask_mod), aux)
    packed = np.asarray(programs.aux(aux))
    for rows, n in ((1, int(rng.integers(1, 150))), (int(rng.integers(2, 70)), int(rng.integers(1, 150))),
                    (64, 64), (int(rng.integers(2, 70)), 1)):
        i0, j0 = (int(x) for x in rng.integers(0, 200, 2))
        b, h = int(rng.integers(0, 3)), int(rng.integers(0, 6))
        s = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
        ct = (rng.standard_normal((rows, n)) * (rng.random((rows, n)) < 0.8)).astype(np.float32)
        for key, x in (("words", programs.words), ("aux", packed), ("s", s), ("ct", ct)):
            np.ascontiguousarray(x).tofile(tmp_path / f"{key}.bin")
        (tmp_path / "params.txt").write_text(
            f"rows {rows}\nn {n}\ni0 {i0}\nj0 {j0}\nb {b}\nh {h}\nwords {programs.words.size}\n"
            f"aux {packed.size}\n")
        result, report = _run(harness, "mods_tile", str(tmp_path))
        assert result.returncode == 0, report
        read = lambda key, dtype=np.float32: np.fromfile(tmp_path / f"{key}.bin", dtype).reshape(rows, n)
        q = jnp.arange(i0, i0 + rows, dtype=jnp.int32)
        kv = jnp.arange(j0, j0 + n, dtype=jnp.int32)
        if mask_mod is not None:
            grid = jax.vmap(jax.vmap(mask_mod, (None, None, None, 0) + (None,) * 4),
                            (None, None, 0, None) + (None,) * 4)
            np.testing.assert_array_equal(read("mask", np.int32) != 0, jax.jit(grid)(b, h, q, kv, *aux))
        if score_mod is None:
            continue
        on_grid = lambda f: jax.vmap(jax.vmap(f, (0, None, None, None, 0) + (None,) * 4),
                                     (0, None, None, 0, None) + (None,) * 4)
        np.testing.assert_array_equal(read("score"), jax.jit(on_grid(score_mod))(s, b, h, q, kv, *aux))
        value, slope = jax.jit(on_grid(jax.value_and_grad(score_mod)))(s, b, h, q, kv, *aux)
        np.testing.assert_allclose(read("value"), value, rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(read("slope"), slope, rtol=2e-6, atol=1e-6)
        d_aux = jax.grad(lambda *f: jnp.sum(ct * on_grid(score_mod)(s, b, h, q, kv, *f)),
                         argnums=(0, 1, 2, 3))(*aux)
        got = programs.cotangents(jnp.asarray(np.fromfile(tmp_path / "d_aux.bin", np.float32)), aux)
        # up to 10^4 float32 products summed into each table entry, in another order than
        # jax.grad's: about 4e-6 of the largest entry; 4e-5 leaves a tenfold margin
        for entry, want in enumerate(d_aux):
            np.testing.assert_allclose(got[entry], want, rtol=1e-5, atol=4e-5 * max(1, np.abs(want).max()))


def _program_parts(programs):
    """{program name: its opcodes' names} of compiled programs (the header's ranges)."""
    from jax_impl.cpu_kernel import mod_program
    words, size = programs.words, mod_program._HEADER_SIZE
    names = {v: k for k, v in mod_program.OP.items()}
    code = words[size:].reshape(-1, mod_program.WIDTH)
    field = lambda name: int(words[mod_program.FIELD[name]])
    return {part: [names[int(op)] for op in code[field(f"k{part}Start"):][:field(f"k{part}Count"), 0]]
            for part in ("Score", "ScoreTile", "Mask", "MaskTile", "Grad", "GradTile", "Scatter")}


def test_t5_and_alibi_reads_and_arithmetic_run_once_per_tile():
    """The structure: T5's clamp and table read (and ALiBi's slope times kv - q) sit in the
    tile programs; each row adds one diagonal register to S (its backward: the same add and the
    scatter of the hoisted read's index); a query-only value keeps its gather in the row."""
    from jax_impl.cpu_kernel import mod_program
    rng = np.random.default_rng()
    aux = _tile_aux(rng)
    t5, alibi = TILE_CASES[0][1], TILE_CASES[1][1]
    parts = _program_parts(mod_program.compile_mods(_Config(score_mod=t5), aux))
    assert parts["Score"] == ["kFAdd"] and "kGather" in parts["ScoreTile"], parts
    assert "kGather" in parts["GradTile"] and "kGather" not in parts["Grad"], parts
    assert parts["Scatter"] == ["kScatterAdd"]
    parts = _program_parts(mod_program.compile_mods(_Config(score_mod=alibi), aux))
    assert parts["Score"] == ["kFAdd"] and {"kGather", "kFMul", "kI2F"} <= set(parts["ScoreTile"]), parts
    mixed = lambda s, b, h, q, kv, table, slopes, fq, fk: s + fq[q] * table[jnp.clip(kv - q, -1, 1) + 1, h]
    parts = _program_parts(mod_program.compile_mods(_Config(score_mod=mixed), aux))
    assert parts["Score"].count("kGather") == 1 and parts["ScoreTile"].count("kGather") == 1, parts
    window = TILE_CASES[4][2]
    parts = _program_parts(mod_program.compile_mods(_Config(mask_mod=window), aux))
    assert parts["Mask"] == [] and "kILe" in parts["MaskTile"], parts
