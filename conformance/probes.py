"""Semantic probes: what each framework does where conventions differ (suite "probes").

Observations, compared with docs/semantics.md (jax_impl's semantics): empty rows give 0 (and
zero gradients, no NaN), ``is_causal`` is top-left, mask True = may attend, fp16 large logits
stay within tolerance, the default scale is 1/sqrt(D). Only jax_impl.* must follow them (its
probes decide the exit code); a plug-in's differences are reported, never judged; other
frameworks are only observed.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from conformance import tolerance
from conformance.cases import Inputs, get_suite, make_inputs
from conformance.harness import must_pass
from conformance.runs import platform_limitation
from conformance.oracle import baseline, oracle
from conformance.adapters.base import Adapter
from conformance.runs import NotSupported

EXPECTED = {  # docs/semantics.md, for jax_impl.*
    "probe_empty_rows": "out 0, dq 0, no NaN",
    "probe_causal_q<k": "top-left",
    "probe_causal_q>k": "top-left",
    "probe_mask_convention": "True = may attend",
    "probe_fp16_large_logits": "finite, within tolerance",
    "probe_default_scale": "1/sqrt(D)",
}
QUESTIONS = {
    "probe_empty_rows": "a query row with no allowed key (bool mask all False in that row)",
    "probe_causal_q<k": "is_causal with Lq=32 < Lk=64: which diagonal",
    "probe_causal_q>k": "is_causal with Lq=64 > Lk=32: which diagonal",
    "probe_mask_convention": "bool mask: True means",
    "probe_fp16_large_logits": "fp16, logits ~ +-500 (exp overflows fp16 past 11.1)",
    "probe_default_scale": "scale not given",
}


@dataclasses.dataclass
class ProbeRow:
    probe: str
    impl: str
    observation: str
    conforms: bool | None = None   # jax_impl and plug-ins: does it follow docs/semantics.md

    def to_json(self):
        return dataclasses.asdict(self)


def _rows(mask_rows: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Entries of x [B, Lq, H, D] in rows where mask_rows [B, Lq, H] is True."""
    return x[np.broadcast_to(mask_rows[..., None], x.shape)]


def _classify(x: np.ndarray) -> str:
    if x.size == 0:
        return "-"
    if np.isnan(x).any():
        return "NaN"
    if np.all(x == 0):
        return "0"
    return "non-zero"


def _matches(value, ref, dtype, base=None) -> bool:
    return tolerance.judge("out", value, ref, ref if base is None else base, dtype).passed


def _row_allowed(inputs: Inputs) -> np.ndarray:
    a = inputs.allowed()
    a = np.broadcast_to(a.any(-1), (a.shape[0], inputs.case.q_heads, a.shape[2]))
    return np.swapaxes(a, 1, 2)  # [B, Lq, Hq]


