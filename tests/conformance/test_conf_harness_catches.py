"""The harness must fail broken attentions and pass jax_impl.xla on the same cases."""
import pytest

from conformance.cases import Case, make_inputs
from conformance.harness import FAIL, NOT_SUPPORTED, PASS, run_one
from conformance.oracle import references
from conformance.registry import get_adapter, load_plugin

PLUGINS = "conformance_broken_plugins"

CASES = {
    "multi_block": Case("multi_block", 1, 2, 2, 24, 48, 32, "float32", seed=301),
    "causal_q<k": Case("causal_q<k", 1, 2, 2, 24, 48, 32, "float32", causal="top_left", seed=302),
    "causal_br_q>k": Case("causal_br_q>k", 1, 2, 2, 40, 24, 32, "float32", causal="bottom_right", seed=303),
    "empty_rows": Case("empty_rows", 1, 2, 2, 16, 32, 32, "float32", mask="bool", empty_rows=True, seed=304),
    "bf16_bias": Case("bf16_bias", 1, 2, 2, 24, 48, 32, "bfloat16", bias=True, seed=305),
}

BROKEN = [
    ("per_block_softmax", "multi_block"),
    ("per_block_softmax", "bf16_bias"),
    ("unrescaled_running_max", "multi_block"),
    ("forgotten_scale", "multi_block"),
    ("forgotten_scale", "bf16_bias"),
    ("wrong_causal_alignment", "causal_q<k"),
    ("wrong_causal_alignment", "causal_br_q>k"),
    ("nan_empty_rows", "empty_rows"),
]


@pytest.fixture(scope="module")
def prepared_cases():
    out = {}
    for name, case in CASES.items():
        inputs = make_inputs(case)
        out[name] = (inputs, references(inputs))
    return out


@pytest.mark.parametrize("plugin,case_name", BROKEN)
def test_broken_attention_fails_where_jax_impl_xla_passes(plugin, case_name, prepared_cases):
    inputs, refs = prepared_cases[case_name]
    broken = run_one(load_plugin(f"{PLUGINS}:{plugin}", device="cpu"), inputs, refs)
    assert broken.status == FAIL, (plugin, case_name, broken.status, broken.reason)
    ours = run_one(get_adapter("jax_impl.xla", "cpu"), inputs, refs)
    assert ours.status == PASS, [(v.name, v.ratio) for v in ours.verdicts]


@pytest.mark.parametrize("case_name", sorted(CASES))
def test_correct_plugin_passes_every_case(case_name, prepared_cases):
    inputs, refs = prepared_cases[case_name]
    result = run_one(load_plugin(f"{PLUGINS}:correct", device="cpu"), inputs, refs)
    assert result.status == PASS, [(v.name, v.ratio) for v in result.verdicts]


def test_nan_empty_rows_is_flagged_as_confined_to_empty_rows(prepared_cases):
    inputs, refs = prepared_cases["empty_rows"]
    result = run_one(load_plugin(f"{PLUGINS}:nan_empty_rows", device="cpu"), inputs, refs)
    assert result.status == FAIL and result.note and "NaN" in result.note


def test_not_implemented_plugin_is_not_supported_not_a_failure(prepared_cases):
    inputs, refs = prepared_cases["multi_block"]
    result = run_one(load_plugin(f"{PLUGINS}:always_not_implemented", device="cpu"), inputs, refs)
    assert result.status == NOT_SUPPORTED
    assert "supports nothing" in result.reason


def test_plugin_without_a_feature_is_not_supported(prepared_cases):
    case = Case("window", 1, 2, 2, 16, 16, 32, "float32", window=(4, 4), seed=306)
    inputs = make_inputs(case)
    result = run_one(load_plugin(f"{PLUGINS}:correct", device="cpu"), inputs, references(inputs))
    assert result.status == NOT_SUPPORTED and "local_window_size" in result.reason
