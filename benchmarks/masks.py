"""``python -m benchmarks --suite masks``: programmable block-sparse attention against FlexAttention.

B=1 H=8 D=64 (fp32 on a CPU, bf16 on a GPU), forward and forward+backward, one group of calls
per workload, all computing the same attention except the plain rows:
  packed documents (8 documents of L/8 keys, causal inside; L=8192): ours through segment ids
    (``is_causal=True, q_segment_ids=, kv_segment_ids=``), ours through ``mask_mod`` +
    ``create_block_mask``, torch's ``flex_attention`` compiled with a BlockMask of the documents,
    torch SDPA with the dense [L, L] bool mask, and the plain causal calls (ours, torch SDPA);
  prefix-LM (the first L/4 keys seen by every query, causal after them) and a causal sliding
    window of L/8 keys with the first L/64 keys global (L=8192): ours through ``mask_mod`` +
    ``create_block_mask`` beside flex compiled;
  ALiBi (causal) and T5's relative bias (a table over distances clipped to +-8; not causal) at
    L=4096: ours through ``score_mod`` (the slopes, or the table, as ``mod_aux``), flex compiled
    with the same ``score_mod``, torch SDPA with the dense float bias, and the plain calls.
The mods are conformance.mods' (the conformance cases'), written once with operators and
indexing only: they run unchanged on jax arrays (ours), on torch tensors (flex) and on whole
index grids (the dense mask or bias SDPA gets). Block masks are built once per group, outside the timing (both frameworks' usage: one
mask serves every layer). A group's calls run interleaved in a fresh random order each repeat
(``measure.interleaved_ratios``); each ratio is the median of per-repeat ratios of two calls,
with quartiles. Every output (forward: out; forward+backward: dq, dk, dv) is compared with
torch SDPA on the dense mask or bias (a sanity check, not the oracle). Torch's FlexAttention has
no backward on a CPU: those rows say so. Writes bench_masks.json and bench_masks.md.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import measure as measure_mod
from conformance.mods import T5_MAX_DISTANCE, alibi, bound, documents, prefix_lm, t5
from jax_impl import create_block_mask
from jax_impl.flash_attention import flash_attention

NAME = "bench_masks"
BATCH, HEADS, HEAD_DIM = 1, 8, 64
MASK_LENGTH, BIAS_LENGTH = 8192, 4096
DOCUMENTS = 8
BLOCK_SIZE = 128  # both frameworks' block masks (FlexAttention's default)
MODES = ("fwd", "fwd+bwd")
DTYPES = {"cpu": "float32", "cuda": "bfloat16"}
# Options of ``python -m benchmarks`` this runner takes besides --out, --device and --seq-lens.
CLI_OPTIONS = ("repeats", "time_budget")
# False: torch's flex_attention runs eagerly (it materialises the scores: for the tests' tiny
# shapes, where compiling it would take most of a minute).
compile_flex = True

OURS_SEGMENTS = "ours: segment ids"
OURS_MASK_MOD = "ours: mask_mod + block_mask"
OURS_SCORE_MOD = "ours: score_mod"
OURS_PLAIN = "ours: plain"
FLEX = "torch flex (compiled)"
SDPA_DENSE = "torch SDPA: dense mask/bias"
SDPA_PLAIN = "torch SDPA: plain"


def repeats_for(length: int, device: str) -> int:
    """On a CPU fewer repeats at the long length, where one forward+backward repeat takes seconds."""
    return 15 if device == "cuda" else 5 if length > BIAS_LENGTH else 7


# --- the mods: conformance.mods' (written once, array namespace first), and one of their own -----

def sliding_window_with_globals(window: int, global_tokens: int):
    """Causal, the last ``window`` keys, and the first ``global_tokens`` keys seen by every query."""
    def mask_mod(xp, b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx - kv_idx < window) | (kv_idx < global_tokens))
    return mask_mod


def causal(xp, b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def alibi_slopes(heads: int) -> np.ndarray:
    return 2.0 ** (-8.0 * np.arange(1, heads + 1, dtype=np.float32) / heads)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    length: int
    causal: bool                # the plain rows' is_causal (and the score_mod call's)
    rows: tuple
    ratios: tuple               # (numerator, denominator, {mode: the target})
    mask_mod: object = None
    score_mod: object = None
    aux: tuple = ()             # numpy arrays, the mods' mod_aux
    # mask_mod, score_mod: conformance.mods' form, the array namespace first (``bound`` drops it)


def targets(fwd: float, fwd_bwd: float | None = None) -> dict:
    """The issue's bound on a ratio, per mode."""
    return {"fwd": fwd, **({"fwd+bwd": fwd_bwd} if fwd_bwd else {})}


