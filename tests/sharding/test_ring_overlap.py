"""The ring's transfers can overlap its compute: read off the compiled HLO (8 CPU devices).

XLA:CPU emits every collective-permute synchronously (no -start/-done pair; this jaxlib has
no flag to change it), so overlap cannot be seen on CPU. What is tested is what lets an async
backend (XLA:GPU splits collective-permutes into start/done and its latency-hiding scheduler
moves the done past independent work) overlap them: inside the ring step's while body, the
K/V permutes neither depend on the step's compute (the per-pair lax.cond) nor feed it."""
import pytest

from _spawn import run_script


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_ring_kv_transfers_are_independent_of_the_step_compute(mode):
    report = run_script("ring_overlap.py", mode)
    forward, backward = sorted(report["bodies"], key=lambda b: b["permutes"])  # 2 and 4 sends
    assert forward["permutes"] == forward["independent"] == 2, report  # K and V
    # Backward: K and V travel independently; dK/dV leave after the step that adds to them.
    assert backward["permutes"] == 4 and backward["independent"] == 2, report
    assert report["async_starts"] == report["async_dones"]  # CPU: 0 and 0 (see docstring)
