"""Sequence-sharded inputs under plain jax.jit run as a ring: exact, no gathers, less memory."""
import pytest

from _spawn import run_script

TOL = 2e-5


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton"])
def test_sequence_sharded_jit_is_exact_and_gathers_nothing(implementation):
    """q, k, v (and segment ids) sharded P(None, "seq"); bias and mask sharded along their
    query rows with every key column, P(None, None, "seq", None). GQA, MQA, causal both
    alignments, window, lengths, a constant (not differentiated) bias; judged against torch_ref
    float64 (pallas: interpreted, the two configurations with its kernels' own features:
    segment ids, lengths, window and bottom-right; a bias and a mask with GQA)."""
    results = run_script("partition_sequence.py", "exact", implementation)
    assert len(results) == (5 if implementation == "xla" else 2)
    for config, r in results.items():
        assert r["all_gathers"] == 0, config
        assert r["permutes"] > 0, config  # the ring's ppermutes
        assert r["out_spec"] == "(None, 'seq')", config
        assert r["warnings"] == [], config
        if "bias" in config and "constant" not in config:
            assert r["dbias_spec"] == "(None, None, 'seq')", config  # rows sharded like the bias
            assert "dbias" in r["errors"], config
        assert max(r["errors"].values()) < TOL, (config, r["errors"])


def test_sequence_sharded_memory_per_device_falls_with_devices():
    """L=32768, H=8, D=64 fp32, causal: arguments + temporaries per device on 8 devices are at
    most 0.3x the one-device figure (compiled, not run)."""
    figures = run_script("partition_sequence.py", "memory")
    for name in ("forward", "forward_backward"):
        one, eight = figures[f"{name}_1"], figures[f"{name}_8"]
        assert eight["all_gathers"] == 0
        assert eight["bytes"] <= 0.3 * one["bytes"], (name, eight["bytes"] / one["bytes"])
