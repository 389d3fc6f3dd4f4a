"""Seeded fuzz of the fused CPU kernel (implementation="cpu") against the float64 oracle.

    python3 tests/jax_impl/cpu_fuzz.py FAMILY [FAMILY ...] --seed S [--calls N | --sample ci]
        [--index I] [--implementation xla]

draws N calls (default: the family's own count; ``--sample ci``: the first third of its
configurations, ``calls_in``) of each FAMILY from the seed, one family after
the other in one process (the import and start-up, about 12 s under the sanitizers, paid once),
and runs each forward and backward (jax.vjp: out, dq, dk, dv, and dbias / dsinks where a bias /
attention_sinks exist) with ``implementation="cpu"``, then judges every result against
``torch_ref.manual_attention`` in float64 on the same numpy inputs (conformance.tolerance.judge,
the same-dtype torch run setting the bar, as the other tests do). Before each call it prints,
flushed, one JSON line ``{"call": {...}}`` describing the input (shapes, dtype, options, seed,
index, a command that reruns it alone), so that a crash (test_cpu_kernel_sanitized.py runs this
under AddressSanitizer + UBSan) names its input. After each family a JSON line
``{"summary": {...}}`` (it names the family); the exit status is 0 when every call of every
family passed, 1 otherwise. ``--implementation xla`` runs the same draws on the xla path: a check
of this harness (the xla path is the reference blocked implementation).

Families (``FAMILIES``): each draws a few static configurations (shape, dtype, mask options:
one compilation each) and several calls per configuration that vary what is data (lengths,
segment ids, position offsets, non-finite values, the values themselves), so that the whole
sample stays cheap to compile. ``FEATURE_FAMILIES`` draw the features beyond the mask rules (a
bias, a dense mask, a soft cap, dropout, sinks, any head_dim); a refusal fails them.

Non-finite values (docs/semantics.md): a NaN/inf in Q, K or V at a position no row may attend
never reaches a result; a pair a row may attend whose query row or key row holds one makes the
row NaN, and its gradients reach exactly what the row attends. Every result's NaN pattern must
equal the oracle's exactly (torch_ref.manual_attention computes the rule densely), and every
other entry must be finite and within tolerance of the oracle. As a check of this harness, the
oracle's pattern of out is also compared with the rule derived here (``poisoned_rows``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import traceback
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # this worktree's jax_impl, conformance and torch_ref, not an install
    sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from conformance.cases import allowed_pairs

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
DTYPES = tuple(NP_DTYPES)
ODD_LENGTHS = (1, 7, 33, 63, 65, 97, 129, 130, 161, 200)
CORE_HEAD_DIMS = (16, 32, 48, 64, 80, 128)  # multiples of 16: no padding
ANY_HEAD_DIMS = (4, 8, 24, 40, 72, 120)     # FEATURE: any head_dim (padded to 16)
HEADS = ((1, 1), (2, 2), (4, 4), (2, 1), (4, 2), (4, 1))  # (Hq, Hkv): groups of 1, 2, 4; MQA
CUSTOM_CALLS = ("jax_flash_attention_cpu_forward", "jax_flash_attention_cpu_backward")
# The decode families (``decode``, ``decode_paged``) call cpu_kernel.decode directly, forward
# only (the dispatcher that routes flash_attention to it is wired elsewhere).
REFUSAL = "implementation='cpu' cannot run this call"
# Calls of the features beyond the mask rules (a refusal fails them).
FEATURE_FAMILIES = ("bias", "mask", "soft_cap", "dropout", "sinks", "head_dim", "mods")


# --- What one call is -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Config:
    """The static part of a call: one compilation."""

    b: int
    lq: int
    lk: int
    hq: int
    hkv: int
    d: int
    dtype: str
    causal: str | None = None          # None, "top_left", "bottom_right"
    window: tuple | None = None        # (left, right), None = unbounded side
    lengths: str = "none"              # "none", "concrete" (range-checked), "traced" (under jit)
    segments: bool = False
    block_sizes: tuple | None = None   # (block_q, block_k)
    scale: float | None = None
    offset: bool = False               # MaskInputs.position_offset: the backend called directly
    bias_shape: tuple | None = None    # FEATURE: additive bias [B|1, Hq|1, Lq, Lk]
    mask_shape: tuple | None = None    # FEATURE: dense bool mask
    soft_cap: float | None = None      # FEATURE: logits_soft_cap
    dropout: tuple | None = None       # FEATURE: (rate, broadcast_dropout)
    sinks: bool = False                # FEATURE: attention_sinks [Hq]
    decode: bool = False               # cpu_kernel.decode called directly (forward only)
    page_size: int | None = None       # decode: the cache as shuffled pages of this size
    poison_excluded: float = 0.0       # probability of non-finite values where no row attends
    poison_allowed: float = 0.0        # probability of non-finite values at an allowed pair
    huge_logits: bool = False          # q, k scaled so that max |q.k * scale| is Call.logit_scale
    decode_route: bool = False         # decode-shaped, differentiated: the regular forward runs
    mods: str | None = None            # FEATURE: FuzzMods.kind (score_mod / mask_mod)

    def describe(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default or f.name in ("dtype", "lengths")}


@dataclasses.dataclass
class Call:
    family: str
    seed: int
    index: int
    config: Config
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    ct: np.ndarray
    q_len: np.ndarray | None = None      # as passed (traced ones may lie outside [0, L])
    kv_len: np.ndarray | None = None
    q_seg: np.ndarray | None = None
    kv_seg: np.ndarray | None = None
    offset: np.ndarray | None = None
    bias: np.ndarray | None = None
    mask: np.ndarray | None = None
    sinks: np.ndarray | None = None
    dropout_seed: int | None = None
    logit_scale: float | None = None     # Config.huge_logits: the largest |q.k * scale| drawn
    poison: list = dataclasses.field(default_factory=list)  # [tensor, b, l, h, d or "all", value]

    @property
    def clamped_lengths(self):
        c = self.config
        q_len = np.full(c.b, c.lq) if self.q_len is None else np.clip(self.q_len, 0, c.lq)
        kv_len = np.full(c.b, c.lk) if self.kv_len is None else np.clip(self.kv_len, 0, c.lk)
        return q_len.astype(np.int64), kv_len.astype(np.int64)

    @property
    def has_lengths(self) -> bool:
        return self.q_len is not None or self.kv_len is not None

    def describe(self, implementation: str) -> dict:
        def runs(ids, limit=12):  # [start, id] of each run of equal ids, the first `limit`
            out = []
            for row in ids:
                starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
                out.append([[int(i), int(row[i])] for i in starts[:limit]]
                           + ([f"... {len(starts) - limit} more runs"] if len(starts) > limit else []))
            return out

        desc = {"family": self.family, "seed": self.seed, "index": self.index,
                "q": list(self.q.shape), "k": list(self.k.shape), "config": self.config.describe()}
        if self.q_len is not None:
            desc["query_seq_lengths"] = self.q_len.tolist()
        if self.kv_len is not None:
            desc["key_value_seq_lengths"] = self.kv_len.tolist()
        if self.q_seg is not None:  # runs of equal ids: [start, id]
            desc["q_segment_runs"], desc["kv_segment_runs"] = runs(self.q_seg), runs(self.kv_seg)
        if self.offset is not None:
            desc["position_offset"] = self.offset.tolist()
        if self.bias is not None:
            b = self.bias.astype(np.float64)
            desc["bias"] = {"shape": list(b.shape), "neg_inf": int(np.isneginf(b).sum()),
                            "huge_negative": int((np.isfinite(b) & (b < -1e4)).sum())}
        if self.mask is not None:
            desc["mask"] = {"shape": list(self.mask.shape), "density": round(float(self.mask.mean()), 3),
                            "empty_rows": int((~self.mask.any(-1)).sum())}
        if self.sinks is not None:
            desc["attention_sinks"] = self.sinks.astype(np.float64).tolist()
        if self.dropout_seed is not None:
            desc["dropout_rng"] = f"jax.random.key({self.dropout_seed})"
        if self.logit_scale is not None:
            desc["largest_logit"] = self.logit_scale
        if self.poison:
            desc["poison"] = self.poison
        desc["rerun"] = (f"python3 tests/jax_impl/cpu_fuzz.py {self.family} --seed {self.seed} "
                         f"--index {self.index}" + ("" if implementation == "cpu" else
                                                    f" --implementation {implementation}"))
        return desc


# --- Drawing ----------------------------------------------------------------------------------

class Draw:
    """A numpy Generator with the picks the families use."""

    def __init__(self, *words):
        self.rng = np.random.default_rng([int(w) for w in words])

    def pick(self, options):
        return options[int(self.rng.integers(len(options)))]

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def normal(self, *shape):
        return self.rng.standard_normal(shape).astype(np.float32)


def family_id(name: str) -> int:
    return zlib.crc32(name.encode())




def _dims(d: Draw, *, lengths=ODD_LENGTHS, head_dims=CORE_HEAD_DIMS, batch=(1, 2)):
    hq, hkv = d.pick(HEADS)
    return {"b": d.pick(batch), "lq": d.pick(lengths), "lk": d.pick(lengths), "hq": hq,
            "hkv": hkv, "d": d.pick(head_dims), "dtype": d.pick(DTYPES)}


def _mask_options(d: Draw, *, window_p=0.3, causal=(None, "top_left", "bottom_right")):
    window = None
    if d.chance(window_p):
        window = _window(d)
    return {"causal": d.pick(causal), "window": window}


def _window(d: Draw):
    small = lambda: int(d.pick([0, 1, 3, 5, 16, 40, 100]))
    return d.pick([(small(), small()), (small(), None), (None, small())])


def _cap(d: Draw, dims: dict) -> dict:
    """Keeps B * H * Lq * Lk * D (the oracle's cost, and ASan's) moderate."""
    while dims["b"] * dims["hq"] * dims["lq"] * dims["lk"] * dims["d"] > 2 ** 23:
        dims["lq"], dims["lk"] = max(1, dims["lq"] // 2) | 1, max(1, dims["lk"] // 2) | 1
    return dims


def config_shapes(d: Draw, c: int) -> Config:
    """Lq != Lk, odd lengths, decode (Lq = 1), Lk = 1, GQA/MQA, every dtype, no lengths."""
    dims = _cap(d, _dims(d))
    anchor = c % 4
    if anchor == 0:
        dims["lq"] = 1            # decode
    elif anchor == 1:
        dims["lk"] = 1
    elif anchor == 2 and dims["lq"] == dims["lk"]:
        dims["lk"] = dims["lq"] + 2
    scale = 0.3 if d.chance(0.2) else None
    return Config(**dims, **_mask_options(d, window_p=0.0), scale=scale, lengths="none")


def config_lengths(d: Draw, c: int, mode: str = "concrete") -> Config:
    return Config(**_cap(d, _dims(d)), **_mask_options(d, window_p=0.3), lengths=mode,
                  poison_excluded=0.4)


def config_traced_lengths(d: Draw, c: int) -> Config:
    return config_lengths(d, c, "traced")


def config_windows(d: Draw, c: int) -> Config:
    dims = _cap(d, _dims(d))
    if c % 3 == 0:  # a long sequence: keys past the window on both sides in several tiles
        dims.update(lq=d.pick([129, 161, 200]), lk=d.pick([130, 200]), b=1, hq=2, hkv=1, d=32)
    return Config(**dims, **_mask_options(d, window_p=1.0), lengths=d.pick(["none", "concrete", "traced"]),
                  poison_excluded=0.5)


def config_segments(d: Draw, c: int) -> Config:
    return Config(**_cap(d, _dims(d)), **_mask_options(d, window_p=0.2), segments=True,
                  lengths=d.pick(["none", "concrete", "traced"]), poison_excluded=0.4)


def config_nonfinite(d: Draw, c: int) -> Config:
    return Config(**_cap(d, _dims(d, batch=(1, 2))), **_mask_options(d, window_p=0.3),
                  segments=d.chance(0.25), lengths=d.pick(["none", "concrete", "traced"]),
                  poison_excluded=0.8, poison_allowed=0.6)


def config_position_offset(d: Draw, c: int) -> Config:
    opts = _mask_options(d, window_p=0.6, causal=(None, "top_left", "top_left", "bottom_right"))
    if opts["causal"] is None and opts["window"] is None:
        opts["causal"] = "top_left"
    blocks = d.pick([None, None, (16, 64), (32, 64), (64, 128)])
    return Config(**_cap(d, _dims(d)), **opts, lengths=d.pick(["none", "traced"]), offset=True,
                  segments=d.chance(0.2), block_sizes=blocks, poison_excluded=0.4)


def config_blocks(d: Draw, c: int) -> Config:
    blocks = (d.pick([16, 32, 64, 128]), d.pick([64, 128]))
    return Config(**_cap(d, _dims(d)), **_mask_options(d, window_p=0.4), block_sizes=blocks,
                  segments=d.chance(0.3), lengths=d.pick(["none", "concrete", "traced"]),
                  poison_excluded=0.3)


def config_packed_tiles(d: Draw, c: int) -> Config:
    """Packed documents (data_packed_tiles) at small explicit tiles: the kernels' tile
    classes hold many EMPTY, FULL and PARTIAL tiles, with causal, lengths, GQA, sinks, dropout."""
    dims = _dims(d, lengths=(300, 449, 513, 700), head_dims=(16, 16, 32))
    dims["lk"] = dims["lq"] if d.chance(0.7) else dims["lk"]  # self-attention mostly
    dropout = (d.pick([0.1, 0.3]), d.chance(0.5)) if d.chance(0.4) else None
    return Config(**_cap(d, dims), causal=("top_left", "bottom_right", None, "top_left")[c % 4],
                  window=_window(d) if d.chance(0.15) else None, segments=True,
                  lengths=d.pick(["none", "concrete", "traced"]),
                  block_sizes=d.pick([(16, 64), (32, 64), (16, 128), (64, 128)]),
                  sinks=d.chance(0.4), dropout=dropout, poison_excluded=0.3, poison_allowed=0.2)


def data_packed_tiles(d: Draw, call: Call) -> None:
    """Segment ids as packed documents: 2-12 per row, ascending, the same cuts on both sides
    where Lq = Lk, a padding id past the last document sometimes."""
    c = call.config
    n = int(d.rng.integers(2, 13))
    def cuts(length):
        starts = np.sort(d.rng.choice(np.arange(1, length), n - 1, replace=False))
        return np.searchsorted(starts, np.arange(length), side="right")

    q_seg, kv_seg = [], []
    for _ in range(c.b):
        q_ids = cuts(c.lq)
        kv_ids = q_ids if c.lq == c.lk else cuts(c.lk)
        if d.chance(0.3):  # padding: an id no query holds
            kv_ids = np.where(np.arange(c.lk) >= c.lk - int(d.rng.integers(1, 60)), 99, kv_ids)
        q_seg.append(q_ids)
        kv_seg.append(kv_ids)
    call.q_seg, call.kv_seg = (np.stack(x).astype(np.int32) for x in (q_seg, kv_seg))


# FEATURE families: calls the kernel does not take yet (FEATURE_FAMILIES).

def _feature_base(d: Draw, **dims_kw) -> dict:
    dims = _cap(d, _dims(d, lengths=(1, 7, 33, 65, 97, 130), **dims_kw))
    return dict(**dims, **_mask_options(d, window_p=0.25), lengths=d.pick(["none", "concrete", "traced"]),
                segments=d.chance(0.2), poison_excluded=0.3)


def config_bias(d: Draw, c: int) -> Config:
    base = _feature_base(d)
    shape = (d.pick([base["b"], 1]), d.pick([base["hq"], 1]), base["lq"], base["lk"])
    return Config(**base, bias_shape=shape)


def config_mask(d: Draw, c: int) -> Config:
    base = _feature_base(d)
    b, hq, lq, lk = base["b"], base["hq"], base["lq"], base["lk"]
    shape = d.pick([(b, 1, lq, lk), (b, hq, lq, lk), (b, 1, 1, lk), (1, 1, lq, lk)])
    return Config(**base, mask_shape=shape)


def config_soft_cap(d: Draw, c: int) -> Config:
    return Config(**_feature_base(d), soft_cap=d.pick([1.0, 5.0, 30.0]))


def config_dropout(d: Draw, c: int) -> Config:
    return Config(**_feature_base(d), dropout=(d.pick([0.1, 0.3, 0.6]), d.chance(0.5)))


def config_sinks(d: Draw, c: int) -> Config:
    return Config(**_feature_base(d), sinks=True)


def config_head_dim(d: Draw, c: int) -> Config:
    return Config(**_feature_base(d, head_dims=ANY_HEAD_DIMS))


def config_mods(d: Draw, c: int) -> Config:
    return Config(**_feature_base(d), mods=d.pick(list(FuzzMods.KINDS)))


@dataclasses.dataclass(frozen=True)
class FuzzMods:
    """The mods family's score_mod and mask_mod (bound methods: hashable static options) and
    their tables, drawn from the call's shape and ``seed``; ``dense`` gives the oracle their
    bias and mask, computed here in numpy."""

    # t5_window: T5 on q - kv in a window mask_mod on kv - q; alibi_query: ALiBi times a
    # per-query scale (values of kv - q alone, hoisted per tile, mixed with a per-query one).
    KINDS = ("alibi", "t5", "documents", "alibi_documents", "t5_window", "alibi_query")
    kind: str
    b: int
    hq: int
    lq: int
    lk: int
    seed: int

    def _rng(self, part):
        return np.random.default_rng([self.seed, part])

    def slopes(self):
        return self._rng(0).uniform(0.02, 0.8, self.hq).astype(np.float32)

    def table(self):  # T5: relative positions clipped to [-4, 4]
        return self._rng(1).standard_normal((9, self.hq)).astype(np.float32)

    def window(self):
        return 1 + self.seed % 40

    def query_scale(self):
        return self._rng(3).uniform(0.5, 2.0, self.lq).astype(np.float32)

    def documents(self):  # ascending document ids per row, queries and keys cut apart
        rng = self._rng(2)
        return (np.sort(rng.integers(0, 3, (self.b, self.lq)), 1).astype(np.int32),
                np.sort(rng.integers(0, 3, (self.b, self.lk)), 1).astype(np.int32))

    def score(self, s, b, h, q_idx, kv_idx):
        if self.kind == "t5":
            return s + jnp.asarray(self.table())[jnp.clip(kv_idx - q_idx, -4, 4) + 4, h]
        if self.kind == "t5_window":
            return s + jnp.asarray(self.table())[jnp.clip(q_idx - kv_idx, -4, 4) + 4, h]
        if self.kind == "alibi_query":
            return s + jnp.asarray(self.slopes())[h] * (kv_idx - q_idx) * jnp.asarray(self.query_scale())[q_idx]
        return s + jnp.asarray(self.slopes())[h] * (kv_idx - q_idx)

    def mask(self, b, h, q_idx, kv_idx):
        if self.kind == "t5_window":
            return jnp.abs(kv_idx - q_idx) <= self.window()
        q_doc, kv_doc = (jnp.asarray(x) for x in self.documents())
        return q_doc[b, q_idx] == kv_doc[b, kv_idx]

    def options(self) -> dict:
        return {"score_mod": self.score} if self.kind in ("alibi", "t5", "alibi_query") else \
            {"mask_mod": self.mask} if self.kind == "documents" else \
            {"score_mod": self.score, "mask_mod": self.mask}

    def dense(self):
        """(bias [1, Hq, Lq, Lk] float64 or None, allowed [B, 1, Lq, Lk] or None)."""
        rel = np.arange(self.lk)[None, :] - np.arange(self.lq)[:, None]  # kv - q
        bias = allowed = None
        if self.kind == "t5":
            bias = np.moveaxis(self.table().astype(np.float64)[np.clip(rel, -4, 4) + 4], -1, 0)[None]
        elif self.kind == "t5_window":
            bias = np.moveaxis(self.table().astype(np.float64)[np.clip(-rel, -4, 4) + 4], -1, 0)[None]
            allowed = np.broadcast_to(np.abs(rel) <= self.window(), (self.b, 1, self.lq, self.lk))
        elif self.kind in ("alibi", "alibi_documents", "alibi_query"):
            bias = self.slopes().astype(np.float64)[None, :, None, None] * rel
            if self.kind == "alibi_query":
                bias = bias * self.query_scale().astype(np.float64)[:, None]
        if self.kind in ("documents", "alibi_documents"):
            q_doc, kv_doc = self.documents()
            allowed = (q_doc[:, :, None] == kv_doc[:, None, :])[:, None]
        return bias, allowed


def fuzz_mods(c: Config) -> FuzzMods | None:
    return None if c.mods is None else FuzzMods(c.mods, c.b, c.hq, c.lq, c.lk,
                                                 zlib.crc32(repr(c).encode()))


def config_regressions(d: Draw, c: int) -> Config:
    """The two crashes first reported against this kernel, as they were found."""
    if c == 0:  # heap-use-after-free in the backward
        return Config(b=1, lq=512, lk=512, hq=1, hkv=1, d=64, dtype="float32", causal="bottom_right",
                      lengths="concrete")
    return Config(b=1, lq=4096, lk=100, hq=1, hkv=1, d=64, dtype="float32", window=(5, 5),
                  lengths="concrete")  # SIGSEGV


def data_regressions(d: Draw, call: Call) -> None:
    if call.config.lq == 512:
        call.q_len, call.kv_len = None, np.array([100], np.int32)
    else:
        call.q_len, call.kv_len = np.array([10], np.int32), None
        call.q, call.k, call.v = (np.ones_like(x) for x in (call.q, call.k, call.v))


def config_decode(d: Draw, c: int, paged: bool = False) -> Config:
    """cpu_kernel.decode: few query rows against a longer cache, mostly bottom-right causal."""
    hq, hkv = d.pick(HEADS + ((8, 2), (8, 1)))
    dims = dict(b=d.pick([1, 2]), lq=d.pick([1, 1, 2, 4, 7, 16]), lk=d.pick([7, 33, 130, 200, 601]),
                hq=hq, hkv=hkv, d=d.pick(CORE_HEAD_DIMS + ANY_HEAD_DIMS), dtype=d.pick(DTYPES))
    opts = _mask_options(d, window_p=0.3, causal=(None, "top_left", "bottom_right", "bottom_right"))
    offset = opts["causal"] is not None and d.chance(0.25)
    return Config(**_cap(d, dims), **opts, lengths="none" if offset else d.pick(["none", "concrete", "traced"]),
                  offset=offset, soft_cap=d.pick([None, None, 5.0]), sinks=d.chance(0.3), decode=True,
                  page_size=d.pick([1, 3, 16, 64]) if paged else None, poison_excluded=0.5,
                  poison_allowed=0.3)


def config_decode_paged(d: Draw, c: int) -> Config:
    return config_decode(d, c, paged=True)


# The largest |q.k * scale| the huge_logits family draws, per dtype, its limit last: float32 to
# 5e9 (finite, far past where a folded exponent t * scale * log2(e) - max * log2(e) loses every
# digit); float16 half its largest finite value; bfloat16 (computed in float32) as far as q.k
# stays finite in float32 with the default scale 1/sqrt(D).
HUGE_LOGITS = {"float32": (1e3, 1e6, 1e9, 5e9), "float16": (1e2, 3e3, 3.2e4),
               "bfloat16": (1e3, 1e9, 1e20, 4e36)}
# forward + backward; a decode-shaped call (Lq <= 16, Lk >= 512: implementations.decode_path)
# differentiated, which runs the regular forward so that the backward recomputes its logits;
# cpu_kernel.decode; the same on pages.
HUGE_LOGIT_PATHS = ("attention", "decode_route", "decode", "paged")


def huge_logit_path(c: Config) -> str:
    return ("paged" if c.page_size else "decode" if c.decode else
            "decode_route" if c.decode_route else "attention")


def config_huge_logits(d: Draw, c: int) -> Config:
    """Logits up to 1e9 in float32 and up to the dtype's limit in 16 bits (Call.logit_scale),
    on each path: one configuration per (path, dtype)."""
    path, dtype = HUGE_LOGIT_PATHS[c // 3 % 4], DTYPES[c % 3]
    hq, hkv = d.pick(((2, 1), (4, 2), (4, 4)))
    dims = dict(b=d.pick([1, 2]), hq=hq, hkv=hkv, d=d.pick([32, 64]), dtype=dtype)
    if path in ("attention", "decode_route"):  # under 512 keys the regular path, else decode's
        if path == "attention":
            dims.update(lq=d.pick([7, 40, 97]), lk=d.pick([33, 130, 300]))
        else:
            dims.update(lq=d.pick([1, 2, 16]), lk=d.pick([512, 600]))
        return Config(**_cap(d, dims), **_mask_options(d, window_p=0.2), huge_logits=True,
                      lengths=d.pick(["none", "traced"]), sinks=d.chance(0.5), poison_excluded=0.3,
                      decode_route=path == "decode_route")
    dims.update(lq=d.pick([1, 2, 4]), lk=d.pick([130, 600, 1200]))
    return Config(**_cap(d, dims), **_mask_options(d, window_p=0.2, causal=(None, "bottom_right")),
                  huge_logits=True, lengths=d.pick(["none", "traced"]), sinks=d.chance(0.5),
                  decode=True, page_size=d.pick([1, 16]) if path == "paged" else None,
                  poison_excluded=0.3)


def _logit_scale(call: Call, q: np.ndarray, k: np.ndarray, d: Draw):
    """q, k scaled by one factor so that max |q.k * scale| is a drawn logit scale (its limit in
    the first call of each configuration, so that the "ci" sample reaches every limit)."""
    c = call.config
    scales = HUGE_LOGITS[c.dtype]
    first = call.index % FAMILIES[call.family].per_config == 0
    call.logit_scale = scales[-1] if first else d.pick(scales)
    group = c.hq // c.hkv
    logits = np.einsum("bihd,bjhd->bhij", q.astype(np.float64),
                       np.repeat(k.astype(np.float64), group, axis=2))
    largest = np.abs(logits).max() * (c.scale or 1.0 / math.sqrt(c.d))
    factor = np.float32(math.sqrt(call.logit_scale / largest))
    return q * factor, k * factor


@dataclasses.dataclass(frozen=True)
class Family:
    config: object       # (Draw, config index) -> Config
    calls: int           # the default number of calls
    summary: str
    feature: bool = False
    per_config: int = 6  # calls per static configuration (one compilation)
    data: object = None  # (Draw, Call) -> None: adjusts a drawn call's data
    whole_in_ci: bool = False  # the "ci" sample draws every call (calls_in)


FAMILIES = {
    "shapes": Family(config_shapes, 80, "Lq != Lk, odd lengths, decode Lq=1, Lk=1, GQA/MQA, "
                     "dtypes, causal both alignments, scale"),
    "lengths": Family(config_lengths, 64, "concrete sequence lengths 0 / partial / L, with "
                      "causal, windows, non-finite values past them"),
    "traced_lengths": Family(config_traced_lengths, 64, "sequence lengths traced under jit "
                             "(not range-checked; below 0 or past L clamped)"),
    "windows": Family(config_windows, 72, "local windows left / right / both, with causal "
                      "top_left and bottom_right, lengths, non-finite values outside"),
    "segments": Family(config_segments, 56, "segment ids (packed and random), with lengths, "
                       "causal, windows"),
    "nonfinite": Family(config_nonfinite, 72, "NaN/inf at excluded positions (never reach) and "
                        "at allowed pairs (exactly the rows that attend them)"),
    "position_offset": Family(config_position_offset, 72, "MaskInputs.position_offset (ring "
                              "attention's band shift), backend called directly"),
    "blocks": Family(config_blocks, 56, "explicit BlockSizes(block_q 16..128, block_k 64/128) "
                     "with every mask"),
    "packed_tiles": Family(config_packed_tiles, 36, "packed documents (segment ids) at small "
                           "tiles: the tile classes' EMPTY / FULL / PARTIAL tiles, with causal, "
                           "lengths, GQA, sinks, dropout", per_config=3, data=data_packed_tiles),
    "regressions": Family(config_regressions, 2, "the first crashes reported: L=512 bottom_right "
                          "causal with kv length 100 (use-after-free); 4096 queries of length 10, "
                          "window (5, 5) (SIGSEGV)", per_config=1, data=data_regressions,
                          whole_in_ci=True),
    "decode": Family(config_decode, 24, "cpu_kernel.decode on a dense cache: Lq 1-16, GQA/MQA, "
                     "lengths, windows, offsets, soft cap, sinks, non-finite values"),
    "decode_paged": Family(config_decode_paged, 24, "cpu_kernel.decode on shuffled pages of 1-64 "
                           "slots (NaN in every slot and page no length reaches)"),
    "huge_logits": Family(config_huge_logits, 24, "|q.k * scale| up to 5e9 in float32 and the "
                          "dtype's limit in 16 bits: forward + backward (also from the decode "
                          "kernel's statistics), decode, paged",
                          per_config=2, whole_in_ci=True),
    "bias": Family(config_bias, 24, "additive float bias broadcast over batch/heads, "
                   "-inf and huge negative rows; dbias", feature=True),
    "mask": Family(config_mask, 24, "dense bool mask, rows with no allowed key",
                   feature=True),
    "soft_cap": Family(config_soft_cap, 24, "logits_soft_cap", feature=True),
    "dropout": Family(config_dropout, 24, "dropout_rate > 0 with a dropout_rng "
                      "(oracle: jax_impl.dropout_mask)", feature=True),
    "sinks": Family(config_sinks, 24, "attention_sinks [Hq], dsinks", feature=True),
    "head_dim": Family(config_head_dim, 24, "head_dim not a multiple of 16",
                       feature=True),
    "mods": Family(config_mods, 24, "score_mod and mask_mod in the kernel's row programs: ALiBi, "
                   "T5 (its table a constant), documents, ALiBi inside documents", feature=True),
}
assert set(FEATURE_FAMILIES) == {n for n, f in FAMILIES.items() if f.feature}
SAMPLES = ("full", "ci")


def calls_in(family: str, sample: str = "full") -> int:
    """The calls a sample draws of ``family``: "full", its own count; "ci", the calls of the
    first third of its configurations (at least one; every call of the regressions), what CI
    runs under the sanitizers (a third of the compilations; every case of the coverage list
    still reached)."""
    if sample not in SAMPLES:
        raise ValueError(f"sample must be one of {SAMPLES}, got {sample!r}")
    fam = FAMILIES[family]
    if sample == "full" or fam.whole_in_ci:
        return fam.calls
    configs = -(-fam.calls // fam.per_config)
    return min(fam.calls, fam.per_config * -(-configs // 3))


def draw_config(family: str, seed: int, config_index: int) -> Config:
    d = Draw(seed, family_id(family), 1, config_index)
    return FAMILIES[family].config(d, config_index)


def _lengths_for(d: Draw, n: int, size: int, mode: str) -> np.ndarray:
    options = [0, 1, size, size, int(d.rng.integers(0, size + 1)), int(d.rng.integers(0, size + 1))]
    if mode == "traced":  # not range-checked under jit: clamped to [0, L]
        options += [size + 1, size + 37, -3]
    return np.array([d.pick(options) for _ in range(n)], np.int32)


def _segment_ids(d: Draw, b: int, lq: int, lk: int):
    if d.chance(0.6):  # packed sequences: sorted runs, same count of segments on both sides
        n = int(d.rng.integers(1, 5))
        cut = lambda length: np.sort(d.rng.integers(0, n, length))
        return (np.stack([cut(lq) for _ in range(b)]).astype(np.int32),
                np.stack([cut(lk) for _ in range(b)]).astype(np.int32))
    ids = lambda length: d.rng.integers(0, 3, (b, length)).astype(np.int32)
    return ids(lq), ids(lk)


def draw_call(family: str, seed: int, index: int) -> Call:
    return make_call(family, draw_config(family, seed, index // FAMILIES[family].per_config),
                     seed, index)


def make_call(family: str, config: Config, seed: int, index: int) -> Call:
    """The data of call ``index`` of ``family`` (its data hook applied) for ``config``."""
    c = config
    d = Draw(seed, family_id(family), 2, index)
    dt = NP_DTYPES[c.dtype]
    q, k, v, ct = (d.normal(*s) for s in ((c.b, c.lq, c.hq, c.d), (c.b, c.lk, c.hkv, c.d),
                                          (c.b, c.lk, c.hkv, c.d), (c.b, c.lq, c.hq, c.d)))
    call = Call(family, seed, index, c, q, k, v, ct)
    if c.huge_logits:
        q, k = _logit_scale(call, q, k, d)
    if c.lengths != "none":
        call.q_len = _lengths_for(d, c.b, c.lq, c.lengths)
        call.kv_len = _lengths_for(d, c.b, c.lk, c.lengths)
    elif c.offset:  # the backend takes lengths always; full ones
        call.q_len, call.kv_len = np.full(c.b, c.lq, np.int32), np.full(c.b, c.lk, np.int32)
    if c.segments:
        call.q_seg, call.kv_seg = _segment_ids(d, c.b, c.lq, c.lk)
    if c.offset:  # ring steps (multiples of a chunk), anything, and bands past either end
        span = c.lq + c.lk
        call.offset = np.array([d.pick([0, c.lk, -c.lq, int(d.rng.integers(-span, span + 1)),
                                        int(d.rng.integers(-span, span + 1)), span + 5, -span - 5])
                                for _ in range(c.b)], np.int32)
    if c.bias_shape is not None:
        bias = d.normal(*c.bias_shape)
        huge = d.pick([-np.inf, float(np.finfo(np.float16).min) if c.dtype == "float16" else -1e9])
        rows = d.rng.random(c.bias_shape[:-1]) < 0.2  # whole rows -inf or huge negative
        bias[rows] = huge + (bias[rows] if np.isfinite(huge) else 0)
        cells = d.rng.random(c.bias_shape) < 0.05     # single pairs excluded by -inf
        bias[cells] = -np.inf
        call.bias = bias
    if c.mask_shape is not None:
        mask = d.rng.random(c.mask_shape) < d.pick([0.3, 0.7, 0.95])
        if c.mask_shape[-2] > 1:
            mask[..., d.rng.random(c.mask_shape[-2]) < 0.15, :] = False  # rows with no allowed key
        call.mask = mask
    if c.sinks:
        sinks = d.normal(c.hq) * 2
        if d.chance(0.3):
            sinks[int(d.rng.integers(c.hq))] = d.pick([-np.inf, -30.0, 6.0])
        call.sinks = sinks.astype(dt).astype(np.float32)  # representable in the call dtype
    if c.dropout is not None:
        call.dropout_seed = int(d.rng.integers(2 ** 31))
    q, k, v, ct = (x.astype(dt) for x in (q, k, v, ct))
    call.q, call.k, call.v, call.ct = q, k, v, ct
    if call.bias is not None:
        call.bias = call.bias.astype(dt)
    if FAMILIES[family].data is not None:
        FAMILIES[family].data(d, call)
    _poison(d, call)
    return call


def allowed_pattern(call: Call) -> np.ndarray:
    """Bool [B, Hq, Lq, Lk]: which pairs may attend (conformance.cases.allowed_pairs: the rules
    in numpy, sharing no code with jax_impl; the position offset as masking.MaskInputs
    documents it: added to the alignment's offset)."""
    c = call.config
    q_len, kv_len = call.clamped_lengths
    ok = allowed_pairs(c.lq, c.lk, q_len, kv_len, c.causal, c.window, call.offset, call.q_seg,
                       call.kv_seg, call.mask)
    mods = fuzz_mods(c)
    if mods is not None and mods.dense()[1] is not None:
        ok = ok & mods.dense()[1]
    return np.ascontiguousarray(np.broadcast_to(ok, (c.b, c.hq, c.lq, c.lk)))


EMPTY, PARTIAL, FULL = 0, 1, 2  # jax_impl.block_mask's tile classes, restated: the tests' own


def tile_classes_of(allowed: np.ndarray, block_q: int, block_k: int) -> np.ndarray:
    """``[..., nq, nk]`` int8 tile classes of an allowed pattern ``[..., Lq, Lk]``, from the
    pairs (numpy, sharing no code with jax_impl). Pairs past Lq or Lk count as excluded (a
    ragged tile is never FULL)."""
    *lead, lq, lk = allowed.shape
    nq, nk = -(-lq // block_q), -(-lk // block_k)
    padded = np.zeros((*lead, nq * block_q, nk * block_k), bool)
    padded[..., :lq, :lk] = allowed
    tiles = padded.reshape(*lead, nq, block_q, nk, block_k)
    return np.where(tiles.all((-3, -1)), FULL,
                    np.where(tiles.any((-3, -1)), PARTIAL, EMPTY)).astype(np.int8)


def _poison(d: Draw, call: Call) -> None:
    """Non-finite values: where no row may attend (always harmless) and, with the config's
    probability, at positions an allowed pair reads."""
    c = call.config
    allowed = allowed_pattern(call)
    group = c.hq // c.hkv
    key_used = allowed.reshape(c.b, c.hkv, group, c.lq, c.lk).any(axis=(2, 3))  # [B, Hkv, Lk]
    query_used = allowed.any(axis=-1)                                          # [B, Hq, Lq]
    value = lambda: d.pick([np.nan, np.inf, -np.inf])

    def put(name, b, pos, h):
        x = getattr(call, name)
        column = "all" if d.chance(0.5) else int(d.rng.integers(c.d))
        val = value()
        x[b, pos, h, slice(None) if column == "all" else column] = val
        call.poison.append([name, int(b), int(pos), int(h), column, str(val)])

    if d.chance(c.poison_excluded):
        for name, used in (("k", key_used), ("v", key_used), ("q", query_used)):
            free = np.argwhere(~used)  # (b, h, position)
            if len(free):
                for b, h, pos in free[d.rng.permutation(len(free))[:3]]:
                    put(name, b, pos, h)
    if d.chance(c.poison_allowed):
        name = d.pick(["q", "k", "v"])
        used = np.argwhere(query_used if name == "q" else key_used)
        if len(used):
            b, h, pos = used[int(d.rng.integers(len(used)))]
            put(name, b, pos, h)


# --- Running the implementation ----------------------------------------------------------------

def _flash_vjp(static, implementation, q, k, v, ct, bias, sinks, mask, q_len, kv_len, q_seg,
               kv_seg, rng):
    from jax_impl.flash_attention import flash_attention

    def attend(q, k, v, bias, sinks):
        return flash_attention(q, k, v, bias, mask, implementation=implementation,
                               query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                               q_segment_ids=q_seg, kv_segment_ids=kv_seg, attention_sinks=sinks,
                               dropout_rng=rng, **dict(static))

    out, pullback = jax.vjp(attend, q, k, v, bias, sinks)
    return (out, *pullback(ct))


def _offset_vjp(cfg, implementation, q, k, v, ct, q_len, kv_len, q_seg, kv_seg, offset):
    from jax_impl import dropout_sinks, implementations, masking, recompute_vjp

    masks = masking.MaskInputs(q_len, kv_len, q_seg, kv_seg, None, position_offset=offset)

    def attend(q, k, v):
        return recompute_vjp.attention(implementations.get(implementation), cfg, q, k, v, None, masks,
                                       dropout_sinks.SinksAndDropout())[0]

    out, pullback = jax.vjp(attend, q, k, v)
    return (out, *pullback(ct), None, None)


def _decode_out(cfg, q, k, v, q_len, kv_len, offset, sinks, table):
    from jax_impl import cpu_kernel, dropout_sinks, masking

    masks = masking.MaskInputs(q_len, kv_len, None, None, None, position_offset=offset)
    return cpu_kernel.decode(cfg, q, k, v, masks, dropout_sinks.SinksAndDropout(sinks=sinks), table)[0]


def decode_pages(call: Call):
    """call.k, call.v as shuffled pages [num_pages, page_size, Hkv, D] and the page table:
    two spare pages no entry names and the slots past Lk, all NaN (never read)."""
    c = call.config
    rng = np.random.default_rng([call.seed, call.index, 7])
    per = -(-c.lk // c.page_size)
    num_pages = c.b * per + 2
    order = rng.permutation(num_pages)[:c.b * per].astype(np.int32)
    pages = []
    for x in (call.k, call.v):
        padded = np.full((c.b, per * c.page_size, c.hkv, c.d), np.nan, x.dtype)
        padded[:, :c.lk] = x
        dst = np.full((num_pages, c.page_size, c.hkv, c.d), np.nan, x.dtype)
        dst[order] = padded.reshape(c.b * per, c.page_size, c.hkv, c.d)
        pages.append(dst)
    return pages[0], pages[1], order.reshape(c.b, per)


_JIT_FLASH = jax.jit(_flash_vjp, static_argnums=(0, 1))
_JIT_OFFSET = jax.jit(_offset_vjp, static_argnums=(0, 1))
_JIT_DECODE = jax.jit(_decode_out, static_argnums=(0,))
DECODE_CALL = "jax_flash_attention_cpu_decode"


class Runner:
    """Runs calls, compiling each static configuration once and checking, once per
    compilation, that the lowered program calls the CPU kernel's custom calls."""

    def __init__(self, implementation: str):
        self.implementation = implementation
        self.compiled = {}
        self.compiles = 0

    def _checked(self, fn, static, args, custom_calls=CUSTOM_CALLS):
        signature = (static, jax.tree.map(lambda x: (x.shape, str(x.dtype)), args))
        if signature not in self.compiled:
            lowered = fn.lower(*static, *args)
            if self.implementation == "cpu":
                text = lowered.as_text()
                missing = [name for name in custom_calls if name not in text]
                if missing:
                    raise AssertionError(f"implementation='cpu' did not lower to the kernel: "
                                         f"{missing} absent")
            self.compiled[signature] = lowered.compile()
            self.compiles += 1
        return self.compiled[signature]

    def run(self, call: Call) -> dict:
        c = call.config
        to = lambda x: None if x is None else jnp.asarray(x)
        q, k, v, ct, bias, sinks = map(to, (call.q, call.k, call.v, call.ct, call.bias, call.sinks))
        q_seg, kv_seg = to(call.q_seg), to(call.kv_seg)
        if c.decode:
            return {"out": np.asarray(self._run_decode(call, q, k, v, sinks), np.float64)}
        if c.offset:
            results = self._run_offset(call, q, k, v, ct, q_seg, kv_seg)
        else:
            static = tuple(sorted(_static_options(c).items()))
            rng = None if call.dropout_seed is None else jax.random.key(call.dropout_seed)
            mask = to(call.mask)
            lengths = (call.q_len, call.kv_len)
            if c.lengths != "concrete":  # traced lengths, or none: one jitted program
                args = (q, k, v, ct, bias, sinks, mask, *map(to, lengths), q_seg, kv_seg, rng)
                results = self._checked(_JIT_FLASH, (static, self.implementation), args)(*args)
            else:  # concrete lengths (numpy): flash_attention range-checks them
                if self.implementation == "cpu":
                    self._check_route_eager(static, q, k, v, ct, bias, sinks, mask, lengths, q_seg,
                                            kv_seg, rng)
                results = _flash_vjp(static, self.implementation, q, k, v, ct, bias, sinks, mask,
                                     *lengths, q_seg, kv_seg, rng)
        out, dq, dk, dv, dbias, dsinks = results
        named = {"out": out, "dq": dq, "dk": dk, "dv": dv, "dbias": dbias, "dsinks": dsinks}
        return {n: np.asarray(x, np.float64) for n, x in named.items() if x is not None}

    def _check_route_eager(self, static, q, k, v, ct, bias, sinks, mask, lengths, q_seg, kv_seg, rng):
        """The eager path (concrete lengths) reaches the kernel too: lowered once per config,
        the lengths closed over as constants so that they stay concrete."""
        signature = ("eager", static, jax.tree.map(lambda x: (x.shape, str(x.dtype)),
                                                   (q, k, v, bias, sinks, mask, q_seg, kv_seg)))
        if signature in self.compiled:
            return
        fn = jax.jit(lambda q, k, v, ct, bias, sinks, mask, q_seg, kv_seg, rng: _flash_vjp(
            static, "cpu", q, k, v, ct, bias, sinks, mask, *lengths, q_seg, kv_seg, rng))
        text = fn.lower(q, k, v, ct, bias, sinks, mask, q_seg, kv_seg, rng).as_text()
        missing = [name for name in CUSTOM_CALLS if name not in text]
        if missing:
            raise AssertionError(f"implementation='cpu' did not lower to the kernel: {missing} absent")
        self.compiled[signature] = True
        self.compiles += 1

    def _run_decode(self, call, q, k, v, sinks):
        from jax_impl import masking
        from jax_impl.config import AttentionConfig

        if self.implementation != "cpu":
            raise ValueError("the decode families run cpu_kernel.decode only")
        c = call.config
        left, right = c.window if c.window is not None else (None, None)
        spec = masking.MaskSpec(is_causal=c.causal is not None, bottom_right=c.causal == "bottom_right",
                                window_left=left, window_right=right,
                                has_q_lengths=c.lengths != "none", has_kv_lengths=c.lengths != "none")
        cfg = AttentionConfig(scale=c.scale or 1.0 / math.sqrt(c.d), mask=spec, logits_soft_cap=c.soft_cap)
        q_len, kv_len = call.clamped_lengths  # the contract: clamped to [0, L] by the caller
        table = None
        if c.page_size is not None:
            k, v, table = (jnp.asarray(x) for x in decode_pages(call))
        args = (q, k, v, jnp.asarray(q_len, jnp.int32), jnp.asarray(kv_len, jnp.int32),
                None if call.offset is None else jnp.asarray(call.offset),
                None if sinks is None else sinks[None, :], table)
        return self._checked(_JIT_DECODE, (cfg,), args, (DECODE_CALL,))(*args)

    def _run_offset(self, call, q, k, v, ct, q_seg, kv_seg):
        from jax_impl import masking
        from jax_impl.config import AttentionConfig, BlockSizes

        c = call.config
        left, right = c.window if c.window is not None else (None, None)
        spec = masking.MaskSpec(is_causal=c.causal is not None, bottom_right=c.causal == "bottom_right",
                                window_left=left, window_right=right,
                                has_q_lengths=c.lengths != "none", has_kv_lengths=c.lengths != "none")
        blocks = None if c.block_sizes is None else BlockSizes(block_q=c.block_sizes[0],
                                                               block_k=c.block_sizes[1])
        cfg = AttentionConfig(scale=c.scale or 1.0 / math.sqrt(c.d), mask=spec, block_sizes=blocks)
        q_len, kv_len = call.clamped_lengths  # the backend's contract: clamped to [0, L]
        args = (q, k, v, ct, jnp.asarray(q_len, jnp.int32), jnp.asarray(kv_len, jnp.int32), q_seg,
                kv_seg, jnp.asarray(call.offset))
        return self._checked(_JIT_OFFSET, (cfg, self.implementation), args)(*args)


def _static_options(c: Config) -> dict:
    from jax_impl.config import BlockSizes

    opts = {}
    if c.causal:
        opts.update(is_causal=True, causal_alignment=c.causal)
    if c.window is not None:
        opts["local_window_size"] = c.window
    if c.block_sizes is not None:
        opts["block_sizes"] = BlockSizes(block_q=c.block_sizes[0], block_k=c.block_sizes[1])
    if c.scale is not None:
        opts["scale"] = c.scale
    if c.soft_cap is not None:
        opts["logits_soft_cap"] = c.soft_cap
    if c.dropout is not None:
        opts.update(dropout_rate=c.dropout[0], broadcast_dropout=c.dropout[1], deterministic=False)
    if c.mods is not None:
        opts.update(fuzz_mods(c).options())
    return opts


# --- The oracle and the judgement ---------------------------------------------------------------

def oracle_kwargs(call: Call) -> dict:
    c = call.config
    kw = {}
    if c.offset:  # the band as a dense mask built here from the rule (allowed_pattern)
        kw["mask"] = allowed_pattern(dataclasses.replace(call, q_seg=None, kv_seg=None))[:, :1]
    else:
        if c.causal:
            kw.update(is_causal=True, causal_alignment=c.causal)
        if c.window is not None:
            kw["local_window_size"] = c.window
        if call.has_lengths:
            kw["query_seq_lengths"], kw["key_value_seq_lengths"] = call.clamped_lengths
        kw["mask"] = call.mask
    if call.q_seg is not None:
        kw.update(q_segment_ids=call.q_seg, kv_segment_ids=call.kv_seg)
    if c.scale is not None:
        kw["scale"] = c.scale
    if call.bias is not None:
        kw["bias"] = call.bias
    if c.mods is not None:  # their dense bias and mask (applied after the soft cap, as mods are)
        bias, allowed = fuzz_mods(c).dense()
        if bias is not None:
            kw["bias"] = bias
        if allowed is not None:
            kw["mask"] = allowed if kw.get("mask") is None else kw["mask"] & allowed
    if c.soft_cap is not None:
        kw["logits_soft_cap"] = c.soft_cap
    if call.sinks is not None:
        kw["attention_sinks"] = call.sinks
    if c.dropout is not None:
        from jax_impl import dropout_mask
        rate, broadcast = c.dropout
        keep = dropout_mask(jax.random.key(call.dropout_seed), (c.b, c.hq, c.lq, c.lk), rate,
                            broadcast_dropout=broadcast)
        kw.update(dropout_mask=np.asarray(keep), dropout_rate=rate)
    return {n: x for n, x in kw.items() if x is not None}


def references(call: Call):
    """(float64 oracle, same-dtype baseline): torch_ref.manual_attention on the same inputs."""
    from _flash_helpers import torch_arrays

    kw = oracle_kwargs(call)
    args = (call.q, call.k, call.v, call.ct)
    oracle, plain = (torch_arrays(*args, dtype=np.float64, **kw),
                     torch_arrays(*args, dtype=NP_DTYPES[call.config.dtype], **kw))
    if call.config.decode:  # forward only
        return {"out": oracle["out"]}, {"out": plain["out"]}
    if call.config.mods is not None:  # the mods' bias is no input of the call (no dbias)
        oracle.pop("dbias", None), plain.pop("dbias", None)
    return oracle, plain


def poisoned_rows(call: Call, allowed: np.ndarray) -> np.ndarray:
    """[B, Hq, Lq]: the rows with an allowed pair whose query row or key row (k or v) holds a
    non-finite value, from the rule alone: the rows the oracle must make NaN."""
    c = call.config
    bad = lambda x: (~np.isfinite(x.astype(np.float32))).any(axis=-1)  # [B, L, H]
    bad_q = bad(call.q).transpose(0, 2, 1)                               # [B, Hq, Lq]
    bad_kv = np.repeat((bad(call.k) | bad(call.v)).transpose(0, 2, 1), c.hq // c.hkv, axis=1)
    return (allowed & (bad_q[..., :, None] | bad_kv[..., None, :])).any(-1)


def cancellation_allowance(call: Call, name: str) -> float:
    """What float32 may leave in dq or dk of huge logits beyond the oracle's: where a row's
    softmax is (nearly) one-hot, dS = P (dP - delta) cancels only to the rounding of two sums
    of D products (eps * D |dO| |v|), times the other operand and the scale, over the rows
    that attend one key (dk). 0 for other calls and results. The xla path leaves the same
    (bf16 at 4e36: dq 3e11 against |k| * scale ~ 4e17; fp16 at 3.2e4: 1.0e-4 over 9.8e-5)."""
    if call.logit_scale is None or name not in ("dq", "dk"):
        return 0.0
    c = call.config
    size = lambda x: float(np.max(np.abs(np.nan_to_num(x.astype(np.float64), posinf=0.0, neginf=0.0))))
    other, rows = (call.k, 1) if name == "dq" else (call.q, c.lq * (c.hq // c.hkv))
    scale = c.scale or 1.0 / math.sqrt(c.d)
    eps = float(np.finfo(np.float32).eps)
    return eps * c.d * rows * size(call.ct) * size(call.v) * size(other) * scale


def judge(call: Call, results: dict, oracle: dict, plain: dict) -> list[str]:
    """The problems of one call's results (empty: passed)."""
    from conformance import tolerance

    problems = []
    if set(results) != set(oracle):
        problems.append(f"results {sorted(results)} != oracle's {sorted(oracle)}")
    allowed = allowed_pattern(call)
    # Harness self-check: the oracle follows the rule as its docstring says (a row attending a
    # non-finite value is NaN, every other entry of out finite): a check of allowed_pattern.
    poisoned = np.broadcast_to(poisoned_rows(call, allowed).transpose(0, 2, 1)[..., None],
                               oracle["out"].shape)
    if not np.array_equal(np.isnan(oracle["out"]), poisoned) or not np.isfinite(oracle["out"][~poisoned]).all():
        problems.append("harness: the oracle's NaN pattern of out differs from the rule")
    for name in sorted(set(results) & set(oracle)):
        value, ref, base = results[name], oracle[name], plain[name]
        if value.shape != ref.shape:
            problems.append(f"{name}: shape {value.shape} != oracle's {ref.shape}")
            continue
        nan_ref = np.isnan(ref)
        checks = [(np.isnan(value) != nan_ref, "NaN where the oracle has none, or the reverse"),
                  (~nan_ref & ~np.isfinite(value), "inf where the oracle is finite")]
        for bad, what in checks:
            if bad.any():
                where = tuple(int(i) for i in np.argwhere(bad)[0])
                problems.append(f"{name}: {int(bad.sum())} of {bad.size} entries {what} "
                                f"(first at {list(where)})")
        compare = ~nan_ref & np.isfinite(value)
        def zero(x, compare=compare):
            return np.where(compare, x, 0.0)

        if not zero(ref).any() and not zero(base).any() and zero(value).any():
            # Exactly zero by structure (every row has at most one allowed key: softmax's
            # gradient cancels), and the plain baseline is exact too, so it sets no bar; a
            # blocked backward's dP - rowsum(dO * O) cancels only to rounding (of O in the
            # output dtype, of float32 sums over rows). tolerance.judge would then demand
            # its floor, which xla misses as well (fp32 Lk=1, Lq*group=388: 1.4e-5 > 1e-5;
            # fp16 with dropout, O rounded after scaling by 1/(1-rate): 1e-2). Bounded here
            # by sqrt(eps) of the call's largest gradient instead: garbage does not pass.
            scale = max([1.0] + [float(np.max(np.abs(np.where(np.isfinite(x), x, 0.0)), initial=0.0))
                                 for x in oracle.values()])
            bound = max(math.sqrt(float(ml_dtypes.finfo(NP_DTYPES[call.config.dtype]).eps)) * scale,
                        cancellation_allowance(call, name))
            error = float(np.max(np.abs(zero(value))))
            if error > bound:
                problems.append(f"{name}: {error:.3g} where the oracle is exactly 0 by structure "
                                f"> bound {bound:.3g}")
            continue
        verdict = tolerance.judge(name, zero(value), zero(ref), zero(base), call.config.dtype)
        allowed = verdict.tolerance + cancellation_allowance(call, name)
        if verdict.error > allowed:
            where = tuple(int(i) for i in np.unravel_index(
                np.argmax(np.abs(zero(value) - zero(ref))), value.shape))
            problems.append(f"{name}: max error {verdict.error:.3g} > tolerance {allowed:.3g} "
                            f"(baseline error {verdict.baseline_error:.3g}, relative norm "
                            f"{verdict.relative_norm:.3g}, worst at {list(where)})")
    return problems


def coverage(seed: int, families=None, sample: str = "full") -> dict:
    """What the drawn calls of ``sample`` reach (drawing only, nothing runs): name -> number of
    calls."""
    counts = {}

    def count(name, condition=True):
        counts[name] = counts.get(name, 0) + int(bool(condition))

    for family in families or FAMILIES:
        for index in range(calls_in(family, sample)):
            call = draw_call(family, seed, index)
            c = call.config
            count("calls")
            count(f"family {family}")
            count("Lq != Lk", c.lq != c.lk)
            count("odd Lq or Lk > 1", (c.lq % 2 and c.lq > 1) or (c.lk % 2 and c.lk > 1))
            count("Lq = 1 (decode)", c.lq == 1)
            count("Lk = 1", c.lk == 1)
            count(f"dtype {c.dtype}")
            count(f"Hq/Hkv = {c.hq // c.hkv}")
            count("MQA (Hkv = 1, Hq > 1)", c.hkv == 1 and c.hq > 1)
            count(f"causal {c.causal}")
            if c.window is not None:
                left, right = c.window
                count("window left only" if right is None else "window right only" if left is None
                      else "window both sides")
            count("segment ids", c.segments)
            count("block sizes", c.block_sizes is not None)
            count("position offset", c.offset)
            count("head_dim % 16 != 0", c.d % 16)
            if call.has_lengths and not c.offset:
                for lengths, size in ((call.q_len, c.lq), (call.kv_len, c.lk)):
                    for value in [] if lengths is None else lengths:
                        kind = ("0" if value == 0 else "partial" if 0 < value < size else
                                "L" if value == size else "> L" if value > size else "< 0")
                        count(f"length {kind} {c.lengths}")
            poisoned_at = {"allowed": False, "excluded": False}
            if call.poison:
                allowed = allowed_pattern(call)
                group = c.hq // c.hkv
                for name, b, pos, h, _, _ in call.poison:
                    if name == "q":
                        used = allowed[b, h, pos].any()
                    else:
                        used = allowed[b, h * group:(h + 1) * group, :, pos].any()
                    poisoned_at["allowed" if used else "excluded"] = True
            count("non-finite at excluded positions", poisoned_at["excluded"])
            count("non-finite at allowed positions", poisoned_at["allowed"])
            if call.logit_scale == HUGE_LOGITS[c.dtype][-1]:
                count(f"logits at the {c.dtype} limit, {huge_logit_path(c)}")
            for feature in ("bias_shape", "mask_shape", "soft_cap", "dropout", "sinks", "mods"):
                count(f"FEATURE {feature}", getattr(c, feature))
    return counts


# --- The run ------------------------------------------------------------------------------------

def run_family(family: str, seed: int, calls: int, implementation: str = "cpu", indices=None,
               max_failures: int = 5) -> dict:
    runner = Runner(implementation)
    start, cpu_start = time.time(), time.process_time()
    spent = {"implementation": 0.0, "oracle": 0.0, "judge": 0.0}  # wall seconds
    passed, failed, failures, refused = 0, 0, [], None
    indices = range(calls) if indices is None else indices
    ran = 0
    for index in indices:
        call = draw_call(family, seed, index)
        desc = call.describe(implementation)
        print(json.dumps({"call": desc}), flush=True)
        ran += 1
        tick = time.time()
        try:
            results = runner.run(call)
        except Exception as error:  # noqa: BLE001 (a refusal or any error of the implementation)
            message = f"{type(error).__name__}: {error}"
            if REFUSAL in str(error):
                refused = message.splitlines()[0]
                failed += 1
                failures.append({"index": index, "input": desc, "problems": [refused]})
                break  # every call of the family is refused alike
            problems = [message[:2000], "".join(traceback.format_exc(limit=-3))[-2000:]]
        else:
            spent["implementation"] += time.time() - tick
            tick = time.time()
            oracle, plain = references(call)
            spent["oracle"] += time.time() - tick
            tick = time.time()
            problems = judge(call, results, oracle, plain)
            spent["judge"] += time.time() - tick
        if problems:
            failed += 1
            if len(failures) < max_failures:
                failures.append({"index": index, "input": desc, "problems": problems})
            print(json.dumps({"failed": index, "problems": problems}), flush=True)
        else:
            passed += 1
    return {"family": family, "feature": FAMILIES[family].feature, "seed": seed,
            "implementation": implementation, "calls": ran, "passed": passed, "failed": failed,
            "refused": refused, "compilations": runner.compiles,
            "seconds": round(time.time() - start, 1),
            "cpu_seconds": round(time.process_time() - cpu_start, 1),
            "seconds_in": {n: round(t, 1) for n, t in spent.items()}, "failures": failures}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # No ``choices``: argparse would refuse an empty list of families (the --list form).
    parser.add_argument("family", nargs="*", help=f"one or more of {', '.join(FAMILIES)}")
    parser.add_argument("--seed", type=int, default=0)
    draws = parser.add_mutually_exclusive_group()
    draws.add_argument("--calls", type=int, default=None, help="default: the family's own count")
    draws.add_argument("--sample", choices=SAMPLES, default="full",
                       help="ci: the first third of each family's configurations (calls_in)")
    parser.add_argument("--index", type=int, action="append", help="run only this call (repeatable)")
    parser.add_argument("--implementation", default="cpu", choices=["cpu", "xla"])
    parser.add_argument("--list", action="store_true", help="the families and their default calls")
    parser.add_argument("--coverage", action="store_true", help="what the draws of every family reach")
    args = parser.parse_args(argv)
    unknown = [f for f in args.family if f not in FAMILIES]
    if unknown:
        parser.error(f"argument family: {unknown} not among {sorted(FAMILIES)}")
    if args.coverage:
        for name, n in sorted(coverage(args.seed, args.family or None, args.sample).items()):
            print(f"{n:5}  {name}")
        return 0
    if args.list or not args.family:
        for name, fam in FAMILIES.items():
            print(f"{name:16} {fam.calls:4} calls ({calls_in(name, 'ci'):3} in CI)"
                  f"{'  FEATURE' if fam.feature else ''}  {fam.summary}")
        return 0
    ok = True
    for family in args.family:
        calls = calls_in(family, args.sample) if args.calls is None else args.calls
        summary = run_family(family, args.seed, calls, args.implementation, args.index)
        print(json.dumps({"summary": summary}), flush=True)
        ok = ok and summary["failed"] == 0 and summary["calls"] > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
