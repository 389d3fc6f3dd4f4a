"""``python -m benchmarks --suite cpu``: the default CPU path against torch's SDPA.

jax_impl's default on a CPU (``implementation="cpu"``, the fused C++ kernel) and its xla path
beside ``torch.nn.functional.scaled_dot_product_attention`` (on a CPU its flash kernel) in the
same dtype: fp32 and bf16, causal and not, L=2048 and 8192, B=1 H=8 D=64, forward and
forward+backward; then, fp32 at the first length, one call per feature (a bias, a dense causal
mask, dropout, the soft cap, sinks), against torch's SDPA with the same feature where it has it
(``attn_mask``, ``dropout_p``; its dropout draws its own pattern) and against its plain call
where it has not (the soft cap, sinks: the row says so). The three calls alternate, repeat after repeat, and each repeat gives one time
ratio per implementation (jax_impl / torch); the report gives the median of those
per-pair ratios with their quartiles (``measure.interleaved_ratios``), the load average at the
start and end, and each output's largest difference from torch's (a sanity check, not the
oracle). Then the matrix-unit rows: the fused kernel alone beside torch at B=1 H=8 L=4096,
causal, D=64 and 128, fp32 and bf16, each with its GFLOP/s (useful FLOPs, benchmarks/flops.py)
and the fraction of this host's measured peak for the unit it multiplies on
(benchmarks/cpu_peak.py: float32 FMA, or the bfloat16 dot product where bf16 calls run on it),
torch's beside it. The report opens with the host's matrix features and peaks. Writes
bench_cpu.json and bench_cpu.md.
"""
from __future__ import annotations

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cpu_peak, flops
from benchmarks import measure as measure_mod
from jax_impl.flash_attention import flash_attention

NAME = "bench_cpu"
IMPLEMENTATIONS = ("cpu", "xla")
TORCH = "torch.sdpa"
DTYPES = ("float32", "bfloat16")
CAUSAL = (False, True)
MODES = ("fwd", "fwd+bwd")
LENGTHS = (2048, 8192)
BATCH, HEADS, HEAD_DIM = 1, 8, 64
# The matrix-unit rows: (length, head dims), causal, fp32 and bf16, the fused kernel only.
MATRIX_LENGTH, MATRIX_HEAD_DIMS, MATRIX_REPEATS = 4096, (64, 128), 7


def repeats_for(length: int) -> int:
    """Fewer pairs at long lengths, where one forward+backward pair takes seconds."""
    return 9 if length <= 2048 else 5


# A feature -> (flash_attention's keywords, torch SDPA's keywords, or None where SDPA has no
# such argument), for fp32 inputs [B, L, H, D] of length L.
def feature_calls(feature: str, length: int):
    import torch
    rng = np.random.default_rng(1)
    if feature == "bias":
        bias = rng.standard_normal((1, HEADS, length, length)).astype(np.float32)
        return dict(bias=jnp.asarray(bias)), dict(attn_mask=torch.from_numpy(bias))
    if feature == "mask":
        mask = np.tril(np.ones((length, length), bool))
        return dict(mask=jnp.asarray(mask)), dict(attn_mask=torch.from_numpy(mask))
    if feature == "dropout":
        return dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), dict(dropout_p=0.1)
    if feature == "soft_cap":
        return dict(logits_soft_cap=30.0), None
    if feature == "sinks":
        return dict(attention_sinks=jnp.asarray(rng.standard_normal(HEADS), jnp.float32)), None
    raise ValueError(feature)


FEATURES = ("bias", "mask", "dropout", "soft_cap", "sinks")


def _jax_calls(q, k, v, causal: bool, implementation: str, **features) -> dict:
    attend = jax.jit(lambda q, k, v: flash_attention(q, k, v, is_causal=causal, implementation=implementation,
                                                     **features))
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * q.astype(jnp.float32)),
                             argnums=(0, 1, 2)))
    return {"fwd": lambda: jax.block_until_ready(attend(q, k, v)),
            "fwd+bwd": lambda: jax.block_until_ready(grads(q, k, v))}


def _torch_calls(q, k, v, causal: bool, **features) -> dict:
    import torch
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # [B, H, L, D]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def forward():
        with torch.no_grad():
            return sdpa(q, k, v, is_causal=causal, **features)

    def forward_backward():
        out = sdpa(*leaves, is_causal=causal, **features)
        return torch.autograd.grad((out.float() * leaves[0].float()).sum(), leaves)

    return {"fwd": forward, "fwd+bwd": forward_backward}


