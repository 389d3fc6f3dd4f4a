"""Error of each ``precision=`` choice against the float64 oracle: ``python3 -m benchmarks.precision_error``.

Two columns per output (out, dq, dk, dv), max abs error over random-normal float32 inputs:

* ``cpu``: flash_attention (implementation="xla") on this CPU. XLA:CPU ignores a
  DotAlgorithmPreset it accepts and multiplies in full fp32, and refuses the GPU-only ones, so
  this column is the fp32 error whatever the preset: it is NOT the GPU's error.
* ``emulated``: dense attention in float64 in which every matmul first rounds its inputs as the
  preset does on a GPU (tf32: 10 stored mantissa bits, bf16: 7, round to nearest even; the
  split presets add the products of the rounding residues, as Triton and XLA lower them). It
  models input rounding only, not the order of fp32 accumulation: the expected GPU error class.

The oracle is torch_ref.manual_attention in float64, causal, with a random output cotangent.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_impl.arguments import GPU_ONLY_PRESETS, PRECISION_PRESETS
from jax_impl.flash_attention import flash_attention
from torch_ref import attention_with_grads, manual_attention

CHOICES = (jax.lax.Precision.HIGHEST,) + PRECISION_PRESETS
NAMES = ("out", "dq", "dk", "dv")


def _tf32(x):
    """float32 -> nearest tf32 (10 stored mantissa bits, ties to even), as float64."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    drop = 13
    bits = (bits + ((bits >> drop) & 1) + (1 << (drop - 1)) - 1) & ~np.uint32((1 << drop) - 1)
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def _bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _parts(x, round_to, count):
    """x (float32) as ``count`` rounded terms: hi, then the rounded residues."""
    parts, rest = [], np.asarray(x, np.float32).astype(np.float64)
    for _ in range(count):
        part = round_to(rest.astype(np.float32))
        parts.append(part)
        rest = rest - part
    return parts


# Which (a part, b part) products each preset sums (0 = hi, 1 = mid, 2 = lo).
_SPLITS = {"TF32_TF32_F32": (_tf32, [(0, 0)]),
           "TF32_TF32_F32_X3": (_tf32, [(0, 0), (0, 1), (1, 0)]),
           "BF16_BF16_F32": (_bf16, [(0, 0)]),
           "BF16_BF16_F32_X3": (_bf16, [(0, 0), (0, 1), (1, 0)]),
           "BF16_BF16_F32_X6": (_bf16, [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (2, 0)]),
           "BF16_BF16_F32_X9": (_bf16, [(i, j) for i in range(3) for j in range(3)])}


def _matmul(precision):
    """a @ b on [..., m, k] x [..., k, n] float64 arrays with the preset's input rounding."""
    name = getattr(precision, "name", "HIGHEST")
    if name not in _SPLITS:  # HIGHEST, F32_F32_F32: fp32 inputs exactly
        return lambda a, b: np.asarray(a, np.float32).astype(np.float64) @ np.asarray(b, np.float32).astype(np.float64)
    round_to, products = _SPLITS[name]
    count = 1 + max(max(p) for p in products)

    def matmul(a, b):
        pa, pb = _parts(a, round_to, count), _parts(b, round_to, count)
        return sum(pa[i] @ pb[j] for i, j in products)
    return matmul


def emulated(q, k, v, cotangent, precision):
    """Dense causal attention and its gradients in float64 with the preset's input rounding.
    q, k, v, cotangent: [B, L, H, D]."""
    mm = _matmul(precision)
    heads = lambda x: np.swapaxes(np.asarray(x, np.float64), 1, 2)  # [B, H, L, D]
    q, k, v, d_out = map(heads, (q, k, v, cotangent))
    scale = 1 / np.sqrt(q.shape[-1])
    length = q.shape[2]
    allowed = np.tril(np.ones((length, length), bool))
    s = np.where(allowed, mm(q, np.swapaxes(k, -1, -2)) * scale, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    out = mm(p, v)
    dp = mm(d_out, np.swapaxes(v, -1, -2))
    ds = p * (dp - np.sum(d_out * out, -1, keepdims=True))
    grads = (out, mm(ds, k) * scale, mm(np.swapaxes(ds, -1, -2), q) * scale,
             mm(np.swapaxes(p, -1, -2), d_out))
    return dict(zip(NAMES, (np.swapaxes(g, 1, 2) for g in grads)))


def on_cpu(q, k, v, cotangent, precision):
    attend = lambda q, k, v: flash_attention(q, k, v, is_causal=True, implementation="xla",
                                             precision=precision)
    out, vjp = jax.vjp(attend, *map(jnp.asarray, (q, k, v)))
    return dict(zip(NAMES, (np.asarray(x, np.float64) for x in (out, *vjp(jnp.asarray(cotangent))))))


def measure(b, h, length, d, seeds):
    """{choice name: {"cpu" | "emulated": {output: [max abs error per seed]}}}."""
    results = {getattr(c, "name", str(c)): {"cpu": {n: [] for n in NAMES},
                                           "emulated": {n: [] for n in NAMES}} for c in CHOICES}
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        q, k, v, cotangent = (rng.standard_normal((b, length, h, d)).astype(np.float32)
                              for _ in range(4))
        oracle = attention_with_grads(manual_attention, *(x.astype(np.float64) for x in (q, k, v, cotangent)),
                                      is_causal=True)
        for choice in CHOICES:
            row = results[getattr(choice, "name", str(choice))]
            columns = {"emulated": emulated(q, k, v, cotangent, choice)}
            if choice not in GPU_ONLY_PRESETS:
                columns["cpu"] = on_cpu(q, k, v, cotangent, choice)
            for column, got in columns.items():
                for name in NAMES:
                    row[column][name].append(float(np.max(np.abs(got[name] - np.asarray(oracle[name])))))
    return results


def table(results) -> str:
    cell = lambda errors: "refused" if not errors else (
        f"{np.median(errors):.1e} ({min(errors):.1e}–{max(errors):.1e})")
    lines = ["| precision | output | on this CPU | emulated GPU input rounding |",
             "| --- | --- | --- | --- |"]
    for choice, row in results.items():
        for name in NAMES:
            lines.append(f"| {choice if name == 'out' else ''} | {name} | {cell(row['cpu'][name])} | "
                         f"{cell(row['emulated'][name])} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=(1, 2, 256, 64), metavar=("B", "H", "L", "D"))
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"max abs error vs float64, B, H, L, D = {tuple(args.shape)}, causal, "
          f"median (min–max) over {args.seeds} seeds")
    print(table(measure(*args.shape, args.seeds)))


if __name__ == "__main__":
    main()
