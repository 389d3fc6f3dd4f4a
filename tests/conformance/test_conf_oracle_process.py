"""conformance.oracle's out-of-process oracle: where torch is not importable (the CUDA compile
lane's Python 3.12 venv), ``$ORACLE_PYTHON`` runs torch_ref in another Python; its numbers
must be the in-process oracle's, bit for bit, in float64 and in the case dtype."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from conformance import oracle
from conformance.cases import Case, make_inputs

CASE = Case("bf16-gqa-causal-window-lengths-segments-sinks-bias", q_len=40, kv_len=56, q_heads=4,
            kv_heads=2, dtype="bfloat16", causal="bottom_right", window=(20, None), lengths=True,
            segments=True, sinks=True, bias=True, soft_cap=5.0, seed=7)


@pytest.fixture
def server(monkeypatch):
    """The oracle as the lane runs it: this Python, in a process of its own."""
    monkeypatch.setenv(oracle.ORACLE_PYTHON, sys.executable)
    server = oracle._Server(sys.executable)
    yield server
    server.process.kill()


@pytest.mark.parametrize("dtype", [np.float64, None], ids=["oracle", "baseline"])
def test_the_oracle_in_another_python_gives_the_same_numbers(server, dtype):
    inputs = make_inputs(CASE)
    cast = (lambda x: None if x is None else np.asarray(x).astype(dtype)) if dtype else (lambda x: x)
    kwargs = dict(inputs.attention_kwargs(), mask=inputs.mask)
    kwargs = {n: x for n, x in kwargs.items() if x is not None}
    args = (cast(inputs.q), cast(inputs.k), cast(inputs.v), cast(inputs.cotangent))
    here = oracle.manual_with_grads(*args, bias=cast(inputs.bias), **kwargs)
    there = server.call(dict(kwargs, bias=cast(inputs.bias), q=args[0], k=args[1], v=args[2],
                             cotangent=args[3]))
    assert set(there) == set(here) == {"out", "dq", "dk", "dv", "dbias", "dsinks"}
    for name in here:
        assert there[name].dtype == np.float64, name
        np.testing.assert_array_equal(there[name], here[name], err_msg=name)


def test_a_failing_call_names_the_python_it_ran_in(server):
    q = np.ones((1, 8, 2, 16))
    with pytest.raises(RuntimeError, match=r"the oracle in ORACLE_PYTHON=.*failed: error "
                                           r"TypeError: cotangent dtype"):
        server.call(dict(q=q, k=q, v=q, cotangent=q.astype(np.float32)))
