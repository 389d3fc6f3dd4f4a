"""``python -m benchmarks --suite decode``: decoding against a long KV cache, dense and paged.

A grid of batch x cached length, 1 and 4 query rows, GQA (Hq=32, Hkv=8, D=128), fp32 and bf16
caches, bottom-right causal (the new rows are the last positions). Per configuration these
run interleaved, in a fresh random order each repeat (``measure.interleaved_ratios``, per-repeat ratios to
torch SDPA with their quartiles):
  jax_impl default (dense cache), jax_impl xla (its decode path, dense), jax_impl paged (page
  size 16, a shuffled page table; page size 64 too at the largest point), torch SDPA (GQA via
  enable_gqa), and on a GPU jax.nn's cuDNN and FlashAttention's ``flash_attn_with_kvcache``
  where installed.
Achieved bandwidth counts the K and V bytes of the cached keys once; a streaming read of the same
cache (a jitted sum over K and V) is timed in the same run, so each row also gives its fraction
of the streaming bandwidth. Writes bench_decode.json and bench_decode.md.
"""
from __future__ import annotations

import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import measure as measure_mod
from jax_impl import kv_cache
from jax_impl.flash_attention import flash_attention

NAME = "bench_decode"
HQ, HKV, D = 32, 8, 128
TORCH = "torch SDPA"
GRIDS = {  # device -> (batches, cached lengths, query rows, dtypes); the second dtype at 1 row only
    "cpu": ((1, 2), (4096, 16384), (1, 4), ("float32", "bfloat16")),
    "cuda": ((1, 8), (16384, 65536), (1, 4), ("bfloat16", "float32")),
}
# Seconds after which no new point starts (the rest is recorded as skipped); None: no limit.
TIME_BUDGET_S = {"cpu": None, "cuda": float(os.environ.get("DECODE_BUDGET_S", 150))}


def _repeats(device: str, cache_bytes: int) -> int:
    return 15 if device != "cpu" else (7 if cache_bytes < 1 << 27 else 5)


def _torch_calls(q, k, v, lq, torch_device):
    import torch
    import torch.nn.functional as F
    to = lambda x: torch.from_numpy(np.array(x, np.float32)).to(torch_device).to(
        torch.bfloat16 if q.dtype == jnp.bfloat16 else torch.float32).transpose(1, 2).contiguous()
    tq, tk, tv = map(to, (q, k, v))
    lk = tk.shape[2]
    # bottom-right causal: query i sees keys j <= i + lk - lq (none masked for one row)
    mask = None if lq == 1 else (torch.arange(lk, device=torch_device)[None, :]
                                 <= torch.arange(lq, device=torch_device)[:, None] + lk - lq)
    sync = torch.cuda.synchronize if torch_device == "cuda" else (lambda: None)

    def call():
        with torch.no_grad():
            out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, enable_gqa=True)
        sync()
        return out

    return call, lambda: call().transpose(1, 2).float().cpu().numpy()


def _flash_attn_call(q, k, v):
    from flash_attn import flash_attn_with_kvcache  # noqa: F401 (optional)
    import torch
    to = lambda x: torch.from_numpy(np.asarray(x.astype(jnp.float32))).to("cuda", torch.bfloat16)
    tq, tk, tv = map(to, (q, k, v))
    lengths = torch.full((q.shape[0],), k.shape[1], dtype=torch.int32, device="cuda")

    def call():
        out = flash_attn_with_kvcache(tq, tk, tv, cache_seqlens=lengths, causal=True)
        torch.cuda.synchronize()
        return out
    return call