def measure(dtype: str, causal: bool, length: int, repeats: int, feature: str | None = None,
            head_dim: int = HEAD_DIM, implementations=IMPLEMENTATIONS) -> list[dict]:
    import torch
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((BATCH, length, HEADS, head_dim)).astype(np.float32) for _ in range(3)]
    jax_kw, torch_kw = feature_calls(feature, length) if feature else ({}, {})
    jax_calls = {impl: _jax_calls(*(jnp.asarray(x, dtype) for x in arrays), causal, impl, **jax_kw)
                 for impl in implementations}
    torch_calls = _torch_calls(*(torch.from_numpy(x).to(getattr(torch, dtype)) for x in arrays), causal,
                               **(torch_kw or {}))
    rows = []
    for mode in MODES:
        calls = {**{f"jax_impl.{impl}": jax_calls[impl][mode] for impl in implementations},
                 TORCH: torch_calls[mode]}
        for call in calls.values():
            call()  # compile, warm up
        outputs = {name: call() for name, call in calls.items()}
        summary = measure_mod.interleaved_ratios(calls, TORCH, repeats)
        useful = flops.attention_flops(BATCH, HEADS, length, length, head_dim,
                                       causal="top_left" if causal else None, mode=mode)
        for impl in implementations:
            name = f"jax_impl.{impl}"
            rows.append(dict(implementation=impl, dtype=dtype, causal=causal, length=length, mode=mode,
                             head_dim=head_dim, gflops=useful / summary[name]["median_ms"] / 1e6,
                             torch_gflops=useful / summary[TORCH]["median_ms"] / 1e6,
                             feature=feature, torch_has_feature=feature is None or torch_kw is not None,
                             repeats=repeats, jax_ms=summary[name]["median_ms"],
                             torch_ms=summary[TORCH]["median_ms"],
                             ratio_median=summary[name]["ratio_median"], ratio_q1=summary[name]["ratio_q1"],
                             ratio_q3=summary[name]["ratio_q3"],
                             max_abs_diff_vs_torch=(_max_difference(outputs[name], outputs[TORCH], mode)
                                                    if feature in (None, "bias", "mask") else None)))
    return rows


def _max_difference(jax_out, torch_out, mode: str) -> float:
    """The largest absolute difference between the two outputs (dq, dk, dv for fwd+bwd)."""
    pairs = zip(jax_out, torch_out) if mode == "fwd+bwd" else [(jax_out, torch_out)]
    worst = 0.0
    for a, t in pairs:
        t = t.detach().float().numpy()
        t = np.swapaxes(t, 1, 2) if t.ndim == 4 else t  # torch [B, H, L, D] -> [B, L, H, D]
        worst = max(worst, float(np.max(np.abs(np.asarray(a, np.float32) - t))))
    return worst


