"""bfloat16 calls on the CPU's bfloat16 dot-product units (cpu_kernel/bf16_dot.h, AVX512-BF16):
they lower to the bfloat16 kernels where the build has them, round P to bfloat16 only where it
meets V (the softmax's sum keeps every unrounded p, as torch's CPU kernel and FlashAttention),
give decode the RowStats the bfloat16 backward needs, and the widened float32 path stays
selectable. Whether they pass the oracle's tolerances: cpu_fuzz (every family draws bf16) and
test_cpu_kernel_harness.py's drawn calls, under the sanitizers."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_impl import BlockSizes, arguments, cpu_kernel
from jax_impl.cpu_kernel import build
from jax_impl.flash_attention import flash_attention

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not build.bf16_products(),
                                reason="the CPU kernel here has no bfloat16 products (no AVX512-BF16)")


def _targets(q, k, v, **kw) -> set:
    """The CPU kernel's custom calls in the forward and backward of one call."""
    f = lambda q, k, v: jnp.sum(flash_attention(q, k, v, implementation="cpu", **kw).astype(jnp.float32))
    return set(re.findall(r"jax_flash_attention_cpu_\w+", jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, k, v).as_text()))


def test_bfloat16_calls_lower_to_the_bfloat16_kernels_and_others_do_not():
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((1, 70, 2, 40)), jnp.bfloat16) for _ in range(3))
    assert _targets(q, k, v, is_causal=True) == {"jax_flash_attention_cpu_forward_bf16",
                                                 "jax_flash_attention_cpu_backward_bf16"}
    for dtype in (jnp.float32, jnp.float16):  # float16: widened (no AVX512-FP16 products here)
        assert _targets(*(x.astype(dtype) for x in (q, k, v))) == {
            "jax_flash_attention_cpu_forward", "jax_flash_attention_cpu_backward"}, dtype


def _rounding_probe(rng, n: int):
    """(q, k, v, rounded, unrounded): one query row, n keys, v's first feature the sign of
    bfloat16's rounding of each p_j = exp(S_j - max), so that those roundings add up instead
    of cancelling; the first output feature with P rounded to bfloat16 for P.V and without."""
    q = (0.05 * rng.standard_normal((1, 1, 1, 64))).astype(ml_dtypes.bfloat16)  # p in (0.8, 1]
    k = rng.standard_normal((1, n, 1, 64)).astype(ml_dtypes.bfloat16)
    q64, k64 = (np.asarray(x, np.float64)[0, :, 0] for x in (q, k))
    s = q64 @ k64.T / 8.0
    p = np.exp(s - s.max(-1, keepdims=True))[0]
    error = p.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64) - p
    v = rng.standard_normal((1, n, 1, 64))
    v[0, :, 0, 0] = np.sign(error)
    v = v.astype(ml_dtypes.bfloat16)
    v0 = np.asarray(v, np.float64)[0, :, 0, 0]
    return q, k, v, ((p + error) @ v0) / p.sum(), (p @ v0) / p.sum()


def test_p_is_rounded_to_bfloat16_only_where_it_meets_v():
    """One query row against one key tile (block_k 256: the running max is the row's max), so
    the kernel's out is sum_j bf16(p_j) v_j / sum_j p_j (the sum of the unrounded p). Drawn
    until the rounded and the unrounded value lie more than 3 half-ulps of bfloat16 apart (out
    is rounded to bfloat16 on return): out is within a half-ulp of the rounded one only."""
    rng = np.random.default_rng()
    half_ulp = lambda x: float(np.spacing(np.float32(abs(x)).astype(ml_dtypes.bfloat16))) / 2
    for _ in range(50):
        q, k, v, rounded, unrounded = _rounding_probe(rng, 250)
        if abs(rounded - unrounded) > 3 * half_ulp(rounded):
            break
    out = flash_attention(*map(jnp.asarray, (q, k, v)), block_sizes=BlockSizes(block_q=16, block_k=256))
    out = float(np.asarray(out.astype(jnp.float32))[0, 0, 0, 0])
    bound = 1.01 * half_ulp(rounded)
    assert abs(out - rounded) <= bound < abs(out - unrounded), (out, rounded, unrounded)


def test_decode_stats_are_the_bfloat16_forwards_bit_for_bit_at_huge_logits():
    """The RowStats' max of a bfloat16 decode is its max key's logit as the bfloat16 backward
    computes it (bfloat16 pair products): equal to the forward's bit for bit where |S| ~ 1e9
    (one float32 ulp apart there is e^64 in the backward's P)."""
    rng = np.random.default_rng()
    b, lq, lk, hq, hkv, d = 2, 3, 700, 4, 2, 64
    q, k, v = (rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
               for shape in ((b, lq, hq, d), (b, lk, hkv, d), (b, lk, hkv, d)))
    q = (np.asarray(q, np.float32) * 2e4).astype(ml_dtypes.bfloat16)
    k = (np.asarray(k, np.float32) * 2e4).astype(ml_dtypes.bfloat16)
    call = arguments.validate(q, k, v, is_causal=True, causal_alignment="bottom_right")
    q, k, v = map(jnp.asarray, (q, k, v))
    _, stats = cpu_kernel.decode(call.cfg, q, k, v, call.masks, call.extras, None, splits=3)
    _, f_stats = cpu_kernel.forward(call.cfg, q, k, v, None, call.masks, call.extras)
    assert np.abs(np.asarray(f_stats.max)).max() > 1e8
    np.testing.assert_array_equal(np.asarray(stats.max), np.asarray(f_stats.max))


def test_the_widened_path_is_taken_when_the_products_are_turned_off():
    """$JAX_FLASH_ATTENTION_CPU_BF16_PRODUCTS=0 (what a host without the units runs): the
    float32 kernels, and results within bfloat16's rounding of the products path."""
    script = ("import json, jax, jax.numpy as jnp, numpy as np\n"
              "from jax_impl.flash_attention import flash_attention\n"
              "x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 70, 2, 64)), jnp.bfloat16)\n"
              "f = jax.jit(lambda q: flash_attention(q, q, q, implementation='cpu'))\n"
              "print('_bf16' in f.lower(x).as_text())\n"
              "print(json.dumps(np.asarray(f(x).astype(jnp.float32)).tolist()))\n")
    env = dict(os.environ, JAX_FLASH_ATTENTION_CPU_BF16_PRODUCTS="0", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True,
                            text=True, check=True)
    flag, payload = result.stdout.strip().splitlines()[-2:]
    assert flag == "False"
    widened = np.asarray(json.loads(payload), np.float32)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 70, 2, 64)), jnp.bfloat16)
    products = np.asarray(flash_attention(x, x, x, implementation="cpu").astype(jnp.float32))
    assert 0 < np.abs(products - widened).max() < 0.05
