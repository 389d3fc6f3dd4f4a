"""manual_attention (float64 oracle) against an independent numpy computation, empty rows,
and the conventions that must not flip."""

import numpy as np
import pytest
import torch

from _torch_ref_helpers import KINDS, make_case, np_attention, torch_kwargs
from torch_ref import allowed_mask, manual_attention, to_torch

SHAPES = [(1, 1), (5, 9), (9, 5), (37, 37), (1, 37), (37, 1)]  # (Lq, Lk)


def _run_manual(q, k, v, kw, dtype=torch.float64):
    Q, K, V = (to_torch(x).to(dtype) for x in (q, k, v))
    out, lse = manual_attention(Q, K, V, return_lse=True, **torch_kwargs(kw, dtype))
    return out, lse


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("Lq,Lk", SHAPES)
def test_manual_matches_numpy_float64(kind, Lq, Lk):
    q, k, v, kw = make_case(kind, Lq=Lq, Lk=Lk, seed=Lq * 100 + Lk)
    out, lse = _run_manual(q, k, v, kw)
    ref_out, ref_lse = np_attention(q, k, v, **kw)
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.isfinite(lse.numpy()), np.isfinite(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse.numpy()[fin], ref_lse[fin], rtol=0, atol=1e-12)
    assert out.dtype == torch.float64 and lse.shape == ref_lse.shape


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("kind", ["none", "causal_br", "everything"])
def test_manual_gqa_matches_numpy(Hq, Hkv, kind):
    q, k, v, kw = make_case(kind, Hq=Hq, Hkv=Hkv, Lq=7, Lk=11, D=8, Dv=5, seed=Hkv)
    out, lse = _run_manual(q, k, v, kw)
    ref_out, ref_lse = np_attention(q, k, v, **kw)
    assert out.shape == (2, Hq, 7, 5)
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=0, atol=1e-12)
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse.numpy()[fin], ref_lse[fin], rtol=0, atol=1e-12)