def _markdown(result: dict) -> str:
    lines = [f"# jax_impl (cpu kernel, xla path) against torch SDPA ({result['backend']}, B={BATCH} H={HEADS} D={HEAD_DIM})", "",
             f"Median of interleaved per-pair time ratios (jax_impl / torch, same dtype) with quartiles; "
             f"load average {result['load_average_start'][0]:.1f} at the start, "
             f"{result['load_average_end'][0]:.1f} at the end; torch {result['torch_version']}, "
             f"{result['torch_threads']} threads; jax {result['jax_version']}.", "",
             "Feature rows: torch runs the same feature, or where SDPA has none (soft cap, sinks) "
             "its plain call; dropout draws different patterns, so no difference is given.", "",
             "| implementation | feature | dtype | causal | L | mode | jax_impl | torch SDPA | ratio (median) "
             "| quartiles | pairs | max abs diff vs torch |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        if r.get("matrix"):
            continue
        feature = r.get("feature") or "-"
        if r.get("feature") and not r.get("torch_has_feature"):
            feature += " (torch: plain call)"
        diff = r["max_abs_diff_vs_torch"]
        lines.append(f"| {r['implementation']} | {feature} | {r['dtype']} | {'yes' if r['causal'] else 'no'} "
                     f"| {r['length']} | {r['mode']} "
                     f"| {r['jax_ms']:.1f} ms | {r['torch_ms']:.1f} ms | {r['ratio_median']:.2f}x "
                     f"| {r['ratio_q1']:.2f}-{r['ratio_q3']:.2f} | {r['repeats']} "
                     f"| {'-' if diff is None else f'{diff:.1e}'} |")
    return "\n".join(lines + _matrix_markdown(result)) + "\n"


def _unit(dtype: str, bf16_products: bool) -> str:
    """The unit a row of the fused kernel multiplies on (a key of cpu_peak.peaks())."""
    return "bfloat16_dot" if dtype == "bfloat16" and bf16_products else "float32_fma"


def _matrix_markdown(result: dict) -> list[str]:
    rows = [r for r in result["rows"] if r.get("matrix")]
    if not rows:
        return []
    peaks = result["peaks"]
    features = ", ".join(f"{name} {'yes' if present else 'no'}" for name, present in result["features"].items())
    lines = ["", f"## The fused kernel on the matrix units (B={BATCH} H={HEADS} L={rows[0]['length']}, causal)", "",
             f"Host features: {features}. Measured peak (benchmarks/cpu_peak.py, all threads): "
             + ", ".join(f"{unit} {value / 1e9:.0f} GFLOP/s" for unit, value in peaks.items())
             + f". bf16 calls multiply on {'the bfloat16 dot product' if result['bf16_products'] else 'float32 FMA (widened)'}."
             " GFLOP/s: useful FLOPs (benchmarks/flops.py) / median time; 'of peak': of the peak of the unit"
             " the row multiplies on (torch's against the same unit).", "",
             "| dtype | D | mode | jax_impl | GFLOP/s | of peak | torch SDPA | torch GFLOP/s | torch of peak "
             "| ratio (median) | quartiles | pairs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        peak = peaks.get(_unit(r["dtype"], result["bf16_products"]))
        share = lambda g: "-" if not peak else f"{g * 1e9 / peak:.2f}"
        lines.append(f"| {r['dtype']} | {r['head_dim']} | {r['mode']} | {r['jax_ms']:.1f} ms | {r['gflops']:.0f} "
                     f"| {share(r['gflops'])} | {r['torch_ms']:.1f} ms | {r['torch_gflops']:.0f} "
                     f"| {share(r['torch_gflops'])} | {r['ratio_median']:.2f}x | {r['ratio_q1']:.2f}-{r['ratio_q3']:.2f} "
                     f"| {r['repeats']} |")
    return lines


def measure_matrix_rows(length: int = MATRIX_LENGTH) -> list[dict]:
    """The matrix-unit rows: the fused kernel beside torch, fp32 and bf16, D=64 and 128."""
    rows = []
    for dtype in DTYPES:
        for head_dim in MATRIX_HEAD_DIMS:
            for row in measure(dtype, True, length, MATRIX_REPEATS, head_dim=head_dim,
                               implementations=("cpu",)):
                rows.append(dict(row, matrix=True))
    return rows


def run_suite(out_dir, device: str, length: int | None = None) -> list[pathlib.Path]:
    """One ``length`` (``--seq-lens``) replaces the suite's 2048 and 8192, and the matrix rows' 4096."""
    import torch
    del device  # the default backend: whatever JAX runs on
    out_dir = pathlib.Path(out_dir)
    lengths = (length,) if length else LENGTHS
    from jax_impl.cpu_kernel import build
    result = dict(backend=jax.default_backend(), jax_version=jax.__version__, torch_version=torch.__version__,
                  torch_threads=torch.get_num_threads(), load_average_start=os.getloadavg(), rows=[],
                  features=cpu_peak.features(), bf16_products=build.bf16_products())
    peaks_before = cpu_peak.peaks()
    for dtype in DTYPES:
        for causal in CAUSAL:
            for n in lengths:
                result["rows"] += measure(dtype, causal, n, repeats_for(n))
    for feature in FEATURES:
        result["rows"] += measure("float32", False, lengths[0], repeats_for(lengths[0]), feature)
    result["rows"] += measure_matrix_rows(length or MATRIX_LENGTH)
    # The peaks: the better of a measurement before and after the rows (other load on the host
    # lowers a measurement, never raises it).
    peaks_after = cpu_peak.peaks()
    result["peaks"] = {unit: max(value, peaks_after.get(unit, 0.0)) for unit, value in peaks_before.items()}
    result["load_average_end"] = os.getloadavg()
    (out_dir / f"{NAME}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / f"{NAME}.md").write_text(_markdown(result))
    print(_markdown(result))
    return [out_dir / f"{NAME}.json", out_dir / f"{NAME}.md"]
