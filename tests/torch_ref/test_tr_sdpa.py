"""SDPA wrappers (math and the CPU flash kernel) against manual attention, the
reference checks, and what SDPA itself does for a fully masked row."""

import numpy as np
import pytest
import torch

from _torch_ref_helpers import make_case, np_attention, torch_kwargs
from torch_ref import manual_attention, sdpa_attention, sdpa_causal_attention, to_torch

# absolute floor per dtype; fp16/bf16 are also judged against a same-dtype manual run
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
SDPA_KINDS = ("none", "mask", "bias", "causal_tl", "causal_br", "window", "window_br", "lengths_br", "segments",
              "everything_but_cap")
BACKENDS = ("math", "flash")


def _case(kind, **shape):
    if kind == "everything_but_cap":
        q, k, v, kw = make_case("everything", **shape)
        kw.pop("logits_soft_cap")
        return q, k, v, kw
    return make_case(kind, **shape)


def _check_against_oracle(backend, dtype, kind, Hq, Hkv, Lq, Lk, seed):
    q, k, v, kw = _case(kind, Hq=Hq, Hkv=Hkv, Lq=Lq, Lk=Lk, seed=seed)
    ref, ref_lse = np_attention(q, k, v, **kw)  # float64 oracle
    ok = np.isfinite(ref_lse)  # [B, Hq, Lq]: empty rows are SDPA's own business
    Q, K, V = (to_torch(x).to(dtype) for x in (q, k, v))
    tkw = torch_kwargs(kw, dtype)
    try:
        out = sdpa_attention(Q, K, V, backend=backend, **tkw)
    except RuntimeError as e:  # a refusal must be reported with PyTorch's reason, not crash
        assert backend in str(e) and len(str(e)) > 40
        pytest.skip(f"{backend} refused {dtype}: {e}")
    assert out.dtype == dtype and out.shape == ref.shape
    err = np.abs(out.double().numpy() - ref)[ok].max(initial=0.0)
    if dtype == torch.float32:
        assert err <= FLOOR[dtype], err
    else:
        plain = manual_attention(Q, K, V, **tkw)
        plain_err = np.abs(plain.double().numpy() - ref)[ok].max(initial=0.0)
        assert err <= 2 * plain_err + FLOOR[dtype], (err, plain_err)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", SDPA_KINDS)
@pytest.mark.parametrize("Lq,Lk", [(9, 13), (13, 9), (37, 37), (1, 37)])
def test_sdpa_fp32_matches_oracle(backend, kind, Lq, Lk):
    _check_against_oracle(backend, torch.float32, kind, 4, 2, Lq, Lk, seed=Lq + 7 * Lk)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["none", "bias", "causal_br", "lengths_br", "everything_but_cap"])
