"""jax_impl.mosaic_tpu (the Pallas TPU kernels) in the TPU interpreter on CPU, through the
conformance harness: a few quick cases, outputs and gradients judged against torch_ref's
float64 manual_attention (the same path as ``python3 -m conformance --impl jax_impl.mosaic_tpu``).
Tiny on purpose: the interpreter runs every grid step in Python."""
from __future__ import annotations

import pytest

from conformance import harness, registry
from conformance.cases import SUITES, make_inputs
from conformance.oracle import references

CASES = ("fp32_causal_bottom_right_q<k", "fp32_segments", "bf16_mqa_causal")


@pytest.mark.parametrize("case", [c for c in SUITES["quick"] if c.name in CASES], ids=lambda c: c.name)
def test_quick_case_passes_in_the_tpu_interpreter(case):
    adapter = registry.get_adapter("jax_impl.mosaic_tpu", "cpu")
    if adapter.available():
        pytest.skip(adapter.available())
    assert adapter.interpret
    inputs = make_inputs(case)
    result = harness.run_one(adapter, inputs, references(inputs))
    if result.status == harness.NOT_SUPPORTED:
        assert result.reason, "a case declared not supported must say why"
        pytest.skip(result.reason)
    assert result.status == harness.PASS, (result.status, result.reason, result.worst)


def test_the_cases_are_in_the_quick_suite():
    assert set(CASES) <= {c.name for c in SUITES["quick"]}
