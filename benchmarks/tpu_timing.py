"""Forward timings on a TPU: flash_attention(implementation="mosaic_tpu") beside the xla path
and JAX's splash attention, bf16, B=1 H=8 L=4096 D=128, causal and not.

    python -m benchmarks.tpu_timing [--out DIR] [--repeats N] [--seq-len L]

Each program is jitted, run once to compile, then timed ``--repeats`` times with
``block_until_ready`` around every call (device-synchronised): the median and quartiles in
ms, and TFLOP/s from the median (useful FLOPs: 4 * B * H * D * attended pairs). Needs a TPU
(refused by name elsewhere); ``--out DIR`` writes DIR/tpu_timing.md and .json, else the table
is printed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

BATCH, HEADS, HEAD_DIM = 1, 8, 128
PROGRAMS = ("mosaic_tpu", "xla", "splash")


def _program(name: str, causal: bool, seq_len: int):
    """fn(q, k, v) -> out on the layout the program takes, and that layout."""
    import jax
    from jax_impl.flash_attention import flash_attention
    if name != "splash":
        return (lambda q, k, v: flash_attention(q, k, v, is_causal=causal, implementation=name)), "blhd"
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash, splash_attention_mask as splash_mask)
    shape = (seq_len, seq_len)
    mask = splash_mask.MultiHeadMask(
        [splash_mask.CausalMask(shape) if causal else splash_mask.FullMask(shape)] * HEADS)
    blocks = min(512, seq_len)
    kernel = splash.make_splash_mha(mask, block_sizes=splash.BlockSizes(
        block_q=blocks, block_kv=blocks, block_kv_compute=blocks), head_shards=1, q_seq_shards=1)
    return (lambda q, k, v: jax.vmap(kernel)(q * HEAD_DIM ** -0.5, k, v)), "bhld"


def time_program(name: str, causal: bool, seq_len: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    fn, layout = _program(name, causal, seq_len)
    shape = (BATCH, seq_len, HEADS, HEAD_DIM) if layout == "blhd" else (BATCH, HEADS, seq_len, HEAD_DIM)
    keys = jax.random.split(jax.random.key(int(time.time())), 3)
    q, k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
    compiled = jax.jit(fn)
    jax.block_until_ready(compiled(q, k, v))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        times.append((time.perf_counter() - start) * 1e3)
    q1, median, q3 = (float(x) for x in np.percentile(times, [25, 50, 75]))
    pairs = seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len
    flops = 4 * BATCH * HEADS * HEAD_DIM * pairs
    return dict(program=name, causal=causal, seq_len=seq_len, repeats=repeats, median_ms=median,
                q1_ms=q1, q3_ms=q3, tflops=flops / (median * 1e-3) / 1e12)


def markdown(rows: list[dict], device: str) -> str:
    lines = [f"# TPU forward timings ({device})", "",
             f"bf16, B={BATCH} H={HEADS} D={HEAD_DIM}; median (quartiles) of device-synchronised "
             "calls; `python -m benchmarks.tpu_timing`.", "",
             "| L | mask | program | median ms | q1-q3 ms | TFLOP/s |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['seq_len']} | {'causal' if r['causal'] else 'full'} | {r['program']} "
                         f"| {r['error'].replace('|', '/')} | | |")
            continue
        lines.append(f"| {r['seq_len']} | {'causal' if r['causal'] else 'full'} | {r['program']} | "
                     f"{r['median_ms']:.3f} | {r['q1_ms']:.3f}-{r['q3_ms']:.3f} | {r['tflops']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write OUT/tpu_timing.md and .json (else print the table)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error(f"--repeats={args.repeats}: at least 3 (quartiles)")
    import jax
    device = jax.devices()[0]
    if device.platform != "tpu":
        parser.error(f"needs a TPU: JAX's default device is {device.platform!r}")
    rows = []
    for causal in (False, True):
        for name in PROGRAMS:
            try:
                rows.append(time_program(name, causal, args.seq_len, args.repeats))
            except Exception as error:  # one program's failure is its row
                rows.append(dict(program=name, causal=causal, seq_len=args.seq_len,
                                 error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"))
            print(rows[-1], file=sys.stderr, flush=True)
    table = markdown(rows, device.device_kind)
    if args.out is None:
        print(table)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tpu_timing.md").write_text(table)
    (out / "tpu_timing.json").write_text(json.dumps(dict(device=device.device_kind, rows=rows),
                                                    indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
