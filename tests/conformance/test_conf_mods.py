"""FlexAttention-style mods (conformance/mods.py, suite "mods"): one definition per mod runs in
numpy, torch and jax.numpy alike; the oracle's dense mask, bias and aux gradient follow the
rules written out here; jax_impl and PyTorch's flex_attention pass the cases; a wrong mod fails."""
import dataclasses

import numpy as np
import pytest

from conformance import mods
from conformance.cases import Case, get_suite, make_inputs
from conformance.harness import FAIL, NOT_SUPPORTED, PASS, run_one
from conformance.oracle import references
from conformance.registry import adapters, available_adapters, get_adapter, unavailable_adapters

CASES = {c.name: c for c in get_suite("mods")}


@pytest.fixture(scope="module")
def prepared():
    cache = {}

    def get(name):
        if name not in cache:
            inputs = make_inputs(CASES[name])
            cache[name] = (inputs, references(inputs))
        return cache[name]
    return get


def _verdicts(result):
    return {v.name: round(v.ratio, 3) for v in result.verdicts}


@pytest.mark.parametrize("name", sorted(mods.MODS))
def test_one_definition_gives_the_same_values_in_numpy_torch_and_jax(name):
    import jax.numpy as jnp
    import torch
    m = mods.MODS[name]
    case = next(c for c in CASES.values() if c.mods == name)
    aux = tuple(make_inputs(case).mod_aux.values())
    shape = (case.batch, case.q_heads, case.q_len, case.kv_len)
    indices = mods.dense_indices(*shape)
    score = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    for fn, args in ((m.score_mod, (score,)), (m.mask_mod, ())):
        if fn is None:
            continue
        want = np.broadcast_to(fn(np, *args, *indices, *aux), shape)
        got_torch = fn(torch, *(torch.from_numpy(np.asarray(x)) for x in args + indices + aux))
        got_jax = fn(jnp, *(jnp.asarray(x) for x in args + indices + aux))
        for got in (got_torch.numpy(), np.asarray(got_jax)):
            assert got.dtype.kind == want.dtype.kind
            np.testing.assert_allclose(np.broadcast_to(got, shape), want, rtol=1e-6, atol=1e-6)  # float32 rounding


def test_dense_masks_follow_their_rules_written_out():
    """The oracle's masks against each rule as a loop over pairs (numpy written here)."""
    rules = {
        "documents": lambda b, q, k, doc: doc[b, q] == doc[b, k] and k <= q,
        "prefix_lm": lambda b, q, k, prefix: k <= q or k < prefix[b],
        "sliding_global": lambda b, q, k: abs(q - k) <= mods.WINDOW or min(q, k) < mods.GLOBAL_TOKENS,
        "empty_rows": lambda b, q, k: k <= q and q % mods.EMPTY_ROW_PERIOD != 1,
    }
    for name, rule in rules.items():
        case = next(c for c in CASES.values() if c.mods == name)
        inputs = make_inputs(case)
        aux = tuple(inputs.mod_aux.values())
        got = inputs.mod_mask()
        for b in range(case.batch):
            want = np.array([[rule(b, q, k, *aux) for k in range(case.kv_len)] for q in range(case.q_len)])
            for h in range(case.q_heads):
                np.testing.assert_array_equal(got[b, h], want, err_msg=name)
        assert want.any() and not want.all()
    assert make_inputs(CASES["fp32_mods_empty_rows_block16"]).empty_row_count() > 0


def test_oracle_t5_table_gradient_is_the_bias_gradient_summed_per_bucket():
    """With a bias of its own the oracle also returns dbias (the same as the T5 bias's
    cotangent); dtable must be its sum over the pairs of each (bucket, head)."""
    case = dataclasses.replace(CASES["fp32_mods_t5"], name="t5_bias", bias=True)
    inputs = make_inputs(case)
    oracle = references(inputs).oracle
    table = inputs.mod_aux["table"]
    q = np.arange(case.q_len)[:, None]
    k = np.arange(case.kv_len)[None, :]
    bucket = np.clip(k - q, -mods.T5_MAX_DISTANCE, mods.T5_MAX_DISTANCE) + mods.T5_MAX_DISTANCE
    want = np.zeros(table.shape)
    for h in range(case.q_heads):
        np.add.at(want[:, h], bucket.ravel(), oracle["dbias"][:, h].sum(0).ravel())
    np.testing.assert_allclose(oracle["dtable"], want, rtol=1e-10, atol=1e-12)
    assert np.abs(want).max() > 0.1


def test_a_mod_the_oracle_cannot_take_as_a_bias_is_refused():
    with pytest.raises(ValueError, match="not additive"):
        mods.check_additive(mods.Mods("scaled", score_mod=lambda xp, s, b, h, q, k: 2 * s), (1, 1, 4, 4), (),
                            np.random.default_rng(0))


def test_case_rules_name_the_field():
    with pytest.raises(ValueError, match="mods='nope'"):
        Case("x", mods="nope")
    with pytest.raises(ValueError, match="q_len == kv_len"):
        Case("x", q_len=8, kv_len=9, mods="documents")
    with pytest.raises(ValueError, match="block_size=16 needs mods with a mask_mod"):
        Case("x", mods="t5", block_size=16)


# --- implementations ---------------------------------------------------------------------------

JAX_CASES = [("jax_impl.xla", "fp32_mods_t5"), ("jax_impl.xla", "fp32_mods_documents_block16"),
             ("jax_impl.xla", "fp32_mods_empty_rows_block16"), ("jax_impl.xla", "fp32_mods_alibi_documents_window"),
             ("jax_impl.reference", "fp32_mods_alibi_gqa_causal_br_bias"),
             # the C++ kernel's row programs
             ("jax_impl.cpu", "fp32_mods_t5"), ("jax_impl.cpu", "fp32_mods_documents_block16"),
             ("jax_impl.cpu", "fp32_mods_empty_rows_block16"),
             ("jax_impl.cpu", "fp32_mods_alibi_documents_window"),
             ("jax_impl.cpu", "fp32_mods_alibi_gqa_causal_br_bias")]


