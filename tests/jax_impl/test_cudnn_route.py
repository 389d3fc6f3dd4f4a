"""implementation="cudnn": jax.nn's cuDNN kernel by name, only for calls whose meaning is ours.

No GPU here: the refusals are checked as they are, and the route itself with jax.nn's function
replaced by its xla path (the arguments must reach jax.nn in jax.nn's meaning, so that the
result equals the float64 oracle on this library's semantics)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conformance.cases import Case
from jax_impl import cudnn
from jax_impl.flash_attention import explain_implementation, flash_attention

from _flash_helpers import DTYPES, assert_judged_correct, baseline, oracle, run


def _qkv(dtype=jnp.bfloat16, lq=32, lk=48, seed=0):
    rng = np.random.default_rng(seed)
    draw = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
    return draw(2, lq, 4, 16), draw(2, lk, 2, 16), draw(2, lk, 2, 16)


REFUSED = {  # keyword arguments -> the name the error must give
    "mask": (dict(mask=jnp.ones((32, 48), bool)), "mask"),
    "lengths": (dict(key_value_seq_lengths=jnp.array([48, 20])), "key_value_seq_lengths"),
    "window": (dict(local_window_size=(8, 0)), "local_window_size"),
    "soft_cap": (dict(logits_soft_cap=30.0), "logits_soft_cap"),
    "sinks": (dict(attention_sinks=jnp.zeros(4)), "attention_sinks"),
    "segments": (dict(q_segment_ids=jnp.zeros((2, 32), jnp.int32),
                      kv_segment_ids=jnp.zeros((2, 48), jnp.int32)), "q_segment_ids"),
    "residual": (dict(return_residual=True), "return_residual"),
    "bottom_right": (dict(is_causal=True, causal_alignment="bottom_right"), "causal_alignment"),
    "dropout": (dict(dropout_rate=0.1, deterministic=False, dropout_rng=jax.random.key(0)), "dropout"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refuses_what_cudnn_means_otherwise(name):
    kwargs, named = REFUSED[name]
    with pytest.raises(ValueError, match=f"implementation='cudnn' cannot run this call: .*{named}"):
        flash_attention(*_qkv(), implementation="cudnn", **kwargs)


def test_refuses_float32_and_runs_on_cuda_only():
    with pytest.raises(ValueError, match="float16/bfloat16 only; got float32"):
        flash_attention(*_qkv(jnp.float32), implementation="cudnn")
    with pytest.raises(ValueError, match="on a CUDA GPU only; JAX's default backend is 'cpu'"):
        flash_attention(*_qkv(), implementation="cudnn", is_causal=True)


def test_explain_names_the_route_from_the_table():
    """cuDNN is an entry of the table like the others: named, it is the choice on a CUDA GPU;
    on a CPU explain refuses it with the table's reason, as the automatic choice lists it."""
    choice = explain_implementation(*_qkv(), implementation="cudnn", platform="cuda")
    assert choice.chosen == "cudnn" and choice.reasons["cudnn"] is None
    assert choice.reasons["xla"] == "implementation='cudnn' was requested"
    assert "runs on the CPU" in choice.reasons["cpu"]
    with pytest.raises(ValueError, match="cudnn kernel needs a CUDA GPU; platform is 'cpu'"):
        explain_implementation(*_qkv(), implementation="cudnn", platform="cpu")
    automatic = explain_implementation(*_qkv(), platform="cuda")
    assert automatic.reasons["cudnn"].startswith("never chosen automatically")


@pytest.mark.parametrize("causal", [None, "top_left"])
def test_route_means_this_librarys_attention(monkeypatch, causal):
    """With jax.nn's cuDNN call served by its xla path: output and gradients (q, k, v, bias)
    against the float64 oracle; GQA, Lq != Lk, a bias, bf16."""
    seen = []
    original = jax.nn.dot_product_attention

    def cudnn_as_xla(*args, implementation=None, **kwargs):
        seen.append(implementation)
        return original(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(cudnn, "CUDA_PLATFORMS", (jax.default_backend(),))
    monkeypatch.setattr(jax.nn, "dot_product_attention", cudnn_as_xla)
    case = Case("cudnn_route", batch=2, q_heads=4, kv_heads=2, q_len=40, kv_len=56, head_dim=32,
                dtype="bfloat16", bias=True, causal=causal, seed=3)
    results = run(case, DTYPES[case.dtype], "cudnn")
    assert seen and set(seen) == {"cudnn"}
    assert_judged_correct(results, oracle(case), baseline(case), case.dtype)