def test_explicit_scale():
    q, k, v, _ = make_case("none", seed=3)
    out, _ = _run_manual(q, k, v, {"scale": 0.37})
    ref, _ = np_attention(q, k, v, scale=0.37)
    np.testing.assert_allclose(out.numpy(), ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_empty_rows_zero_forward_and_backward(dtype):
    g = torch.Generator().manual_seed(11)
    B, Hq, Hkv, Lq, Lk, D = 2, 2, 1, 6, 4, 8
    Q = torch.randn(B, Hq, Lq, D, generator=g).to(dtype).requires_grad_()
    K = torch.randn(B, Hkv, Lk, D, generator=g).to(dtype).requires_grad_()
    V = torch.randn(B, Hkv, Lk, D, generator=g).to(dtype).requires_grad_()
    bias = torch.randn(B, Hq, Lq, Lk, generator=g).to(dtype).requires_grad_()
    mask = torch.ones(B, Hq, Lq, Lk, dtype=torch.bool)
    mask[0, 1, 2] = False  # one fully masked row
    qlens = torch.tensor([5, 6])  # row 5 of batch 0 is padding
    # bottom_right with Lq > Lk: the first Lq - Lk rows of batch 1 see no key
    out, lse = manual_attention(Q, K, V, mask=mask, bias=bias, is_causal=True, causal_alignment="bottom_right",
                                query_seq_lengths=qlens, return_lse=True)
    empty = ~allowed_mask(B, Hq, Lq, Lk, mask=mask, is_causal=True, causal_alignment="bottom_right",
                          query_seq_lengths=qlens).any(-1)  # [B, Hq, Lq]
    assert empty[0, 1, 2] and empty[0, :, 5].all() and empty[1, :, 0].all() and empty[1, :, 1].all()
    assert torch.all(out[empty] == 0)
    assert torch.all(lse[empty] == float("-inf"))
    ct = torch.randn(out.shape, generator=g).to(dtype)
    fin_lse = torch.where(empty, 0.0, lse.double())
    ((out.double() * ct.double()).sum() + (fin_lse * torch.randn(lse.shape, generator=g, dtype=torch.float64)).sum()).backward()
    for t in (Q, K, V, bias):
        assert torch.isfinite(t.grad).all()
    assert torch.all(Q.grad[empty] == 0)
    assert torch.all(bias.grad[empty] == 0)
    assert Q.grad[~empty].abs().sum() > 0


def test_all_rows_empty_is_zero_not_nan():
    g = torch.Generator().manual_seed(5)
    Q, K, V = (torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = manual_attention(Q, K, V, mask=torch.zeros(1, 1, 3, 3, dtype=torch.bool))
    out.backward(torch.randn(out.shape, generator=g, dtype=torch.float64))
    assert torch.all(out == 0)
    for t in (Q, K, V):
        assert torch.all(t.grad == 0)


def test_bool_mask_true_means_attend():
    """Masked-out key carries a huge value: if True meant 'masked' the output would explode."""
    g = torch.Generator().manual_seed(1)
    Q = torch.randn(1, 1, 2, 4, generator=g, dtype=torch.float64)
    K = torch.randn(1, 1, 3, 4, generator=g, dtype=torch.float64)
    V = torch.randn(1, 1, 3, 4, generator=g, dtype=torch.float64)
    V[0, 0, 2] = 1e6
    mask = torch.tensor([True, True, False])  # broadcasts over [B, Hq, Lq, Lk]
    out = manual_attention(Q, K, V, mask=mask)
    s = (Q[0, 0] @ K[0, 0, :2].T) / 2.0  # scale 1/sqrt(4)
    expected = torch.softmax(s, -1) @ V[0, 0, :2]
    torch.testing.assert_close(out[0, 0], expected, rtol=0, atol=1e-12)
    assert out.abs().max() < 100


def test_causal_alignments_differ_and_match_definition():
    """Lq=2, Lk=4: top_left row 0 sees key 0 only; bottom_right row 0 sees keys 0..2."""
    tl = allowed_mask(1, 1, 2, 4, is_causal=True)[0, 0]
    br = allowed_mask(1, 1, 2, 4, is_causal=True, causal_alignment="bottom_right")[0, 0]
    assert tl.tolist() == [[True, False, False, False], [True, True, False, False]]
    assert br.tolist() == [[True, True, True, False], [True, True, True, True]]
    g = torch.Generator().manual_seed(2)
    Q = torch.randn(1, 1, 2, 4, generator=g, dtype=torch.float64)
    K = torch.randn(1, 1, 4, 4, generator=g, dtype=torch.float64)
    V = torch.randn(1, 1, 4, 4, generator=g, dtype=torch.float64)
    out_tl = manual_attention(Q, K, V, is_causal=True)
    out_br = manual_attention(Q, K, V, is_causal=True, causal_alignment="bottom_right")
    torch.testing.assert_close(out_tl[0, 0, 0], V[0, 0, 0], rtol=0, atol=1e-12)
    p = torch.softmax((Q[0, 0, 0] @ K[0, 0, :3].T) / 2.0, -1)
    torch.testing.assert_close(out_br[0, 0, 0], p @ V[0, 0, :3], rtol=0, atol=1e-12)
    assert not torch.allclose(out_tl, out_br)


def test_bottom_right_lengths_align_to_valid_lengths():
    # qlen=2, klen=3 in a padded Lq=4, Lk=6: query 1 (last valid) sees keys 0..2, query 0 sees 0..1
    m = allowed_mask(1, 1, 4, 6, is_causal=True, causal_alignment="bottom_right",
                     query_seq_lengths=torch.tensor([2]), key_value_seq_lengths=torch.tensor([3]))[0, 0]
    assert m[0].tolist() == [True, True, False, False, False, False]
    assert m[1].tolist() == [True, True, True, False, False, False]
    assert not m[2:].any()


def test_window_tuple_with_none():
    m = allowed_mask(1, 1, 5, 5, local_window_size=(1, None))[0, 0]
    assert m[3].tolist() == [False, False, True, True, True]
    m = allowed_mask(1, 1, 5, 5, local_window_size=(None, 0))[0, 0]
    assert torch.equal(m, torch.ones(5, 5, dtype=torch.bool).tril())


def test_allowed_mask_head_dim_only_with_mask():
    assert allowed_mask(2, 4, 3, 5, is_causal=True).shape == (2, 1, 3, 5)
    assert allowed_mask(2, 4, 3, 5, mask=torch.ones(4, 1, 5, dtype=torch.bool)).shape == (2, 4, 3, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_manual_runs_in_input_dtype(dtype):
    q, k, v, kw = make_case("everything", seed=9)
    out, lse = _run_manual(q, k, v, kw, dtype)
    assert out.dtype == dtype and lse.dtype == dtype
    assert torch.isfinite(out).all()
    ref, _ = np_attention(q, k, v, **kw)
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 5e-2}[dtype]
    np.testing.assert_allclose(out.double().numpy(), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("sinks", [False, True])
def test_a_nan_query_row_reaches_exactly_the_gradients_of_the_keys_it_attends(sinks):
    """The non-finite rule's gradients (docs/semantics.md): a NaN logit at an allowed pair is
    NaN in that row's output and its dS, so in dq of the row (every entry: the zeroing of the
    non-finite entry passes its row's gradient through) and in dk, dv of exactly the keys the row
    attends; every pair the row may not attend has P = dS = 0, so the other keys' gradients stay
    finite (a softmax over a row holding NaN would otherwise spread it to every column)."""
    g = torch.Generator().manual_seed(11)
    Q, K, V = (torch.randn(1, 2, 8, 4, generator=g, dtype=torch.float64) for _ in range(3))
    Q[0, 1, 3, 2] = float("nan")  # query row 3 of head 1 attends keys 0..3 (causal)
    Q, K, V = (x.requires_grad_() for x in (Q, K, V))
    kw = {"attention_sinks": torch.tensor([0.5, -0.5], dtype=torch.float64)} if sinks else {}
    out = manual_attention(Q, K, V, is_causal=True, **kw)
    out.backward(torch.randn(out.shape, generator=g, dtype=torch.float64))
    rows = lambda x: torch.isnan(x[0, 1]).any(-1).tolist()
    attends = [j <= 3 for j in range(8)]
    assert rows(out) == [i == 3 for i in range(8)] and torch.isfinite(out[0, 0]).all()
    assert rows(Q.grad) == [i == 3 for i in range(8)] and torch.isnan(Q.grad[0, 1, 3]).all()
    assert rows(K.grad) == attends and rows(V.grad) == attends
    assert torch.isfinite(Q.grad[0, 0]).all() and torch.isfinite(K.grad[0, 0]).all()


def test_a_minus_inf_sink_is_no_sink_even_in_a_row_with_no_allowed_key():
    """attention_sinks = -inf adds nothing: a row with no allowed key still gives output 0,
    lse -inf and zero gradients (softmax over an all -inf row would give NaN)."""
    g = torch.Generator().manual_seed(12)
    Q, K, V = (torch.randn(2, 2, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    sinks = torch.tensor([float("-inf"), 0.5], dtype=torch.float64, requires_grad=True)
    out, lse = manual_attention(Q, K, V, attention_sinks=sinks, return_lse=True,
                                key_value_seq_lengths=torch.tensor([0, 5]))
    out.sum().backward()
    assert torch.all(out[0] == 0) and torch.all(lse[0, 0] == float("-inf"))
    assert torch.all(lse[0, 1] == 0.5)  # a finite sink is the whole softmax of an empty row
    assert torch.isfinite(lse[1]).all() and torch.all(out[1] != 0)
    for x in (Q, K, V, sinks):
        assert torch.isfinite(x.grad).all()