PLAIN_VS_TORCH = (OURS_PLAIN, SDPA_PLAIN, targets(1.15, 1.0))
SCORE_MOD_RATIOS = ((OURS_SCORE_MOD, OURS_PLAIN, targets(1.5)), (OURS_SCORE_MOD, FLEX, {}),
                    (OURS_SCORE_MOD, SDPA_DENSE, {}), PLAIN_VS_TORCH)


def workloads(mask_length: int, bias_length: int) -> list[Workload]:
    rng = np.random.default_rng(7)
    document = np.repeat(np.arange(DOCUMENTS, dtype=np.int32), -(-mask_length // DOCUMENTS))[None, :mask_length]
    table = rng.standard_normal((2 * T5_MAX_DISTANCE + 1, HEADS)).astype(np.float32)
    ours_vs_flex = ((OURS_MASK_MOD, FLEX, {}),)
    score_mod_rows = (OURS_SCORE_MOD, FLEX, SDPA_DENSE, OURS_PLAIN, SDPA_PLAIN)
    return [
        Workload("packed documents", mask_length, True,
                 (OURS_SEGMENTS, OURS_MASK_MOD, FLEX, SDPA_DENSE, OURS_PLAIN, SDPA_PLAIN),
                 tuple((ours, other, target) for ours in (OURS_SEGMENTS, OURS_MASK_MOD)
                       for other, target in ((FLEX, targets(1.0)), (OURS_PLAIN, targets(0.25, 0.3)),
                                             (SDPA_DENSE, {})))
                 + (PLAIN_VS_TORCH,),
                 mask_mod=documents, aux=(document,)),
        Workload("prefix-LM", mask_length, True, (OURS_MASK_MOD, FLEX), ours_vs_flex,
                 mask_mod=prefix_lm, aux=(np.array([mask_length // 4], np.int32),)),
        Workload("sliding window + global tokens", mask_length, True, (OURS_MASK_MOD, FLEX), ours_vs_flex,
                 mask_mod=sliding_window_with_globals(max(1, mask_length // 8), max(1, mask_length // 64))),
        Workload("ALiBi", bias_length, True, score_mod_rows, SCORE_MOD_RATIOS,
                 score_mod=alibi, aux=(alibi_slopes(HEADS),)),
        Workload("T5 relative bias", bias_length, False, score_mod_rows, SCORE_MOD_RATIOS,
                 score_mod=t5, aux=(table,)),
    ]


# --- the calls ----------------------------------------------------------------------------------

class NotSupported(Exception):
    """A row this framework cannot run here (torch's FlexAttention backward on a CPU)."""


def _our_arguments(w: Workload, row: str) -> tuple[dict, dict]:
    """(static keywords, array arguments) of flash_attention for one of our rows."""
    aux = tuple(jnp.asarray(a) for a in w.aux)
    if row == OURS_PLAIN:
        return dict(is_causal=w.causal), {}
    if row == OURS_SEGMENTS:  # the documents' ids, [1, L]
        return dict(is_causal=True), dict(q_segment_ids=aux[0], kv_segment_ids=aux[0])
    if row == OURS_SCORE_MOD:
        return dict(is_causal=w.causal, score_mod=bound(w.score_mod, jnp)), dict(mod_aux=aux)
    if row == OURS_MASK_MOD:
        mask_mod = bound(w.mask_mod, jnp)
        block_mask = create_block_mask(mask_mod, 1, 1, w.length, w.length, block_size=BLOCK_SIZE, mod_aux=aux)
        return dict(mask_mod=mask_mod), dict(mod_aux=aux, block_mask=block_mask)
    raise ValueError(row)


def _our_calls(w: Workload, row: str, q, k, v, d_out) -> dict:
    static, arrays = _our_arguments(w, row)
    attend = lambda q, k, v, arrays: flash_attention(q, k, v, **static, **arrays)
    loss = lambda q, k, v, arrays: jnp.sum(attend(q, k, v, arrays).astype(jnp.float32) * d_out)
    forward, gradients = jax.jit(attend), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return {"fwd": lambda: jax.block_until_ready(forward(q, k, v, arrays)),
            "fwd+bwd": lambda: jax.block_until_ready(gradients(q, k, v, arrays))}


def _flex_attention():
    import torch
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False) if compile_flex else flex_attention


def dense_mask_or_bias(w: Workload, torch_aux: tuple, device: str, dtype):
    """The workload as SDPA's attn_mask: the mask_mod on the whole [L, L] grid (bool), or the
    score_mod's bias on [1, H, L, L] (float, -inf outside the causal band where causal)."""
    import torch
    index = torch.arange(w.length, device=device)
    q_idx, kv_idx = index[:, None], index[None, :]
    if w.score_mod is None:
        return w.mask_mod(torch, 0, 0, q_idx, kv_idx, *torch_aux)
    heads = torch.arange(HEADS, device=device)[:, None, None]
    bias = w.score_mod(torch, torch.zeros((), device=device), 0, heads, q_idx, kv_idx, *torch_aux)
    bias = bias.expand(HEADS, w.length, w.length)[None]
    if w.causal:
        bias = bias.masked_fill(~causal(torch, 0, 0, q_idx, kv_idx), float("-inf"))
    return bias.to(dtype).contiguous()


def _torch_calls(w: Workload, row: str, tensors, torch_aux, device: str, flex) -> dict:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if row == SDPA_PLAIN:
        attend = lambda q, k, v: sdpa(q, k, v, is_causal=w.causal)
    elif row == SDPA_DENSE:
        attn_mask = dense_mask_or_bias(w, torch_aux, device, tensors[0].dtype)
        attend = lambda q, k, v: sdpa(q, k, v, attn_mask=attn_mask)
    elif row == FLEX:
        mask_mod = w.mask_mod or (causal if w.causal else None)
        block_mask = None if mask_mod is None else torch_block_mask(
            lambda b, h, q_idx, kv_idx: mask_mod(torch, b, h, q_idx, kv_idx, *(torch_aux if w.mask_mod else ())),
            None, None, w.length, w.length, device=device, BLOCK_SIZE=BLOCK_SIZE)
        score_mod = None if w.score_mod is None else (
            lambda score, b, h, q_idx, kv_idx: w.score_mod(torch, score, b, h, q_idx, kv_idx, *torch_aux))
        attend = lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
    else:
        raise ValueError(row)
    q, k, v, d_out = tensors
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def forward():
        with torch.no_grad():
            out = attend(q, k, v)
        sync()
        return out

    def forward_backward():
        if row == FLEX and device == "cpu":
            raise NotSupported("torch's FlexAttention has no backward on a CPU")
        grads = torch.autograd.grad((attend(*leaves).float() * d_out).sum(), leaves)
        sync()
        return grads

    return {"fwd": forward, "fwd+bwd": forward_backward}


def _as_numpy(outputs, mode: str) -> list[np.ndarray]:
    """[B, L, H, D] float32 arrays: out, or dq, dk, dv."""
    arrays = list(outputs) if mode == "fwd+bwd" else [outputs]
    result = []
    for a in arrays:
        if hasattr(a, "detach"):  # torch [B, H, L, D]
            a = np.swapaxes(a.detach().float().cpu().numpy(), 1, 2)
        result.append(np.asarray(a, np.float32))
    return result


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def measure(w: Workload, mode: str, repeats: int, device: str, dtype: str) -> dict:
    """One workload in one mode: every row's median time, status and largest difference from
    torch SDPA on the dense mask or bias; the workload's ratios with quartiles."""
    import torch
    torch_device = "cuda" if device == "cuda" else "cpu"
    rng = np.random.default_rng(0)
    q, k, v, d_out = (rng.standard_normal((BATCH, w.length, HEADS, HEAD_DIM)).astype(np.float32) for _ in range(4))
    jax_arrays = [jnp.asarray(x, dtype) for x in (q, k, v)] + [jnp.asarray(d_out)]
    tensors = [torch.from_numpy(np.ascontiguousarray(np.swapaxes(x, 1, 2))).to(torch_device, getattr(torch, dtype))
               for x in (q, k, v)] + [torch.from_numpy(np.ascontiguousarray(np.swapaxes(d_out, 1, 2))).to(torch_device)]
    torch_aux = tuple(torch.from_numpy(a).to(torch_device) for a in w.aux)
    flex = _flex_attention()
    rows = {name: dict(workload=w.name, length=w.length, causal=w.causal, mode=mode, row=name, status="ok",
                       reason=None, median_ms=None, max_abs_diff_vs_dense=None) for name in w.rows}
    calls, outputs = {}, {}
    for name in w.rows:
        try:
            call = (_our_calls(w, name, *jax_arrays) if name.startswith("ours")
                    else _torch_calls(w, name, tensors, torch_aux, torch_device, flex))[mode]
            outputs[name] = _as_numpy(call(), mode)  # compiles, warms up
            call()
            calls[name] = call
        except NotSupported as e:
            rows[name].update(status="n.s.", reason=str(e))
        except Exception as e:  # a crash is a result: the other rows still run
            rows[name].update(status="error", reason=_reason(e))
    judged = [name for name in outputs if name not in (SDPA_DENSE, OURS_PLAIN, SDPA_PLAIN)]  # same attention
    reference = outputs.get(SDPA_DENSE)
    if judged and reference is None:  # not a timed row of this workload: computed once, untimed
        reference = _as_numpy(_torch_calls(w, SDPA_DENSE, tensors, torch_aux, torch_device, flex)[mode](), mode)
    for name in judged:
        rows[name]["max_abs_diff_vs_dense"] = max(float(np.max(np.abs(a - r)))
                                                  for a, r in zip(outputs[name], reference))
    summary = measure_mod.interleaved_ratios(calls, next(iter(calls)), repeats, shuffle_seed=0) if calls else {}
    for name, figures in summary.items():
        rows[name].update(median_ms=figures["median_ms"], times_ms=figures["times_ms"])
    ratios = []
    for numerator, denominator, targets in w.ratios:
        ratio = dict(workload=w.name, length=w.length, mode=mode, numerator=numerator, denominator=denominator,
                     target=targets.get(mode), ratio_median=None, ratio_q1=None, ratio_q3=None, meets_target=None)
        if numerator in summary and denominator in summary:
            ratio.update(measure_mod.ratio_quartiles(summary[numerator]["times_ms"], summary[denominator]["times_ms"]))
            if ratio["target"] is not None:
                ratio["meets_target"] = ratio["ratio_median"] <= ratio["target"]
        ratios.append(ratio)
    return dict(rows=list(rows.values()), ratios=ratios, repeats=repeats)


# --- the report ---------------------------------------------------------------------------------

def _markdown(result: dict) -> str:
    lines = [f"# Programmable block-sparse attention against FlexAttention ({result['backend']}, "
             f"B={BATCH} H={HEADS} D={HEAD_DIM} {result['dtype']})", "",
             f"Interleaved repeats in a fresh random order ({result['repeats_note']}); load average "
             f"{result['load_average_start'][0]:.1f} at the start, {result['load_average_end'][0]:.1f} at the "
             f"end; jax {result['jax_version']}, torch {result['torch_version']} ({result['torch_threads']} "
             f"threads); {result['seconds']:.0f} s in all. Block masks of {BLOCK_SIZE}x{BLOCK_SIZE} tiles, "
             "built outside the timing. Differences: against torch SDPA on the dense mask or bias "
             "(forward: out; forward+backward: dq, dk, dv)."
             + ("" if result["flex_compiled"] else " torch flex ran EAGERLY here (not compiled)."), "",
             "## Ratios (median of per-repeat ratios, quartiles)", "",
             "| workload | L | mode | ratio | median | quartiles | target |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["ratios"]:
        target = "-" if r["target"] is None else f"<= {r['target']:g} ({'met' if r['meets_target'] else 'missed'})"
        figures = ("not timed | - " if r["ratio_median"] is None
                   else f"{r['ratio_median']:.2f}x | {r['ratio_q1']:.2f}-{r['ratio_q3']:.2f} ")
        if r["ratio_median"] is None and r["target"] is not None:
            target = f"<= {r['target']:g} (not timed)"
        lines.append(f"| {r['workload']} | {r['length']} | {r['mode']} | {r['numerator']} / {r['denominator']} "
                     f"| {figures}| {target} |")
    lines += ["", "## Times", "",
              "| workload | L | causal | mode | row | median | max abs diff vs dense SDPA | status |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        diff = r["max_abs_diff_vs_dense"]
        status = r["status"] if r["reason"] is None else f"{r['status']}: {r['reason']}"
        median = "-" if r["median_ms"] is None else f"{r['median_ms']:.1f} ms"
        lines.append(f"| {r['workload']} | {r['length']} | {'yes' if r['causal'] else 'no'} | {r['mode']} "
                     f"| {r['row']} | {median} | {'-' if diff is None else f'{diff:.1e}'} | {status} |")
    if result["skipped"]:
        lines += ["", "Skipped (time budget of {:.0f} s spent): ".format(result["time_budget_s"])
                  + ", ".join(f"{s['workload']} {s['mode']}" for s in result["skipped"])]
    return "\n".join(lines) + "\n"


def run_suite(out_dir, device: str, length: int | None = None, repeats: int | None = None,
              time_budget: float | None = None) -> list[pathlib.Path]:
    """One ``length`` (``--seq-lens``) replaces both 8192 and 4096; ``repeats`` (``--repeats``)
    every workload's; after ``time_budget`` seconds (``--time-budget``) no new workload and mode
    starts (they are listed as skipped)."""
    import torch
    out_dir = pathlib.Path(out_dir)
    kind = "cuda" if device == "cuda" else "cpu"
    started = time.perf_counter()
    result = dict(backend=jax.default_backend(), device=device, dtype=DTYPES[kind], jax_version=jax.__version__,
                  torch_version=torch.__version__, torch_threads=torch.get_num_threads(),
                  load_average_start=os.getloadavg(), time_budget_s=time_budget, flex_compiled=compile_flex,
                  repeats_note=(f"{repeats} each" if repeats else
                                f"{repeats_for(MASK_LENGTH, kind)} at L > {BIAS_LENGTH}, else "
                                f"{repeats_for(BIAS_LENGTH, kind)}"),
                  rows=[], ratios=[], skipped=[])
    for workload in workloads(length or MASK_LENGTH, length or BIAS_LENGTH):
        for mode in MODES:
            if time_budget is not None and time.perf_counter() - started > time_budget:
                result["skipped"].append(dict(workload=workload.name, mode=mode))
                continue
            measured = measure(workload, mode, repeats or repeats_for(workload.length, kind), kind, DTYPES[kind])
            result["rows"] += measured["rows"]
            result["ratios"] += measured["ratios"]
            print(f"{workload.name} L={workload.length} {mode}: " + ", ".join(
                f"{r['row']} " + (r["status"] if r["median_ms"] is None else f"{r['median_ms']:.1f} ms")
                for r in measured["rows"]), flush=True)
            gc.collect()
    result["load_average_end"] = os.getloadavg()
    result["seconds"] = time.perf_counter() - started
    (out_dir / f"{NAME}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / f"{NAME}.md").write_text(_markdown(result))
    print(_markdown(result))
    return [out_dir / f"{NAME}.json", out_dir / f"{NAME}.md"]
