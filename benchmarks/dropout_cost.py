"""``python -m benchmarks --suite dropout``: what attention dropout costs on the default path.

Dropout 0.1 (one pattern shared over batch and heads, Flax's default; and one per batch row and
head) beside dropout 0.0, forward and forward+backward, B=1 H=8 D=64 fp32 at one length.
Variants run interleaved, repeat after repeat, and each repeat gives one ratio per variant
against the dropout-free call timed next to it; the report gives the median of those per-pair
ratios with their quartiles, so load from other work hits both sides of a ratio alike.
Writes bench_dropout.json and bench_dropout.md.
"""
from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import measure as measure_mod
from jax_impl.flash_attention import flash_attention

NAME = "bench_dropout"
BASELINE = "dropout 0.0"
VARIANTS = {BASELINE: dict(dropout_rate=0.0),
            "dropout 0.1": dict(dropout_rate=0.1),
            "dropout 0.1, per batch row and head": dict(dropout_rate=0.1, broadcast_dropout=False)}
MODES = ("fwd", "fwd+bwd")


def _compiled(kw):
    attend = lambda q, k, v, key: flash_attention(q, k, v, dropout_rng=key, **kw)
    loss = lambda q, k, v, key: jnp.sum(attend(q, k, v, key) * q)
    return {"fwd": jax.jit(attend), "fwd+bwd": jax.jit(jax.grad(loss, argnums=(0, 1, 2)))}


def measure(length: int, repeats: int, heads: int = 8, head_dim: int = 64) -> dict:
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, length, heads, head_dim)), jnp.float32) for _ in range(3))
    key = jax.random.key(0)
    fns = {name: _compiled(kw) for name, kw in VARIANTS.items()}
    for modes in fns.values():
        for fn in modes.values():
            jax.block_until_ready(fn(q, k, v, key))  # compile
    rows = []
    for mode in MODES:
        calls = {name: (lambda fn=fns[name][mode]: jax.block_until_ready(fn(q, k, v, key))) for name in fns}
        summary = measure_mod.interleaved_ratios(calls, BASELINE, repeats)
        rows += [dict(mode=mode, variant=name, **figures) for name, figures in summary.items()]
    return dict(shape=dict(batch=1, heads=heads, length=length, head_dim=head_dim, dtype="float32"),
                backend=jax.default_backend(), repeats=repeats, rows=rows)


def _markdown(result: dict) -> str:
    s = result["shape"]
    lines = [f"# Attention dropout cost ({result['backend']}, B={s['batch']} H={s['heads']} "
             f"L={s['length']} D={s['head_dim']} fp32, {result['repeats']} interleaved repeats)", "",
             "| mode | variant | median time | ratio to dropout 0.0 (median of per-repeat ratios) | quartiles |",
             "| --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['mode']} | {r['variant']} | {r['median_ms']:.1f} ms | {r['ratio_median']:.2f}x "
                     f"| {r['ratio_q1']:.2f}-{r['ratio_q3']:.2f} |")
    return "\n".join(lines) + "\n"


def run_suite(out_dir, device: str, length: int = 2048, repeats: int = 15) -> list[pathlib.Path]:
    del device  # the default backend: whatever JAX runs on
    out_dir = pathlib.Path(out_dir)
    result = measure(length, repeats)
    (out_dir / f"{NAME}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / f"{NAME}.md").write_text(_markdown(result))
    print(_markdown(result))
    return [out_dir / f"{NAME}.json", out_dir / f"{NAME}.md"]
