"""Outputs and gradients of the blocked implementations against the float64 torch oracle.

Judged by conformance.tolerance: max error at most 2x (outputs) or 3x (gradients) a plain
same-dtype implementation's error, plus the dtype's rounding floor.
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conformance import tolerance
from conformance.cases import Case
from jax_impl import BlockSizes, masking, pallas_triton
from jax_impl.implementations import IMPLEMENTATIONS
from jax_impl.config import AttentionConfig
from jax_impl.flash_attention import flash_attention
import backends
from _flash_helpers import DTYPES, assert_judged_correct, baseline, oracle, run, torch_arrays

PROBLEMS = [
    Case("plain-fp32", q_len=37, kv_len=37, kv_heads=2),
    Case("plain-bf16", q_len=37, kv_len=37, kv_heads=2, dtype="bfloat16", seed=1),
    Case("plain-fp16-mqa", q_len=37, kv_len=37, kv_heads=1, dtype="float16", seed=2),
    Case("causal-topleft-lq<lk-d40", q_len=37, kv_len=129, kv_heads=2, head_dim=40,
         causal="top_left", seed=3),
    Case("causal-bottomright-lq>lk", q_len=129, kv_len=37, kv_heads=2, causal="bottom_right", seed=4),
    Case("bottomright-lengths-bf16", q_len=37, kv_len=129, kv_heads=2, dtype="bfloat16",
         causal="bottom_right", lengths=True, seed=5),
    Case("window-d128-fp16", q_len=129, kv_len=129, q_heads=2, kv_heads=2, head_dim=128,
         dtype="float16", window=(8, 4), seed=6),
    Case("causal-window-left", q_len=129, kv_len=129, kv_heads=2, causal="top_left",
         window=(16, None), seed=7),
    Case("dense-mask-empty-rows", q_len=37, kv_len=37, mask="bool_heads", empty_rows=True, seed=8),
    Case("bias-shared-batch-causal", q_len=37, kv_len=37, kv_heads=2, bias=True,
         bias_shape="shared_batch", causal="top_left", seed=9),
    Case("bias-softcap-key-padding", q_len=37, kv_len=37, bias=True, soft_cap=2.0,
         mask="key_padding", seed=10),
    Case("segments-gqa4", q_len=37, kv_len=37, kv_heads=1, segments=True, seed=11),
    Case("decode-lq1", q_len=1, kv_len=129, kv_heads=1, causal="bottom_right", lengths=True, seed=12),
    Case("single-key-d16", q_len=1, kv_len=1, head_dim=16, batch=1, seed=13),
]

SOME = {  # the problems the slow or special-purpose variants run (backends.SOME_PROBLEMS)
    ("xla", "16x32-tiles"): ("causal-bottomright-lq>lk", "bottomright-lengths-bf16", "causal-window-left",
                             "bias-shared-batch-causal", "segments-gqa4"),
    ("pallas_triton", "split-dkdv"): ("causal-topleft-lq<lk-d40", "bias-softcap-key-padding",
                                      "segments-gqa4", "dense-mask-empty-rows"),
}
SOME[("cpu", "16x64-tiles")] = SOME[("xla", "16x32-tiles")]
SOME[("mosaic_tpu", "interpret")] = ("causal-bottomright-lq>lk", "bias-softcap-key-padding",
                                     "segments-gqa4")
GRID = [pytest.param(p, options, id=f"{p.name}-{param.id}", marks=param.marks)
        for param in backends.params() for name, options in [param.values] for p in PROBLEMS
        if p.name in SOME.get((name, param.id[len(name) + 1:]), [p.name]) and backends.takes(name, p)]


def test_every_implementation_declares_its_variants():
    assert set(backends.VARIANTS) | set(backends.GPU_VARIANTS) == set(IMPLEMENTATIONS)
    assert set(SOME) == backends.SOME_PROBLEMS


@functools.lru_cache(maxsize=None)
def _oracle_and_baseline(problem: Case):
    return oracle(problem), baseline(problem)


@pytest.mark.parametrize("problem, options", GRID)
def test_matches_float64_oracle(problem, options):
    results = run(problem, DTYPES[problem.dtype], **options)
    assert_judged_correct(results, *_oracle_and_baseline(problem), problem.dtype)


def test_split_dkdv_tiles_run_dv_and_dk_as_two_kernels():
    """The split-dkdv entry of the grid is what it says: its backward has no dK/dV kernel."""
    problem = next(p for p in PROBLEMS if p.name == SOME[("pallas_triton", "split-dkdv")][0])
    q = jax.ShapeDtypeStruct((1, problem.q_len, 2, problem.head_dim), jnp.float32)
    k = jax.ShapeDtypeStruct((1, problem.kv_len, 2, problem.head_dim), jnp.float32)
    options = dict(backends.VARIANTS["pallas_triton"]["split-dkdv"], implementation="pallas_triton")
    jaxpr = jax.make_jaxpr(jax.grad(lambda q, k: jnp.sum(flash_attention(q, k, k, **options)), (0, 1)))(q, k)
    names = set(re.findall(r"name=(flash_attention_\w+)", str(jaxpr)))  # inside custom_vjp
    assert names == {"flash_attention_forward", "flash_attention_backward_dv",
                     "flash_attention_backward_dk", "flash_attention_backward_dq"}


def test_oracle_is_not_trivially_passed():
    """A wrong answer (the scale forgotten) must fail the same judgement."""
    problem = PROBLEMS[0]
    reference, plain = _oracle_and_baseline(problem)
    wrong = run(problem, jnp.float32, "xla", scale=1.0)
    verdict = tolerance.judge("out", wrong["out"], reference["out"], plain["out"], "float32")
    assert not verdict.passed


@pytest.mark.parametrize("bias_gradient", [False, True])
def test_pallas_backward_with_a_constant_bias_writes_no_dbias(bias_gradient):
    """cfg.bias_gradient=False (the bias is not differentiated): the dQ kernel writes no dS, and
    dq, dk, dv stay exact; True: dS lands in a zeroed buffer, exact inside and outside the band."""
    rng = np.random.default_rng(21)
    b, length, heads, d = 1, 70, 2, 16
    q, k, v, ct = (rng.standard_normal((b, length, heads, d)).astype(np.float32) for _ in range(4))
    bias = rng.standard_normal((b, heads, length, length)).astype(np.float32)
    cfg = AttentionConfig(scale=d ** -0.5, mask=masking.MaskSpec(is_causal=True), interpret=True,
                          block_sizes=BlockSizes(16, 16, 16, 16, 16, 16), bias_gradient=bias_gradient)
    lengths = jnp.full((b,), length, jnp.int32)
    masks = masking.MaskInputs(lengths, lengths, None, None, None)

    def backward(q, k, v, bias, ct):
        out, stats = pallas_triton.forward(cfg, q, k, v, bias, masks)
        delta = jnp.sum(out * ct, axis=-1).transpose(0, 2, 1)          # [B, Hq, Lq]
        return pallas_triton.backward(cfg, q, k, v, bias, masks, stats, ct, delta)

    dq, dk, dv, dbias, _ = backward(q, k, v, bias, ct)
    reference = torch_arrays(q, k, v, ct, bias=bias, is_causal=True)
    plain = torch_arrays(q, k, v, ct, dtype=np.float32, bias=bias, is_causal=True)
    results = {"dq": dq, "dk": dk, "dv": dv}
    if bias_gradient:
        results["dbias"] = dbias
    else:
        assert dbias is None
    for name, value in results.items():
        verdict = tolerance.judge(name, np.asarray(value, np.float64), reference[name], plain[name], "float32")
        assert verdict.passed, verdict
    # The dQ kernel has a dS output only when dbias is wanted.
    jaxpr = jax.make_jaxpr(backward)(q, k, v, bias, ct)
    dq_call, = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"
                and e.params["name"] == "flash_attention_backward_dq"]
    assert len(dq_call.outvars) == (2 if bias_gradient else 1)
    # dbias is a zeroed buffer the kernel updates in place (so it skips the tiles the causal
    # band excludes, as without dbias): the last input aliases the second output.
    aliases = dict(dq_call.params["input_output_aliases"])
    assert aliases == ({len(dq_call.invars) - 1: 1} if bias_gradient else {})


BIT_IDENTITY = Case("bit-identity", batch=2, q_len=77, kv_len=130, kv_heads=2, causal="bottom_right",
                    lengths=True, bias=True, dropout=0.2, sinks=True, seed=31)


@pytest.mark.parametrize("implementation, options", backends.params(
    lambda name, variant: variant in ("default", "interpret", "compiled")
    and backends.takes(name, BIT_IDENTITY)))
def test_repeated_forward_and_backward_are_bit_identical(implementation, options):
    """The same call twice gives the same bits, outputs and every gradient (no atomics, no
    order that depends on thread timing), with every feature that has a kernel path on."""
    first = run(BIT_IDENTITY, jnp.float32, **options)
    second = run(BIT_IDENTITY, jnp.float32, **options)
    assert set(first) == {"out", "dq", "dk", "dv", "dbias", "dsinks"}
    for name in first:
        assert np.array_equal(first[name], second[name], equal_nan=True), name
        assert np.all(np.isfinite(first[name])) and np.any(first[name] != 0), name