def observe(name: str, inputs: Inputs, values: dict, adapter: Adapter) -> tuple[str, bool]:
    """(observation, follows docs/semantics.md)."""
    c = inputs.case
    out = values["out"]
    if name == "probe_empty_rows":
        empty = ~_row_allowed(inputs)
        o = _rows(empty, out)
        kind = _classify(o)
        if kind == "non-zero":
            v = np.repeat(inputs.v.astype(np.float64), c.q_heads // c.kv_heads, axis=2).mean(axis=1)  # [B, H, D]
            uniform = np.broadcast_to(v[:, None], out.shape)
            kind = "uniform over all keys" if np.allclose(o, _rows(empty, uniform), atol=1e-3) else "other"
        grads = "" if "dq" not in values else f", dq {_classify(_rows(empty, values['dq']))}"
        leak = [g for g in ("out", "dq", "dk", "dv") if g in values and np.isnan(values[g]).any()]
        obs = f"out {kind}{grads}" + (f", NaN in {'/'.join(leak)}" if leak else ", no NaN")
        return obs, obs == "out 0, dq 0, no NaN"
    if name.startswith("probe_causal"):
        top = oracle(inputs, causal_alignment="top_left")["out"]
        bottom_oracle = oracle(inputs, causal_alignment="bottom_right")["out"]
        lq, lk = c.q_len, c.kv_len
        rows = np.arange(lq) >= max(lq - lk, 0)  # rows with a key under both alignments
        sub = lambda x: x[:, rows]
        found = [label for label, ref in (("top-left", top), ("bottom-right", bottom_oracle))
                 if np.isfinite(sub(out)).all() and _matches(sub(out), sub(ref), c.dtype)]
        obs = " and ".join(found) if found else "neither alignment"
        if not rows.all() and "bottom-right" in found:
            obs += f" (rows with no key under bottom-right: {_classify(out[:, ~rows])})"
        return obs, found == ["top-left"]
    if name == "probe_mask_convention":
        attend = oracle(inputs)["out"]
        masked = oracle(inputs, mask=~inputs.mask)["out"]
        if _matches(out, attend, c.dtype):
            return "True = may attend", True
        if np.nan_to_num(out, nan=1e9).size and _matches(np.nan_to_num(out), masked, c.dtype):
            return "True = masked out", False
        return "neither reading", False
    if name == "probe_fp16_large_logits":
        ref, base = oracle(inputs), baseline(inputs)
        if not np.isfinite(out).all():
            return "NaN/inf in out", False
        v = tolerance.judge("out", out, ref["out"], base["out"], c.dtype)
        grads = [tolerance.judge(g, values[g], ref[g], base[g], c.dtype) for g in ("dq", "dk", "dv") if g in values]
        worst = max([v] + grads, key=lambda x: x.ratio)
        ok = v.passed and all(g.passed for g in grads)
        return (f"finite, {'within' if ok else 'OUTSIDE'} tolerance (worst {worst.name} ratio "
                f"{worst.ratio:.2g}, out rel {v.relative_norm:.1e})"), ok
    if name == "probe_default_scale":
        if adapter.explicit_scale:
            return f"n/a: {adapter.explicit_scale}", True
        found = [label for label, s in (("1/sqrt(D)", None), ("1", 1.0))
                 if _matches(out, oracle(inputs, scale=s)["out"], c.dtype)]
        obs = " and ".join(found) if found else "neither 1/sqrt(D) nor 1"
        return obs, found == ["1/sqrt(D)"]
    raise ValueError(f"unknown probe {name!r}")


def naive_fp16_softmax_overflows(inputs: Inputs) -> bool:
    """Whether exp(logits) without subtracting the row max overflows fp16 for these inputs."""
    c = inputs.case
    q = inputs.q.astype(np.float32)
    k = np.repeat(inputs.k.astype(np.float32), c.q_heads // c.kv_heads, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) * c.effective_scale
    with np.errstate(over="ignore"):
        return bool(np.isinf(np.exp(logits.astype(np.float16))).any())


def probe_one(name: str, inputs: Inputs, adapter: Adapter) -> ProbeRow:
    """One probe through one adapter; "n.s." rows for what it (or the platform) cannot run."""
    judged = must_pass(adapter.name)
    reason = adapter.unsupported(inputs.case)
    if reason:
        return ProbeRow(name, adapter.name, f"n.s.: {reason}")
    try:
        prepared = adapter.prepare(inputs, backward=True)
        prepared.run()
        obs, ok = observe(name, inputs, prepared.results(), adapter)
    except (NotSupported, NotImplementedError) as e:
        return ProbeRow(name, adapter.name, f"n.s.: {e}"[:300])
    except Exception as e:
        limit = platform_limitation(e)
        if limit:
            return ProbeRow(name, adapter.name, f"n.s.: {limit}"[:300])
        return ProbeRow(name, adapter.name, f"error: {type(e).__name__}: {e}"[:300], False if judged else None)
    if prepared.info.get("sdpa_backend") and adapter.name == "torch.sdpa.auto":
        obs += f" [ran {prepared.info['sdpa_backend']}]"
    return ProbeRow(name, adapter.name, obs, ok if judged else None)


def run_probes(adapters: list[Adapter], progress=None, names=None) -> list[ProbeRow]:
    """Every probe (or those in ``names``) through every adapter."""
    rows = []
    for case in get_suite("probes"):
        if names is not None and case.name not in names:
            continue
        inputs = make_inputs(case)
        for adapter in adapters:
            rows.append(probe_one(case.name, inputs, adapter))
            if progress:
                progress(case.name, adapter.name)
    return rows
