"""precision=: lax.Precision or, for float32 inputs, a jax.lax.DotAlgorithmPreset; judged
against the float64 oracle where the platform runs it, refused by name where it cannot."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _flash_helpers import torch_arrays
from jax_impl.arguments import GPU_ONLY_PRESETS, PRECISION_PRESETS
from jax_impl.flash_attention import flash_attention

presets = jax.lax.DotAlgorithmPreset
CPU_PRESETS = [p for p in PRECISION_PRESETS if p not in GPU_ONLY_PRESETS]
# The error each preset may have on a GPU (input rounding: bf16 keeps 8 significant bits,
# tf32 11; the split presets recover about fp32). XLA:CPU computes every CPU_PRESET in full
# fp32, so on this machine they all meet the fp32 bound; the bounds matter on a GPU.
TOLERANCE = {presets.F32_F32_F32: 2e-5, presets.BF16_BF16_F32: 5e-2,
             presets.BF16_BF16_F32_X3: 1e-3, presets.BF16_BF16_F32_X6: 2e-5,
             presets.TF32_TF32_F32: 5e-3, presets.TF32_TF32_F32_X3: 2e-5,
             presets.BF16_BF16_F32_X9: 2e-5}
IMPLEMENTATIONS = {"xla": {}, "pallas_triton": dict(interpret=True)}


def _inputs(seed, shape=(1, 64, 2, 16)):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(np.float32) for _ in range(4))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("preset", CPU_PRESETS, ids=lambda p: p.name)
def test_each_cpu_preset_matches_the_oracle(preset, implementation):
    q, k, v, cotangent = _inputs(0)
    attend = lambda q, k, v: flash_attention(q, k, v, is_causal=True, precision=preset,
                                             implementation=implementation,
                                             **IMPLEMENTATIONS[implementation])
    out, vjp = jax.vjp(attend, q, k, v)
    got = dict(zip(("out", "dq", "dk", "dv"), (out, *vjp(jnp.asarray(cotangent)))))
    oracle = torch_arrays(q, k, v, cotangent, is_causal=True)
    for name, value in got.items():
        np.testing.assert_allclose(np.asarray(value, np.float64), oracle[name],
                                   atol=TOLERANCE[preset], rtol=0, err_msg=name)


@pytest.mark.parametrize("implementation", [*IMPLEMENTATIONS, "reference", None])
@pytest.mark.parametrize("preset", GPU_ONLY_PRESETS, ids=lambda p: p.name)
def test_gpu_only_presets_on_cpu_say_where_they_run(preset, implementation):
    q, k, v, _ = _inputs(1, (1, 16, 2, 16))
    extra = IMPLEMENTATIONS.get(implementation, {})
    with pytest.raises(NotImplementedError, match=rf"precision={preset.name} runs only on a CUDA GPU"
                                                  r".*'cpu'.*BF16_BF16_F32_X6"):
        flash_attention(q, k, v, precision=preset, implementation=implementation, **extra)


@pytest.mark.parametrize("precision, dtype, match", [
    ("tf32x3", jnp.float32, r"precision='tf32x3' must be a jax.lax.Precision.*TF32_TF32_F32_X3"),
    (presets.BF16_BF16_BF16, jnp.float32, "must accumulate in float32"),
    (presets.F16_F16_F32, jnp.float32, "must accumulate in float32 and be one of"),
    (presets.DEFAULT, jnp.float32, "be one of F32_F32_F32"),
    (presets.BF16_BF16_F32, jnp.bfloat16, "applies to float32 inputs only; bfloat16 inputs"),
    (presets.TF32_TF32_F32_X3, jnp.float16, "applies to float32 inputs only"),
])
def test_unsupported_precision_is_refused_by_name(precision, dtype, match):
    q = jnp.ones((1, 8, 1, 16), dtype)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, q, q, precision=precision)


def test_highest_stays_the_default():
    q = jax.ShapeDtypeStruct((1, 32, 2, 16), jnp.float32)
    lowered = lambda **kw: jax.jit(lambda q: flash_attention(q, q, q, implementation="xla", **kw)).lower(q).as_text()
    assert set(re.findall(r"precision = \[\w+, \w+\]", lowered())) == {"precision = [HIGHEST, HIGHEST]"}
    # The check can fail: another precision shows in the lowered dots.
    assert "precision = [DEFAULT, DEFAULT]" in lowered(precision=jax.lax.Precision.DEFAULT)


PRECISION = jax.lax.Precision
# Every spelling jnp.dot takes (and upper/title case), and the enum member it means.
PRECISION_STRINGS = [
    *[(spelling, p) for p in PRECISION for spelling in (p.name.lower(), p.name, p.name.title())],
    ("fastest", PRECISION.DEFAULT), ("bfloat16", PRECISION.DEFAULT), ("bfloat16_3x", PRECISION.HIGH),
    ("tensorfloat32", PRECISION.HIGH), ("float32", PRECISION.HIGHEST),
    ("f32_f32_f32", presets.F32_F32_F32), ("BF16_BF16_F32_X6", presets.BF16_BF16_F32_X6),
    (("high", "HIGH"), PRECISION.HIGH),
]


def _lowered(precision, shape=(1, 32, 2, 16)):
    q = jax.ShapeDtypeStruct(shape, jnp.float32)
    return jax.jit(lambda q, k, v: flash_attention(q, k, v, is_causal=True, implementation="xla",
                                                   precision=precision)).lower(q, q, q).as_text()


@pytest.mark.parametrize("spelling, member", PRECISION_STRINGS, ids=str)
def test_precision_strings_mean_their_enum_member(spelling, member):
    # The lowered dots name the precision (XLA:CPU computes every one in fp32, so values alone
    # could not tell a wrong mapping).
    assert _lowered(spelling) == _lowered(member)
    if isinstance(member, PRECISION):
        assert f"precision = [{member.name}, {member.name}]" in _lowered(spelling)
    q, k, v, cotangent = _inputs(2)
    out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, is_causal=True, precision=spelling),
                       q, k, v)
    got = dict(zip(("out", "dq", "dk", "dv"), (out, *vjp(jnp.asarray(cotangent)))))
    oracle = torch_arrays(q, k, v, cotangent, is_causal=True)
    for name, value in got.items():
        np.testing.assert_allclose(np.asarray(value, np.float64), oracle[name], atol=2e-5, rtol=0,
                                   err_msg=name)


@pytest.mark.parametrize("precision, dtype, error, match", [
    ("fast", jnp.float32, ValueError, r"precision='fast' must be a jax.lax.Precision, one of "
                                      r"'default', 'high', 'highest'"),
    ("highest ", jnp.float32, ValueError, r"precision='highest ' must be a jax.lax.Precision"),
    ("bf16_bf16_f32", jnp.bfloat16, ValueError, "applies to float32 inputs only"),
    (("high", "highest"), jnp.float32, ValueError, "only a pair of equal precisions"),
    (("high", "nope"), jnp.float32, ValueError, r"precision='nope' must be"),
    (2, jnp.float32, TypeError, r"precision=2 must be None, a jax.lax.Precision or its name"),
])
def test_bad_precision_strings_are_refused_by_name(precision, dtype, error, match):
    q = jnp.asarray(_inputs(3, (1, 8, 1, 16))[0], dtype)
    with pytest.raises(error, match=match):
        flash_attention(q, q, q, precision=precision)
