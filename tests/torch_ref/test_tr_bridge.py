"""numpy <-> torch bridge: bit-exact bf16, layout [B, L, H, D], gradients for a given cotangent."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from _torch_ref_helpers import make_case, np_attention
from torch_ref import (
    attention_forward,
    attention_with_grads,
    manual_attention,
    sdpa_attention,
    to_numpy,
    to_torch,
)


def _np_grads(q, k, v, ct, bias, mask):
    """Analytic softmax-attention gradients in numpy float64, layout [B, H, L, D], GQA by groups."""
    B, Hq, Lq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    kr, vr = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)  # [B, Hq, Lk, D]
    scale = 1 / math.sqrt(D)
    s = np.einsum("bhid,bhjd->bhij", q, kr) * scale + bias
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = p @ vr
    dp = np.einsum("bhid,bhjd->bhij", ct, vr)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))  # [B, Hq, Lq, Lk]
    dq = np.einsum("bhij,bhjd->bhid", ds, kr) * scale
    dk = np.einsum("bhij,bhid->bhjd", ds, q).reshape(B, Hkv, G, *k.shape[2:]).sum(2) * scale
    dv = np.einsum("bhij,bhid->bhjd", p, ct).reshape(B, Hkv, G, *v.shape[2:]).sum(2)
    return out, dq, dk, dv, ds


def _blhd(x):  # [B, H, L, D] -> [B, L, H, D]
    return np.ascontiguousarray(np.swapaxes(x, 1, 2))


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("bias_shape", [(1, 4, 5, 7), (2, 4, 5, 7), (5, 7)])
def test_grads_match_numpy_analytic(Hq, Hkv, bias_shape):
    rng = np.random.default_rng(Hkv * 10 + len(bias_shape))
    B, Lq, Lk, D = 2, 5, 7, 6
    q = rng.standard_normal((B, Hq, Lq, D))
    k = rng.standard_normal((B, Hkv, Lk, D))
    v = rng.standard_normal((B, Hkv, Lk, D))
    ct = rng.standard_normal((B, Hq, Lq, D))
    bias = rng.standard_normal(bias_shape)
    mask = rng.random((B, 1, Lq, Lk)) < 0.8
    mask[..., 0] = True  # no empty rows here
    out, dq, dk, dv, ds = _np_grads(q, k, v, ct, bias, mask)
    res = attention_with_grads(manual_attention, _blhd(q), _blhd(k), _blhd(v), _blhd(ct), bias=bias, mask=mask)
    for name, ref in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert res[name].shape == _blhd(ref).shape and res[name].dtype == np.float64
        np.testing.assert_allclose(res[name], _blhd(ref), rtol=0, atol=1e-12, err_msg=name)
    dbias = ds.sum(axis=tuple(range(4 - len(bias_shape)))) if len(bias_shape) < 4 else ds
    for ax, n in enumerate(bias_shape):
        if n == 1:
            dbias = dbias.sum(axis=ax, keepdims=True)
    assert res["dbias"].shape == bias_shape
    np.testing.assert_allclose(res["dbias"], dbias, rtol=0, atol=1e-12)


def test_gradcheck_manual_all_features():
    g = torch.Generator().manual_seed(3)
    Q = torch.randn(2, 2, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    K = torch.randn(2, 1, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    V = torch.randn(2, 1, 5, 2, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, 2, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    kw = dict(is_causal=True, causal_alignment="bottom_right", local_window_size=(2, None), logits_soft_cap=2.0,
              query_seq_lengths=torch.tensor([4, 3]), key_value_seq_lengths=torch.tensor([5, 2]))
    assert torch.autograd.gradcheck(lambda q, k, v, b: manual_attention(q, k, v, bias=b, **kw), (Q, K, V, bias))
    # lse: only rows with an allowed key (-inf elsewhere has no finite difference)
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: manual_attention(q, k, v, bias=b, is_causal=True, return_lse=True)[1], (Q, K, V, bias))


@pytest.mark.parametrize("fn", ["manual", "sdpa_math"])
def test_bf16_grads_in_bf16_and_close_to_oracle(fn):
    attn = manual_attention if fn == "manual" else (lambda *a, **k: sdpa_attention(*a, backend="math", **k))
    q, k, v, kw = make_case("causal_br", Lq=6, Lk=9, seed=2)
    bf = ml_dtypes.bfloat16
    qb, kb, vb = (_blhd(x).astype(bf) for x in (q, k, v))
    ct = np.random.default_rng(1).standard_normal((2, 6, 4, 8)).astype(bf)
    res = attention_with_grads(attn, qb, kb, vb, ct, **kw)
    assert all(res[n].dtype == bf for n in ("out", "dq", "dk", "dv"))
    assert res["dk"].shape == (2, 9, 2, 8)
    ref = attention_with_grads(manual_attention, *(x.astype(np.float64) for x in (qb, kb, vb, ct)), **kw)
    for n in ("out", "dq", "dk", "dv"):
        np.testing.assert_allclose(res[n].astype(np.float64), ref[n], rtol=0, atol=0.1, err_msg=n)


def test_bf16_round_trip_bit_exact():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**16, size=(3, 257), dtype=np.uint16)  # includes NaN/inf/subnormal patterns
    x = bits.view(ml_dtypes.bfloat16)
    t = to_torch(x)
    assert t.dtype == torch.bfloat16
    back = to_numpy(t)
    assert back.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back.view(np.uint16), bits)
    # torch -> numpy -> torch keeps the bits too
    t2 = torch.randn(4, 5, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert torch.equal(to_torch(to_numpy(t2)).view(torch.int16), t2.view(torch.int16))
    # the values agree with a float32 reading of the same bits
    finite = np.isfinite(x.astype(np.float32))
    np.testing.assert_array_equal(t.float().numpy()[finite], x.astype(np.float32)[finite])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.bool_])
def test_round_trip_other_dtypes(dtype):
    x = (np.random.default_rng(1).standard_normal((3, 4)) * 5).astype(dtype)
    np.testing.assert_array_equal(to_numpy(to_torch(x)), x)


def test_attention_forward_and_numpy_kwargs():
    q, k, v, kw = make_case("everything", Lq=7, Lk=10, seed=5)
    ref, _ = np_attention(q, k, v, **kw)
    out = attention_forward(manual_attention, _blhd(q), _blhd(k), _blhd(v), **kw)  # mask, lengths, ids: numpy
    assert out.shape == (2, 7, 4, 8)
    np.testing.assert_allclose(out, _blhd(ref), rtol=0, atol=1e-12)


def test_attention_with_grads_uses_the_given_cotangent():
    q, k, v, _ = make_case("none", Lq=4, Lk=4, seed=6)
    q, k, v = (_blhd(x) for x in (q, k, v))
    ct = np.random.default_rng(2).standard_normal(q.shape)
    a = attention_with_grads(manual_attention, q, k, v, ct)
    b = attention_with_grads(manual_attention, q, k, v, 2 * ct)
    np.testing.assert_allclose(b["dq"], 2 * a["dq"], rtol=1e-12, atol=1e-14)
    c = attention_with_grads(manual_attention, q, k, v, np.ones_like(ct))
    assert not np.allclose(c["dq"], a["dq"])


def test_bridge_errors_name_arguments():
    x = np.zeros((2, 3, 4), np.float32)
    with pytest.raises(ValueError, match="q must have the JAX layout"):
        attention_forward(manual_attention, x, x, x)
    y = np.ones((1, 2, 1, 4), np.float32)
    with pytest.raises(TypeError, match="cotangent dtype"):
        attention_with_grads(manual_attention, y, y, y, y.astype(np.float64))


def test_numpy_scalar_kwargs_become_python_numbers():
    q, k, v, _ = make_case("none", Lq=6, Lk=6, seed=7)
    kw = dict(scale=np.float32(0.3), local_window_size=(np.int64(1), None))
    ref, _ = np_attention(q, k, v, scale=0.3, local_window_size=(1, None))
    for fn in (manual_attention, sdpa_attention):
        out = attention_forward(fn, _blhd(q), _blhd(k), _blhd(v), **kw)
        np.testing.assert_allclose(out, _blhd(ref), rtol=0, atol=1e-6)
