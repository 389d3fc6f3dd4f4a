"""Inputs: seeded, never zeros, the same bytes in every framework (bf16 included)."""
import ml_dtypes
import numpy as np
import pytest

from conformance.cases import SUITES, Case, make_inputs
from conformance.registry import adapters, get_adapter, load_plugin
from conformance.runs import TorchPrepared

ARRAYS = ("q", "k", "v", "cotangent", "bias", "mask", "q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids")


def _full_case(dtype, seed):
    return Case(f"full_{dtype}", 2, 4, 2, 19, 23, 16, dtype, mask="bool_heads", bias=True, lengths=True,
                segments=True, causal="bottom_right", seed=seed)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_make_inputs_is_seeded_and_never_zero(dtype):
    seed = int(np.random.default_rng().integers(1 << 30))
    a, b = make_inputs(_full_case(dtype, seed)), make_inputs(_full_case(dtype, seed))
    other = make_inputs(_full_case(dtype, seed + 1))
    for name in ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.tobytes() == y.tobytes(), name
    for name in ("q", "k", "v", "cotangent", "bias"):
        x = getattr(a, name)
        assert x.dtype == np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
        assert np.all(x.astype(np.float32) != 0), name
        assert x.tobytes() != getattr(other, name).tobytes(), name


def test_bf16_reaches_torch_and_jax_bit_exactly():
    case = Case("bits", 1, 2, 1, 8, 12, 16, "bfloat16", bias=True, seed=int(np.random.default_rng().integers(1 << 30)))
    inputs = make_inputs(case)
    # JAX: a plug-in that returns q hands back exactly the bytes it received
    jax_run = load_plugin("conformance_broken_plugins:returns_query", device="cpu").prepare(inputs, backward=True)
    jax_run.run()
    got = jax_run.results()
    assert np.array_equal(got["out"], inputs.q.astype(np.float64))
    assert np.array_equal(got["dq"], inputs.cotangent.astype(np.float64))
    # torch: the same through the torch adapters' input path
    torch_run = TorchPrepared(lambda Q, K, V, **kw: Q * 1, inputs, backward=True, device="cpu")
    torch_run.run()
    got = torch_run.results()
    assert np.array_equal(got["out"], inputs.q.astype(np.float64))
    assert np.array_equal(got["dq"], inputs.cotangent.astype(np.float64))
    assert np.array_equal(got["dbias"], np.zeros(inputs.bias.shape))


def test_probe_case_has_empty_rows_and_normal_cases_do_not():
    probe = next(c for c in SUITES["probes"] if c.name == "probe_empty_rows")
    assert make_inputs(probe).empty_row_count() > 0
    for case in SUITES["quick"]:
        if not case.lengths and not (case.causal == "bottom_right" and case.q_len > case.kv_len):
            assert make_inputs(case).empty_row_count() == 0, case.name


def test_quick_suite_covers_the_required_features():
    quick = SUITES["quick"]
    assert {c.dtype for c in quick} == {"float32", "float16", "bfloat16"}
    assert any(c.mask == "none" and not c.bias for c in quick)
    assert any(c.mask in ("bool", "bool_heads") for c in quick)
    assert any(c.bias for c in quick)
    for alignment in ("top_left", "bottom_right"):
        assert any(c.causal == alignment and c.q_len < c.kv_len for c in quick)
        assert any(c.causal == alignment and c.q_len > c.kv_len for c in quick)
    assert any(c.window for c in quick) and any(c.lengths for c in quick)
    assert any(c.segments for c in quick) and any(c.soft_cap for c in quick)
    assert any(c.kv_heads == 1 < c.q_heads for c in quick)
    assert any(1 < c.kv_heads < c.q_heads for c in quick)
    lengths = {c.q_len for c in quick} | {c.kv_len for c in quick}
    assert {1, 37, 129} <= lengths
    assert {40, 64, 128} <= {c.head_dim for c in quick}
    assert all(c.interpret_ok and max(c.q_len, c.kv_len) <= 129 for c in quick)
    assert len({c.name for c in quick}) == len(quick)


def test_registry_names_and_unsupported_reasons():
    for name in ("jax_impl.cpu", "jax_impl.xla", "jax_impl.pallas_triton", "jax_impl.reference", "jax.dense", "jax.nn.xla",
                 "jax.nn.cudnn", "jax.pallas.mha", "tokamax", "torch.manual", "torch.sdpa.auto",
                 "torch.sdpa.math", "torch.sdpa.flash", "torch.sdpa.efficient", "torch.sdpa.cudnn", "flash_attn"):
        assert name in adapters("cpu")
    segments = Case("seg", segments=True)
    assert "segment" in get_adapter("jax.nn.xla", "cpu").unsupported(segments)
    assert "CUDA" in get_adapter("jax.pallas.mha", "cpu").unsupported(segments) or \
        "cuda" in get_adapter("jax.pallas.mha", "cpu").unsupported(segments)
    assert get_adapter("jax.pallas.mha", "cuda")._reason(Case("gqa", q_heads=4, kv_heads=2)) is not None
    assert "soft cap" in get_adapter("torch.sdpa.math", "cpu").unsupported(Case("cap", soft_cap=5.0))
    assert get_adapter("jax_impl.xla", "cpu").unsupported(segments) is None
    assert get_adapter("jax_impl.cpu", "cpu").unsupported(segments) is None
    assert get_adapter("jax_impl.cpu", "cpu").unsupported(Case("bias", bias=True)) is None  # takes every feature
    assert "CPU" in get_adapter("jax_impl.cpu", "cuda").unsupported(segments)