@pytest.mark.parametrize("impl,case_name", JAX_CASES)
def test_jax_impl_passes_mods_cases_with_aux_gradients(impl, case_name, prepared):
    inputs, refs = prepared(case_name)
    result = run_one(get_adapter(impl, "cpu"), inputs, refs)
    assert result.status == PASS, (result.reason, _verdicts(result))
    assert {f"d{n}" for n, x in inputs.mod_aux.items() if x.dtype.kind == "f"} <= set(_verdicts(result))
    assert {"dq", "dk", "dv"} <= set(_verdicts(result)) and result.unjudged is None


@pytest.mark.parametrize("case_name", ["fp32_mods_t5", "fp32_mods_alibi_gqa_causal_br_bias",
                                       "fp32_mods_empty_rows_block16", "fp32_mods_soft_cap"])
def test_torch_flex_eager_passes_and_its_captured_tensor_gradients_are_judged(case_name, prepared):
    """On CPU PyTorch refuses flex_attention's q, k, v backward; the gradients of the tensors the
    score_mod captures (bias, table, slopes) it computes, and they are judged."""
    inputs, refs = prepared(case_name)
    result = run_one(get_adapter("torch.flex.eager", "cpu"), inputs, refs)
    assert result.status == PASS, (result.reason, _verdicts(result))
    captured = {f"d{n}" for n, x in inputs.mod_aux.items() if x.dtype.kind == "f"} | \
        ({"dbias"} if inputs.bias is not None else set())
    assert set(_verdicts(result)) == {"out"} | captured
    assert result.unjudged.startswith("dq, dk, dv not judged") and "backward on CPU" in result.unjudged


def test_torch_flex_compiled_runs_the_forward_and_reports_the_refused_backward():
    """torch.compile(flex_attention) on a tiny case (its one Inductor compilation takes ~15 s
    on a CPU): the forward is judged; PyTorch's refusal, raised while dynamo traces it, is the
    reason given for dq, dk, dv."""
    # head_dim 32: torch 2.13's compiled CPU kernel is wrong at head_dim 16 with BLOCK_SIZE 8
    # (max error 1.7 on a plain causal mask, its eager call exact).
    case = Case("tiny_documents", 1, 1, 1, 16, 16, 32, "float32", mods="documents", block_size=8, seed=1011)
    inputs = make_inputs(case)
    result = run_one(get_adapter("torch.flex.compiled", "cpu"), inputs, references(inputs))
    assert result.status == PASS, (result.reason, _verdicts(result))
    assert set(_verdicts(result)) == {"out"}
    assert result.unjudged.startswith("dq, dk, dv not judged") and "backward on CPU" in result.unjudged


def test_torch_flex_compiled_runs_only_on_request_on_cpu():
    assert "torch.flex.compiled" not in {a.name for a in available_adapters("cpu")}
    assert "only on request" in unavailable_adapters("cpu")["torch.flex.compiled"]
    assert "torch.flex.eager" in {a.name for a in available_adapters("cpu")}
    assert "torch.flex.compiled" in adapters("cpu")


def test_other_adapters_say_they_take_no_mods(prepared):
    for name in ("torch.sdpa.math", "jax.dense", "torch.manual"):
        result = run_one(get_adapter(name, "cpu"), *prepared("fp32_mods_t5"))
        assert result.status == NOT_SUPPORTED and "score_mod" in result.reason


# --- a wrong mod is caught ------------------------------------------------------------------------

def _documents_not_causal(xp, b, h, q_idx, kv_idx, doc):
    return doc[b, q_idx] == doc[b, kv_idx]


def _t5_reversed(xp, score, b, h, q_idx, kv_idx, table):
    d = mods.T5_MAX_DISTANCE
    return score + table[xp.clip(q_idx - kv_idx, -d, d) + d, h]


def _soft_cap_doubled(xp, score, b, h, q_idx, kv_idx):
    return 2 * mods.SOFT_CAP * xp.tanh(score / (2 * mods.SOFT_CAP))


WRONG = {"fp32_mods_documents_block16": ("documents", "mask_mod", _documents_not_causal),
         "fp32_mods_t5": ("t5", "score_mod", _t5_reversed),
         "fp32_mods_soft_cap": ("soft_cap", "score_mod", _soft_cap_doubled)}


@pytest.mark.parametrize("impl,case_name", [("jax_impl.xla", "fp32_mods_documents_block16"),
                                            ("jax_impl.xla", "fp32_mods_t5"),
                                            ("jax_impl.cpu", "fp32_mods_t5"),
                                            ("jax_impl.cpu", "fp32_mods_soft_cap"),
                                            ("torch.flex.eager", "fp32_mods_documents_block16"),
                                            ("torch.flex.eager", "fp32_mods_t5"),
                                            ("torch.flex.eager", "fp32_mods_soft_cap")])
def test_a_wrong_mod_in_the_implementation_fails(impl, case_name, prepared, monkeypatch):
    """The references come from the right mod; the adapter then runs a wrong one."""
    inputs, refs = prepared(case_name)
    mods_name, field, wrong = WRONG[case_name]
    monkeypatch.setitem(mods.MODS, mods_name, dataclasses.replace(mods.MODS[mods_name], **{field: wrong}))
    result = run_one(get_adapter(impl, "cpu"), inputs, refs)
    assert result.status == FAIL, (result.status, result.reason, _verdicts(result))
