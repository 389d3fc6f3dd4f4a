"""The ring's transfers can overlap its compute: read off the compiled HLO (8 CPU devices).

XLA:CPU emits every collective-permute synchronously (no -start/-done pair; this jaxlib has
no flag to change it), so overlap cannot be seen on CPU. What is tested is what lets an async
backend (XLA:GPU splits collective-permutes into start/done and its latency-hiding scheduler
moves the done past independent work) overlap them: inside the ring step's while body, the
K/V permutes neither depend on the step's compute (the per-pair lax.cond) nor feed it."""
import importlib.util
import os

import jax
import pytest

from _spawn import run_script


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_ring_kv_transfers_are_independent_of_the_step_compute(mode):
    report = run_script("ring_overlap.py", mode)
    forward, backward = sorted(report["bodies"], key=lambda b: b["permutes"])  # 2 and 4 sends
    assert forward["permutes"] == forward["independent"] == 2, report  # K and V
    # Backward: K, V and the dK/dV accumulators (one step behind, ring.ring_backward) all leave
    # before the step's compute and are added to after it.
    assert backward["permutes"] == 4 and backward["independent"] == 4, report
    assert report["async_starts"] == report["async_dones"]  # CPU: 0 and 0 (see docstring)


def _no_cuda_compiler() -> str | None:
    if tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11):
        return f"compiling for CUDA without a GPU needs jax >= 0.11 (this is {jax.__version__})"
    if importlib.util.find_spec("jax_plugins.xla_cuda13") is None and \
            importlib.util.find_spec("jax_cuda13_plugin") is None:
        return "compiling for CUDA without a GPU needs jax's CUDA plugin (pip install 'jax[cuda13]')"
    return None


# tests/cuda_compile_lane.sh sets CUDA_COMPILE_LANE=1: there a missing toolchain is a failure.
if os.environ.get("CUDA_COMPILE_LANE") == "1" and _no_cuda_compiler() is not None:
    raise RuntimeError(f"CUDA_COMPILE_LANE=1 but {_no_cuda_compiler()}")


@pytest.mark.skipif(_no_cuda_compiler() is not None, reason=str(_no_cuda_compiler()))
@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_each_ring_step_overlaps_its_send_on_a_gpu_compile(mode):
    """XLA:GPU (8 compile-only H100s, bf16 fwd+bwd): in both ring loops (forward, backward) every
    collective-permute is asynchronous, started before the step's compute (its conditionals)
    and done after it. Before the dK/dV accumulators travelled one step behind, XLA combined
    them with K/V into one send issued after the backward's compute."""
    report = run_script("ring_overlap_gpu.py", mode, timeout=600)
    bodies = report["bodies"]
    assert len(bodies) == 2, report  # the forward's ring and the backward's
    for body in bodies:
        assert body["sync_permutes"] == 0 and body["starts"] and body["dones"], body
        assert max(body["starts"]) < min(body["compute"]), body
        assert min(body["dones"]) > max(body["compute"]), body