def test_sdpa_half_within_plain_same_dtype_error(backend, dtype, kind):
    _check_against_oracle(backend, dtype, kind, 4, 2, 37, 21, seed=3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("kind", ["none", "causal_tl", "mask"])
def test_sdpa_gqa(backend, Hq, Hkv, kind):
    _check_against_oracle(backend, torch.float32, kind, Hq, Hkv, 5, 11, seed=Hkv)


@pytest.mark.parametrize("backend", ["auto", "math", "flash"])
def test_course_check_sdpa_vs_manual(backend):
    g = torch.Generator().manual_seed(0)
    Q, K, V = (torch.randn(2, 4, 128, 64, generator=g) for _ in range(3))
    diff = (sdpa_attention(Q, K, V, backend=backend) - manual_attention(Q, K, V)).abs().max().item()
    assert diff < 1e-5


@pytest.mark.parametrize("backend", ["auto", "math", "flash"])
def test_course_check_causal_wrapper(backend):
    g = torch.Generator().manual_seed(1)
    Q, K, V = (torch.randn(2, 4, 128, 64, generator=g) for _ in range(3))
    assert torch.allclose(sdpa_causal_attention(Q, K, V, backend=backend), manual_attention(Q, K, V, is_causal=True),
                          rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sdpa_conventions(backend):
    g = torch.Generator().manual_seed(4)
    Q = torch.randn(1, 1, 2, 4, generator=g)
    K = torch.randn(1, 1, 4, 4, generator=g)
    V = torch.randn(1, 1, 4, 4, generator=g)
    # top_left: query 0 sees only key 0; bottom_right: query 0 sees keys 0..2
    tl = sdpa_causal_attention(Q, K, V, backend=backend)
    br = sdpa_causal_attention(Q, K, V, backend=backend, causal_alignment="bottom_right")
    torch.testing.assert_close(tl[0, 0, 0], V[0, 0, 0], rtol=0, atol=1e-6)
    p = torch.softmax((Q[0, 0, 0] @ K[0, 0, :3].T) / 2.0, -1)
    torch.testing.assert_close(br[0, 0, 0], p @ V[0, 0, :3], rtol=1e-5, atol=1e-6)
    # bool mask True = attend: the masked key's huge value must not leak in
    V2 = V.clone()
    V2[0, 0, 3] = 1e6
    out = sdpa_attention(Q, K, V2, backend=backend, mask=torch.tensor([True, True, True, False]))
    assert out.abs().max() < 100


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_sdpa_fully_masked_row_behaviour(backend, with_bias):
    """What SDPA does for a query row with no allowed key, on CPU (torch 2.13 observed):
    math and the CPU flash kernel both return exactly 0 for that row (math uses
    _safe_softmax since torch 2.5), finite, with zero gradient to Q for that row; the wrapper
    does not repair anything, so this is SDPA's own behaviour."""
    g = torch.Generator().manual_seed(6)
    Q = torch.randn(1, 2, 3, 8, generator=g, requires_grad=True)
    K, V = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(2))
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    mask[..., 1, :] = False
    bias = torch.randn(1, 2, 3, 5, generator=g) if with_bias else None
    out = sdpa_attention(Q, K, V, backend=backend, mask=mask, bias=bias)
    out.backward(torch.randn(out.shape, generator=g))
    assert torch.isfinite(out).all()
    assert torch.all(out[:, :, 1] == 0)
    assert torch.all(Q.grad[:, :, 1] == 0)


def test_sdpa_bias_gradient_matches_manual():
    g = torch.Generator().manual_seed(8)
    Q = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    K, V = (torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    bias = torch.randn(1, 4, 6, 7, generator=g, dtype=torch.float64, requires_grad=True)
    ct = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64)
    grads = []
    for fn in (manual_attention, lambda *a, **k: sdpa_attention(*a, backend="math", **k)):
        out = fn(Q, K, V, bias=bias, is_causal=True, causal_alignment="bottom_right")
        grads.append(torch.autograd.grad(out, (Q, K, V, bias), ct))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_flash_refuses_differentiable_bias_with_reason():
    g = torch.Generator().manual_seed(9)
    Q, K, V = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    bias = torch.randn(1, 2, 4, 4, generator=g, requires_grad=True)
    with pytest.raises(RuntimeError, match="'flash'.*(No available kernel|Flash attention)"):
        sdpa_attention(Q, K, V, backend="flash", bias=bias)


@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_cuda_only_backends_refuse_on_cpu(backend):
    Q = torch.randn(1, 1, 4, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=backend) as info:
        sdpa_attention(Q, Q, Q, backend=backend)
    assert "No viable backend" in str(info.value) or "No available kernel" in str(info.value)


def test_sdpa_argument_conversion():
    from torch.nn.attention.bias import CausalBias

    from torch_ref.sdpa import sdpa_arguments

    g = torch.Generator().manual_seed(10)
    Q = torch.randn(1, 4, 3, 8, generator=g)
    K = torch.randn(1, 4, 5, 8, generator=g)
    K2 = torch.randn(1, 2, 5, 8, generator=g)
    kw = sdpa_arguments(Q, K, K, is_causal=True)
    assert kw["is_causal"] and "attn_mask" not in kw and kw["dropout_p"] == 0.0
    kw = sdpa_arguments(Q, Q, Q, is_causal=True, causal_alignment="bottom_right")  # Lq == Lk
    assert kw["is_causal"] and "attn_mask" not in kw
    kw = sdpa_arguments(Q, K, K, is_causal=True, causal_alignment="bottom_right")
    assert isinstance(kw["attn_mask"], CausalBias)
    # a forced backend on CPU, or GQA: the dense mask, so sdpa_kernel governs what runs
    for args, extra in (((Q, K, K), {"backend": "math"}), ((Q, K2, K2), {})):
        kw = sdpa_arguments(*args, is_causal=True, causal_alignment="bottom_right", **extra)
        assert kw["attn_mask"].dtype == torch.bool and kw["attn_mask"].shape == (1, 1, 3, 5)
        assert kw["attn_mask"][0, 0].tolist() == allowed_rows_br(3, 5)
    assert sdpa_arguments(Q, K2, K2)["enable_gqa"] is True
    bias = torch.randn(1, 4, 3, 5, generator=g)
    kw = sdpa_arguments(Q, K, K, bias=bias, is_causal=True)
    m = kw["attn_mask"]
    assert m.dtype == torch.float32 and not kw.get("is_causal", False)
    assert torch.equal(m[0, :, 0, 1:], torch.full((4, 4), float("-inf")))
    assert torch.equal(m[0, :, 2, :3], bias[0, :, 2, :3])


def allowed_rows_br(Lq, Lk):
    return [[j <= i + Lk - Lq for j in range(Lk)] for i in range(Lq)]
