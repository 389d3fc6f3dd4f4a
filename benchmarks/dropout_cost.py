"""Cost of attention dropout on the default path: dropout 0.1 beside 0.0, forward and
forward+backward (issue 13's goal: <= 1.3x). Not yet a suite of ``benchmarks.suites`` (its
rows have no dropout column); run ``python -m benchmarks.dropout_cost``.

Variants are timed interleaved (median of the repeats), so load from other jobs on a shared
machine hits every variant alike.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_impl.flash_attention import flash_attention

VARIANTS = {"dropout 0.0": dict(dropout_rate=0.0),
            "dropout 0.1": dict(dropout_rate=0.1),
            "dropout 0.1, per batch and head": dict(dropout_rate=0.1, broadcast_dropout=False)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", type=int, nargs=4, default=(1, 8, 2048, 64), metavar=("B", "H", "L", "D"))
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    b, h, length, d = args.shape
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((b, length, h, d)), jnp.float32) for _ in range(3))
    key = jax.random.key(0)
    fns = {}
    for name, kw in VARIANTS.items():
        attend = lambda q, k, v, key, kw=kw: flash_attention(q, k, v, dropout_rng=key, **kw)
        fns[name] = {"fwd": jax.jit(attend),
                     "fwd+bwd": jax.jit(jax.grad(lambda q, k, v, key, f=attend: jnp.sum(f(q, k, v, key) * q),
                                                 argnums=(0, 1, 2)))}
    times = {(n, m): [] for n in fns for m in ("fwd", "fwd+bwd")}
    for fn in (f for modes in fns.values() for f in modes.values()):
        jax.block_until_ready(fn(q, k, v, key))  # compile
    for _ in range(args.repeats):
        for name, modes in fns.items():
            for mode, fn in modes.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(q, k, v, key))
                times[name, mode].append(time.perf_counter() - start)
    print(f"B={b} H={h} L={length} D={d} float32, {jax.default_backend()}, median of {args.repeats}")
    for mode in ("fwd", "fwd+bwd"):
        base = np.median(times["dropout 0.0", mode])
        for name in fns:
            t = np.median(times[name, mode])
            print(f"{mode:8s} {name:34s} {t * 1e3:9.1f} ms  x{t / base:.2f}")


if __name__ == "__main__":
    main()
