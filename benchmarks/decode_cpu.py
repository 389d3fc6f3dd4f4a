"""CPU decode: ``cpu_kernel.decode`` and ``flash_attention`` (jitted, dense and paged caches)
beside torch SDPA and a plain streaming read of the same cache, in one process, interleaved.

    python3 -m benchmarks.decode_cpu [--repeats 7] [--quick] [--out benchmarks/results/cpu/NAME]

Few query rows (1 token, or 4 for speculative decoding) against a KV cache of Lk keys, bottom-
right causal with key lengths (all equal to Lk), Hq=32, Hkv=8, D=128. Each repeat times every
call once, in a fresh random order each repeat (``measure.interleaved_ratios`` with a
shuffle seed: no call always follows the same one): the report gives each call's median time,
the median and quartiles of its per-repeat ratio to torch SDPA, the achieved bandwidth (the
cache's bytes over the median time: the kernel reads each K and V row once) and its fraction
of the streaming read's. The streaming read is the faster (by median) of numpy's sum over the
bytes of k and v viewed as int64 (single-threaded; any dtype, no float work) and torch's
``sum`` over k and v (its intra-op threads), measured in the same repeats. Paged calls through
flash_attention are also given as the median and quartiles of their per-repeat ratio to the
dense flash_attention call (``paged_over_dense``). Prints a markdown table; with
``--out`` writes NAME.json and NAME.md as well. ``time_decode`` is importable (the decode
suite of ``python -m benchmarks`` may call it).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_impl import arguments, cpu_kernel, flash_attention, platform
from benchmarks import measure

HQ, HKV, HEAD_DIM = 32, 8, 128
ISSUE_SHAPE = dict(batch=2, cached=16384, q_rows=1, dtype="float32")
TORCH = "torch.sdpa"
API_DENSE, API_PAGED = "flash_attention dense", "flash_attention paged"
NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def _paged(k, v, page_size: int, rng):
    """The dense cache [B, Lk, Hkv, D] as shuffled pages [B * Lk / page_size, page_size, ...]
    and the page table [B, Lk / page_size] that reads them back."""
    b, lk = k.shape[:2]
    per = lk // page_size
    order = rng.permutation(b * per).astype(np.int32)  # page order[i] holds logical page i
    table = order.reshape(b, per)
    pages = lambda x: (np.empty((b * per, page_size) + x.shape[2:], x.dtype), x.reshape((b * per, page_size) + x.shape[2:]))
    out = []
    for x in (k, v):
        dst, src = pages(x)
        dst[order] = src
        out.append(dst)
    return out[0], out[1], table


def time_decode(batch: int, cached: int, q_rows: int, dtype: str = "float32", *, repeats: int = 7,
                page_sizes=(), seed: int = 0) -> dict:
    """Times cpu_kernel.decode (dense, and paged for each of ``page_sizes``), torch SDPA and the
    streaming read on one shape, interleaved. -> a result dict (see the module docstring)."""
    import torch
    rng = np.random.default_rng(seed)
    np_dtype = NP_DTYPES[dtype]
    q = rng.standard_normal((batch, q_rows, HQ, HEAD_DIM)).astype(np_dtype)
    k = rng.standard_normal((batch, cached, HKV, HEAD_DIM)).astype(np_dtype)
    v = rng.standard_normal((batch, cached, HKV, HEAD_DIM)).astype(np_dtype)
    lengths = np.full((batch,), cached, np.int32)
    call = arguments.validate(q, k, v, is_causal=True, causal_alignment="bottom_right",
                              key_value_seq_lengths=lengths, implementation="cpu")
    cfg, extras = call.cfg, call.extras
    qj, kj, vj = (jnp.asarray(x) for x in (q, k, v))

    @jax.jit
    def dense(q, k, v, masks):
        return cpu_kernel.decode(cfg, q, k, v, masks, extras, None)[0]

    @jax.jit
    def paged(q, k, v, masks, table):
        return cpu_kernel.decode(cfg, q, k, v, masks, extras, table)[0]

    # The public API as a user calls it (dispatch, argument checks, the paged path's clamps).
    api_kw = dict(is_causal=True, causal_alignment="bottom_right", key_value_seq_lengths=jnp.asarray(lengths))
    api = jax.jit(lambda q, k, v, table=None: flash_attention(q, k, v, page_table=table, **api_kw))

    calls = {"cpu_kernel.decode": lambda: dense(qj, kj, vj, call.masks).block_until_ready(),
             API_DENSE: lambda: api(qj, kj, vj).block_until_ready()}
    for size in page_sizes:
        kp, vp, table = _paged(k, v, size, rng)
        kp, vp, table = jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table)
        calls[f"cpu_kernel.decode paged {size}"] = (
            lambda kp=kp, vp=vp, table=table: paged(qj, kp, vp, call.masks, table).block_until_ready())
        calls[f"{API_PAGED} {size}"] = (
            lambda kp=kp, vp=vp, table=table: api(qj, kp, vp, table).block_until_ready())
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    to_torch = lambda x: torch.from_numpy(np.asarray(x, np.float32)).to(torch_dtype).transpose(1, 2).contiguous()
    tq, tk, tv = to_torch(q), to_torch(k), to_torch(v)
    # Bottom-right causal over full lengths: row i of Lq sees keys j <= Lk - Lq + i.
    allowed = torch.from_numpy(np.arange(cached)[None, :] <= (cached - q_rows + np.arange(q_rows))[:, None])
    mask = None if q_rows == 1 else allowed
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, enable_gqa=True)
    calls[TORCH] = sdpa
    tk_flat, tv_flat = tk.reshape(-1), tv.reshape(-1)
    k64, v64 = k.reshape(-1).view(np.int64), v.reshape(-1).view(np.int64)  # any dtype's bytes
    calls["stream int64 sum"] = lambda: (np.sum(k64), np.sum(v64))
    calls["stream torch.sum"] = lambda: (tk_flat.sum(), tv_flat.sum())
    for fn in calls.values():  # compile and warm up
        fn()
    reference = sdpa().transpose(1, 2).float().numpy()
    worst = float(np.max(np.abs(np.asarray(dense(qj, kj, vj, call.masks), np.float32) - reference)))
    load_start = os.getloadavg()[0]
    summary = measure.interleaved_ratios(calls, TORCH, repeats, shuffle_seed=seed)
    cache_bytes = 2 * k.size * np.dtype(np_dtype).itemsize
    stream = min(summary["stream int64 sum"]["median_ms"], summary["stream torch.sum"]["median_ms"])
    for row in summary.values():
        row["GB_per_s"] = cache_bytes / (row["median_ms"] * 1e-3) / 1e9
        row["fraction_of_stream"] = stream / row["median_ms"]
    # Paged over dense through flash_attention, per repeat (same repeat: the same load).
    dense_times = np.asarray(summary[API_DENSE]["times_ms"])
    paged_over_dense = {}
    for size in page_sizes:
        ratios = np.asarray(summary[f"{API_PAGED} {size}"]["times_ms"]) / dense_times
        paged_over_dense[str(size)] = dict(median=float(np.median(ratios)), q1=float(np.percentile(ratios, 25)),
                                           q3=float(np.percentile(ratios, 75)))
    return dict(batch=batch, cached=cached, q_rows=q_rows, dtype=dtype, hq=HQ, hkv=HKV, head_dim=HEAD_DIM,
                cache_bytes=int(cache_bytes), repeats=repeats, settle_s=measure.SETTLE_S,
                splits=cpu_kernel.decode_splits(batch, cached),
                threads=platform.host_threads(), max_abs_diff_vs_torch=worst,
                load_average=[load_start, os.getloadavg()[0]], calls=summary,
                paged_over_dense=paged_over_dense)


def grid(quick: bool):
    shapes = [dict(ISSUE_SHAPE, page_sizes=(16, 64))]
    if not quick:
        for batch in (1, 2):
            for cached in (4096, 16384):
                for q_rows in (1, 4):
                    for dtype in ("float32", "bfloat16"):
                        shape = dict(batch=batch, cached=cached, q_rows=q_rows, dtype=dtype)
                        if shape != ISSUE_SHAPE:
                            shapes.append(shape)
    return shapes


def markdown(results: list[dict]) -> str:
    lines = ["| B | cached | Lq | dtype | call | median ms | ratio to torch (q1-q3) | GB/s | of stream |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for name, c in r["calls"].items():
            lines.append(f"| {r['batch']} | {r['cached']} | {r['q_rows']} | {r['dtype']} | {name} | "
                         f"{c['median_ms']:.2f} | {c['ratio_median']:.2f} ({c['ratio_q1']:.2f}-{c['ratio_q3']:.2f}) | "
                         f"{c['GB_per_s']:.1f} | {c['fraction_of_stream']:.2f} |")
    paged = [(r, size, x) for r in results for size, x in r.get("paged_over_dense", {}).items()]
    if paged:
        lines += ["", "| B | cached | Lq | dtype | page size | flash_attention paged / dense (q1-q3) | load average (start, end) |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['cached']} | {r['q_rows']} | {r['dtype']} | {size} | "
                  f"{x['median']:.3f} ({x['q1']:.3f}-{x['q3']:.3f}) | "
                  f"{r['load_average'][0]:.2f}, {r['load_average'][1]:.2f} |" for r, size, x in paged]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="the issue's shape only")
    parser.add_argument("--out", help="write OUT.json and OUT.md (e.g. benchmarks/results/cpu/decode_cpu)")
    args = parser.parse_args(argv)
    results = []
    for shape in grid(args.quick):
        results.append(time_decode(**shape, repeats=args.repeats))
        print("\n".join(markdown(results[-1:]).splitlines()[2:]), flush=True)  # rows, no header
    header = (f"# CPU decode: cpu_kernel.decode vs torch SDPA\n\nHq={HQ} Hkv={HKV} D={HEAD_DIM}, bottom-right causal "
              f"with key lengths; {args.repeats} interleaved repeats (a fresh random order each, the calls "
              f"{1e3 * measure.SETTLE_S:.0f} ms apart); {platform.host_threads()} threads; "
              f"jax {jax.__version__}. Ratios: median and quartiles of the per-repeat ratios to torch SDPA. "
              "GB/s: K+V bytes over the median time; 'of stream': the streaming read's time over the call's.\n\n")
    text = header + markdown(results) + "\n"
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                                            results=results), indent=1))
        out.with_suffix(".md").write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
