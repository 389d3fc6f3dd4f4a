"""probe_sdpa_backends on CPU, and input errors that name the argument."""

import pytest
import torch

from torch_ref import SDPA_BACKENDS, allowed_mask, manual_attention, probe_sdpa_backends, sdpa_attention

NAMES = ("math", "flash", "efficient", "cudnn")


def _qkv(dtype=torch.float32, Hq=2, Hkv=2, Lq=8, Lk=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, Hq, Lq, 16, generator=g).to(dtype), torch.randn(1, Hkv, Lk, 16, generator=g).to(dtype),
            torch.randn(1, Hkv, Lk, 16, generator=g).to(dtype))


def _check_report(rep):
    for n in NAMES:
        assert isinstance(rep[n]["eligible"], bool) and isinstance(rep[n]["reason"], str) and rep[n]["reason"]
    assert rep["dispatched"] is None or rep[rep["dispatched"]]["eligible"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_probe_plain_cpu(dtype):
    """torch 2.13 CPU: math and the CPU flash kernel run; efficient/cudnn have no CPU kernel;
    the automatic call picks flash."""
    rep = probe_sdpa_backends(*_qkv(dtype))
    _check_report(rep)
    assert rep["math"]["eligible"] and rep["flash"]["eligible"]
    for n in ("efficient", "cudnn"):
        assert not rep[n]["eligible"]
        assert "No viable backend" in rep[n]["reason"] or "No available kernel" in rep[n]["reason"]
    assert rep["dispatched"] == "flash"


def test_probe_causal_and_bool_mask():
    Q, K, V = _qkv(Lq=5, Lk=9)
    rep = probe_sdpa_backends(Q, K, V, is_causal=True)
    _check_report(rep)
    assert rep["dispatched"] in ("flash", "math")
    rep = probe_sdpa_backends(Q, K, V, attn_mask=allowed_mask(1, 2, 5, 9, is_causal=True))
    _check_report(rep)
    assert rep["math"]["eligible"]


def test_probe_gqa():
    Q, K, V = _qkv(Hq=4, Hkv=2)
    rep = probe_sdpa_backends(Q, K, V, enable_gqa=True)
    _check_report(rep)
    assert rep["math"]["eligible"] and rep["dispatched"] in ("flash", "math")
    # without enable_gqa nothing can run; every reason is PyTorch's, the probe does not crash
    rep = probe_sdpa_backends(Q, K, V)
    _check_report(rep)
    assert not any(rep[n]["eligible"] for n in NAMES)
    assert rep["dispatched"] is None
    assert "num_heads" in rep["flash"]["reason"]


def test_probe_differentiable_mask_leaves_math():
    """The CPU flash kernel refuses an attn_mask that requires grad; auto falls back to math."""
    Q, K, V = _qkv()
    rep = probe_sdpa_backends(Q, K, V, attn_mask=torch.zeros(8, 8, requires_grad=True))
    _check_report(rep)
    assert not rep["flash"]["eligible"] and "Flash attention" in rep["flash"]["reason"]
    assert rep["dispatched"] == "math"


def test_probe_head_dim_mismatch_reason():
    Q, K, _ = _qkv()
    V = torch.randn(1, 2, 8, 32, generator=torch.Generator().manual_seed(3))
    rep = probe_sdpa_backends(Q, K, V)
    _check_report(rep)
    assert not rep["flash"]["eligible"] and "same last dimension" in rep["flash"]["reason"]
    assert rep["dispatched"] == "math"


# ---- errors name the argument and the rule ----

def test_error_heads_not_multiple():
    Q, K, V = _qkv(Hq=3, Hkv=2)
    for fn in (manual_attention, sdpa_attention):
        with pytest.raises(ValueError, match=r"num_q_heads=3 must be a multiple of num_kv_heads=2"):
            fn(Q, K, V)


@pytest.mark.parametrize("fn", [manual_attention, sdpa_attention])
@pytest.mark.parametrize("kwargs,exc,pattern", [
    (dict(is_causal=True, causal_alignment="bottom-right"), ValueError, "causal_alignment must be one of"),
    (dict(mask=torch.ones(8, 8)), TypeError, "mask must have dtype bool"),
    (dict(mask=torch.ones(3, 8, 8, dtype=torch.bool)), ValueError, "mask shape .* not broadcastable"),
    (dict(bias=torch.ones(8, 7)), ValueError, "bias shape .* not broadcastable"),
    (dict(bias=torch.ones(8, 8, dtype=torch.int32)), TypeError, "bias must be a floating"),
    (dict(q_segment_ids=torch.zeros(1, 8, dtype=torch.int64)), ValueError, "kv_segment_ids must be given together"),
    (dict(q_segment_ids=torch.zeros(1, 7, dtype=torch.int64), kv_segment_ids=torch.zeros(1, 8, dtype=torch.int64)),
     ValueError, r"q_segment_ids must have shape \[B, L\]"),
    (dict(query_seq_lengths=torch.tensor([1, 2])), ValueError, r"query_seq_lengths must have shape \[B\]"),
    (dict(key_value_seq_lengths=torch.tensor([9])), ValueError, r"key_value_seq_lengths values must lie in \[0, 8\]"),
    (dict(query_seq_lengths=torch.tensor([1.0])), TypeError, "query_seq_lengths must have an integer dtype"),
    (dict(local_window_size=(-1, 2)), ValueError, "local_window_size left entry must be >= 0"),
    (dict(local_window_size=(1, 2, 3)), TypeError, "local_window_size must be an int or a"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap must be a positive"),
])
def test_errors_name_argument(fn, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fn(*_qkv(), **kwargs)


def test_error_qkv_shapes_and_dtypes():
    Q, K, V = _qkv()
    with pytest.raises(ValueError, match="Q must have shape"):
        manual_attention(Q[0], K, V)
    with pytest.raises(TypeError, match="Q, K, V must share one dtype"):
        manual_attention(Q.double(), K, V)
    with pytest.raises(ValueError, match="K head_dim 8 must equal Q head_dim 16"):
        manual_attention(Q, K[..., :8], V)


def test_sdpa_specific_errors():
    Q, K, V = _qkv()
    with pytest.raises(NotImplementedError, match="SDPA has no logits soft cap"):
        sdpa_attention(Q, K, V, logits_soft_cap=30.0)
    with pytest.raises(ValueError, match="backend must be one of"):
        sdpa_attention(Q, K, V, backend="triton")
    assert SDPA_BACKENDS == ("auto", "math", "flash", "efficient", "cudnn")