def measure_point(b: int, lk: int, lq: int, dtype: str, device: str, page_sizes=(16,)) -> dict:
    rng = np.random.default_rng(0)
    jdtype = jnp.dtype(dtype)
    q = jnp.asarray(rng.standard_normal((b, lq, HQ, D)), jdtype)
    k, v = (jnp.asarray(rng.standard_normal((b, lk, HKV, D)), jdtype) for _ in range(2))
    kw = dict(is_causal=True, causal_alignment="bottom_right")
    lengths = jnp.full((b,), lk, jnp.int32)
    block = jax.block_until_ready
    calls, checks = {}, {}
    default = jax.jit(lambda q, k, v: flash_attention(q, k, v, **kw))
    xla_decode = jax.jit(lambda q, k, v: flash_attention(q, k, v, implementation="xla", **kw))
    calls["jax_impl default (dense)"] = lambda: block(default(q, k, v))
    calls["jax_impl xla decode (dense)"] = lambda: block(xla_decode(q, k, v))
    for page_size in page_sizes:
        per_seq = lk // page_size
        table = kv_cache.make_page_table(b, per_seq, num_pages=b * per_seq, key=jax.random.key(1))
        # The pages hold the same keys as the dense cache, shuffled across the pool.
        k_pages, v_pages = (jnp.zeros((b * per_seq, page_size, HKV, D), jdtype).at[table.reshape(-1)].set(
            x.reshape(b * per_seq, page_size, HKV, D)) for x in (k, v))
        paged = jax.jit(lambda q, kp, vp, t, n: flash_attention(q, kp, vp, page_table=t,
                                                                 key_value_seq_lengths=n, **kw))
        name = f"jax_impl paged ({page_size})"
        calls[name] = (lambda kp=k_pages, vp=v_pages, t=table: block(paged(q, kp, vp, t, lengths)))
        checks[name] = lambda kp=k_pages, vp=v_pages, t=table: paged(q, kp, vp, t, lengths)
    checks["jax_impl default (dense)"] = lambda: default(q, k, v)
    checks["jax_impl xla decode (dense)"] = lambda: xla_decode(q, k, v)
    torch_device = "cuda" if device == "cuda" else "cpu"
    try:
        calls[TORCH], checks[TORCH] = _torch_calls(q, k, v, lq, torch_device)
    except Exception as e:  # noqa: BLE001 (torch missing or without enable_gqa)
        print(f"torch SDPA unavailable: {e}")
    if device == "cuda":
        cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, implementation="cudnn", is_causal=lq > 1))  # lq == 1: no mask needed
        try:
            block(cudnn(q, k, v))
            calls["jax.nn cudnn"] = lambda: block(cudnn(q, k, v))
        except Exception as e:  # noqa: BLE001
            print(f"jax.nn cudnn unavailable: {e}")
        try:
            calls["flash_attn_with_kvcache"] = _flash_attn_call(q, k, v)
        except Exception as e:  # noqa: BLE001
            print(f"flash_attn_with_kvcache unavailable: {e}")
    stream = jax.jit(lambda k, v: jnp.sum(k, dtype=jnp.float32) + jnp.sum(v, dtype=jnp.float32))
    calls["streaming read of K and V"] = lambda: block(stream(k, v))
    for call in calls.values():
        call()  # compile and warm up
    expected = np.asarray(checks["jax_impl default (dense)"](), np.float32)
    max_diff = {name: float(np.abs(np.asarray(check(), np.float32) - expected).max())
                for name, check in checks.items()}
    cache_bytes = 2 * b * lk * HKV * D * jdtype.itemsize
    baseline = TORCH if TORCH in calls else "streaming read of K and V"
    summary = measure_mod.interleaved_ratios(calls, baseline, _repeats(device, cache_bytes), shuffle_seed=0)
    stream_gbs = cache_bytes / summary["streaming read of K and V"]["median_ms"] / 1e6
    rows = []
    for name, figures in summary.items():
        gbs = cache_bytes / figures["median_ms"] / 1e6
        rows.append(dict(impl=name, **figures, gb_per_s=gbs, fraction_of_stream=gbs / stream_gbs,
                         max_abs_diff_to_default=max_diff.get(name)))
    return dict(batch=b, cached=lk, query_rows=lq, dtype=dtype, cache_mb=cache_bytes / 1e6,
                baseline=baseline, stream_gb_per_s=stream_gbs, rows=rows)


def _markdown(result: dict) -> str:
    lines = [f"# Decode against a KV cache ({result['device']}, Hq={HQ} Hkv={HKV} D={D}, bottom-right causal)", "",
             f"{result['note']}", "",
             "| B | cached | rows | dtype | implementation | median ms | ratio to baseline (quartiles) | GB/s | of stream |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in result["points"]:
        for r in p["rows"]:
            lines.append(f"| {p['batch']} | {p['cached']} | {p['query_rows']} | {p['dtype']} | {r['impl']} | "
                         f"{r['median_ms']:.2f} | {r['ratio_median']:.2f}x ({r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}) | "
                         f"{r['gb_per_s']:.1f} | {100 * r['fraction_of_stream']:.0f}% |")
    return "\n".join(lines) + "\n"


def run_suite(out_dir, device: str, length: int | None = None) -> list[pathlib.Path]:
    out_dir = pathlib.Path(out_dir)
    kind = "cuda" if device not in ("cpu",) else "cpu"
    batches, lengths, rows, dtypes = GRIDS[kind]
    lengths = (length,) if length else lengths
    started = time.time()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    points, skipped = [], []
    for dtype in dtypes:
        for b in batches:
            for lk in lengths:
                for lq in rows:
                    if dtype != dtypes[0] and lq > 1:
                        continue
                    budget = TIME_BUDGET_S[kind]
                    if budget is not None and time.time() - started > budget:
                        skipped.append(dict(batch=b, cached=lk, query_rows=lq, dtype=dtype))
                        continue
                    largest = b == batches[-1] and lk == lengths[-1] and dtype == dtypes[0] and lq == 1
                    point = measure_point(b, lk, lq, dtype, kind, page_sizes=(16, 64) if largest else (16,))
                    points.append(point)
                    print(f"B={b} cached={lk} rows={lq} {dtype}: " + ", ".join(
                        f"{r['impl']} {r['median_ms']:.1f} ms" for r in point["rows"]), flush=True)
    note = (f"Ratios: median of per-repeat ratios to the baseline ({points[0]['baseline'] if points else TORCH}) "
            f"timed in the same repeat, with quartiles. GB/s: K and V bytes of the cache / median time; "
            f"'of stream': that over a jitted sum of the same K and V in the same run. Load average "
            f"{load:.1f} at the start; {time.time() - started:.0f} s in all; "
            f"{len(skipped)} points skipped by the time budget.")
    result = dict(device=device, backend=jax.default_backend(), note=note, points=points, skipped=skipped)
    (out_dir / f"{NAME}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / f"{NAME}.md").write_text(_markdown(result))
    print(_markdown(result))
    return [out_dir / f"{NAME}.json", out_dir / f"{NAME}.md"]
