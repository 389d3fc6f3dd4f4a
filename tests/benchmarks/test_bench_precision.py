"""benchmarks.precision_error: the GPU input-rounding emulation and its table."""
import numpy as np

from benchmarks import precision_error


def test_tf32_and_bf16_rounding_keep_10_and_7_mantissa_bits_ties_to_even():
    one = np.float32(1.0)
    assert precision_error._tf32(one + np.float32(2.0 ** -10)) == 1 + 2.0 ** -10  # representable
    assert precision_error._tf32(one + np.float32(2.0 ** -11)) == 1.0             # tie: to even
    assert precision_error._tf32(one + np.float32(3 * 2.0 ** -11)) == 1 + 2.0 ** -9  # tie: to even
    assert precision_error._tf32(-(one + np.float32(2.0 ** -10 + 2.0 ** -12))) == -(1 + 2.0 ** -10)
    assert precision_error._bf16(one + np.float32(2.0 ** -8)) == 1.0
    assert precision_error._bf16(one + np.float32(2.0 ** -7)) == 1 + 2.0 ** -7


def test_emulated_errors_rank_as_the_presets_rounding_does():
    results = precision_error.measure(1, 1, 32, 16, seeds=1)
    worst = {name: max(v[0] for v in row["emulated"].values()) for name, row in results.items()}
    assert worst["BF16_BF16_F32"] > worst["TF32_TF32_F32"] > worst["BF16_BF16_F32_X3"] \
        > worst["TF32_TF32_F32_X3"] > worst["HIGHEST"]
    assert worst["BF16_BF16_F32_X9"] < 1e-6 and worst["BF16_BF16_F32_X6"] < 1e-6
    assert results["TF32_TF32_F32"]["cpu"]["out"] == []  # refused on the CPU: no measurement
    table = precision_error.table(results)
    assert "| TF32_TF32_F32 | out | refused |" in table
