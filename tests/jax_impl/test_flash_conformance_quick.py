"""The conformance suite's quick cases, for jax_impl's blocked implementations, in CI.

The same path as ``python3 -m conformance --impl jax_impl.cpu --impl jax_impl.xla --impl
jax_impl.pallas_triton``:
the harness runs each case through the adapter and judges every output and gradient against
torch_ref in float64. A case must pass (or be declared not supported with a reason).
"""
from __future__ import annotations

import functools

import pytest

from conformance import harness, registry
from conformance.cases import SUITES, make_inputs
from conformance.oracle import references

IMPLEMENTATIONS = ("jax_impl.cpu", "jax_impl.xla", "jax_impl.pallas_triton")


@functools.lru_cache(maxsize=None)
def _inputs_and_references(case):
    inputs = make_inputs(case)
    return inputs, references(inputs)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", SUITES["quick"], ids=lambda case: case.name)
def test_quick_case_passes(case, implementation):
    result = harness.run_one(registry.get_adapter(implementation, "cpu"), *_inputs_and_references(case))
    if result.status == harness.NOT_SUPPORTED:
        assert result.reason, "a case declared not supported must say why"
        pytest.skip(result.reason)
    assert result.status == harness.PASS, (result.status, result.reason, result.worst)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", SUITES["decode"], ids=lambda case: case.name)
def test_decode_case_passes(case, implementation):
    """Few query rows against a longer dense or paged cache, on each one's decode path (cpu: the
    C++ kernel reads the pages in place; pallas_triton: the paged cases with pages of 16 and 64
    in the interpreter, its dense decode cases too large for it, pages of 7 refused)."""
    test_quick_case_passes(case, implementation)
