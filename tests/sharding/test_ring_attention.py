"""ring_attention (context parallelism) inside shard_map: exact against the float64 oracle."""
import numpy as np
import pytest

from _spawn import run_script
from jax_impl import ring

TOL = 2e-5  # float32 blocked attention vs float64 dense, unit-normal inputs, L <= 64


def _check(errors, names):
    assert set(errors) == set(names)
    for config, errs in errors.items():
        differentiated_bias = "bias" in config and "constant" not in config
        expected = {"out", "dq", "dk", "dv"} | ({"dbias"} if differentiated_bias else set())
        assert set(errs) == expected, config
        assert max(errs.values()) < TOL, (config, errs)


def test_ring_xla_matches_float64_oracle():
    """Causal in both alignments, window, lengths (one row empty), segment ids, GQA, Lq != Lk,
    zigzag and contiguous layouts, bias (per head, broadcast) and dense mask: out, dq, dk, dv,
    dbias against torch_ref.manual_attention in float64; and a constant bias (no dbias)."""
    names = ("causal_top_left", "bottom_right_gqa_window_lengths_segments",
             "contiguous_window_kv_lengths", "bias_causal_gqa",
             "bias_broadcast_mask_bottom_right_lengths", "contiguous_bias_mask_window",
             "constant_bias_causal")
    _check(run_script("ring_exact.py", "xla", *names), names)


def test_ring_pallas_interpret_matches_float64_oracle():
    """The same ring with the Pallas kernels (interpreter) as the local step: the per-pair
    position offset reaches the forward, dK/dV and dQ kernels."""
    names = ("causal_top_left", "bottom_right_gqa_window_lengths_segments",
             "bias_broadcast_mask_bottom_right_lengths", "contiguous_bias_mask_window")
    _check(run_script("ring_exact.py", "pallas_triton", *names), names)


def test_ring_pallas_interpreter_under_check_vma_is_refused_by_name():
    message = run_script("ring_exact.py", "refusal")["message"]
    assert message and "interpret=True" in message and "check_vma=False" in message


def _causal_work(layout, n, length):
    """Allowed (query, key) pairs of a top-left causal mask each device's queries own."""
    if layout == "zigzag":
        positions = ring.zigzag_permutation(length, n).reshape(n, -1)
    else:
        positions = np.arange(length).reshape(n, -1)
    return (positions + 1).sum(axis=1)  # query i sees keys 0..i


def test_zigzag_balances_causal_work_on_8_devices():
    work = _causal_work("zigzag", 8, 32768)
    assert work.max() / work.min() <= 1.2
    assert work.sum() == 32768 * 32769 // 2  # every query row is owned exactly once
    contiguous = _causal_work("contiguous", 8, 32768)
    assert contiguous.max() / contiguous.min() > 10  # what the reordering fixes


def test_zigzag_round_trip_and_layout():
    x = np.arange(32)
    z = np.asarray(ring.to_zigzag(x, 4, 0))
    assert list(z[:8]) == [0, 1, 2, 3, 28, 29, 30, 31]  # device 0: chunks 0 and 7 of 8
    assert (np.asarray(ring.from_zigzag(z, 4, 0)) == x).all()
    with pytest.raises(ValueError, match="multiple of 2 \\* num_devices"):
        ring.zigzag_permutation(30, 4)
