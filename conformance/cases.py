"""Conformance cases and their inputs: one seeded numpy draw that every implementation receives.

A ``Case`` names a shape, a dtype and the mask features in use; ``make_inputs(case)`` draws
q, k, v, the cotangent, and the bias / mask / lengths / segment ids the case asks for, as
numpy arrays in the JAX layout ``[B, L, H, D]``. The bytes are the same for every
implementation: bf16 arrays are ``ml_dtypes.bfloat16`` and reach torch bit-exactly through
``torch_ref.to_torch``.

Decisions:
- the bias is drawn in the case dtype (SDPA requires a float mask in the query dtype, and so
  every framework adds exactly the same values); shape ``[B, Hq, Lq, Lk]``, or
  ``[1, Hq, Lq, Lk]`` with ``bias_shape="shared_batch"``; its gradient comes back in that shape;
- the bool mask (True = may attend) is ``[B, 1, Lq, Lk]`` (``"bool"``), ``[B, Hq, Lq, Lk]``
  (``"bool_heads"``) or ``[B, 1, 1, Lk]`` (``"key_padding"``); every row keeps at least one
  allowed key unless ``empty_rows`` asks for rows with none;
- lengths are int32 ``[B]`` in ``[1, L]``; queries past ``q_len`` are rows with no allowed key
  by definition (output 0); segment ids int32 ``[B, L]``, contiguous packed segments, every id
  present in both q and kv;
- one random cotangent ``[B, Lq, Hq, D]`` in the case dtype serves every backward.
Values are standard normal (never zeros); ``logit_scale`` multiplies q and k (large logits).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_dtypes
import numpy as np

from conformance import mods as mods_mod

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
MASKS = ("none", "bool", "bool_heads", "key_padding")
CAUSAL = (None, "top_left", "bottom_right")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int = 2
    q_heads: int = 4
    kv_heads: int = 4
    q_len: int = 64
    kv_len: int = 64
    head_dim: int = 64
    dtype: str = "float32"
    mask: str = "none"              # see MASKS
    bias: bool = False
    causal: str | None = None       # None | "top_left" | "bottom_right"
    window: tuple | None = None     # (left, right), None = unbounded side
    lengths: bool = False           # random per-batch query and key/value lengths
    segments: bool = False          # random packed segment ids
    soft_cap: float | None = None
    seed: int = 0
    scale: float | None = None      # None: the implementation's default (1/sqrt(D) in docs/semantics.md)
    bias_shape: str = "full"        # "full" [B, Hq, Lq, Lk] | "shared_batch" [1, Hq, Lq, Lk]
    empty_rows: bool = False        # the bool mask leaves some query rows with no allowed key
    logit_scale: float = 1.0        # multiplies q and k: large logits (fp16 overflow probes)
    interpret_ok: bool = True       # small enough for the Pallas interpreter on CPU
    native_causal: bool = False     # probe: pass the framework's own causal flag, whatever its alignment
    dropout: float = 0.0            # attention dropout rate; the pattern: Inputs.dropout_keep()
    sinks: bool = False             # random per-head attention sinks
    # > 0: jax_impl reads K/V from a paged cache of this page size (the same keys, pages in a
    # shuffled order; forward only, judged on the output); other frameworks do not take it.
    page_size: int = 0
    # FlexAttention-style mods (a name in conformance/mods.py's MODS): a score_mod and/or
    # mask_mod with their mod_aux arrays, the same definition run by every framework.
    mods: str | None = None
    # > 0: jax_impl also gets create_block_mask(mask_mod, block_size=...), PyTorch's
    # create_block_mask this BLOCK_SIZE (default: its 128).
    block_size: int = 0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"{self.dtype=} must be one of {tuple(DTYPES)}")
        if self.mask not in MASKS:
            raise ValueError(f"{self.mask=} must be one of {MASKS}")
        if self.causal not in CAUSAL:
            raise ValueError(f"{self.causal=} must be one of {CAUSAL}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"{self.q_heads=} must be a multiple of {self.kv_heads=}")
        if self.empty_rows and self.mask not in ("bool", "bool_heads"):
            raise ValueError("empty_rows needs mask='bool' or 'bool_heads'")
        if min(self.batch, self.q_heads, self.kv_heads, self.q_len, self.kv_len, self.head_dim) < 1:
            raise ValueError(f"every size must be >= 1: {self}")
        if self.mods is not None:
            m = mods_mod.get(self.mods)
            if m.same_lengths and self.q_len != self.kv_len:
                raise ValueError(f"mods={self.mods!r} indexes one [B, L] array with q_idx and kv_idx: "
                                 f"needs q_len == kv_len, got {self.q_len}, {self.kv_len}")
            if m.oracle_soft_cap is not None and (self.soft_cap is not None or self.bias):
                raise ValueError(f"mods={self.mods!r} is the oracle's built-in soft cap: it takes "
                                 "no soft_cap or bias of the case (they come before it)")
        if self.block_size and (self.mods is None or mods_mod.get(self.mods).mask_mod is None):
            raise ValueError(f"block_size={self.block_size} needs mods with a mask_mod")

    @property
    def np_dtype(self):
        return DTYPES[self.dtype]

    @property
    def effective_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.scale is None else float(self.scale)

    def describe(self) -> str:
        """One line: shape and features."""
        parts = [f"B{self.batch} Hq{self.q_heads}/Hkv{self.kv_heads} Lq{self.q_len} Lk{self.kv_len} "
                 f"D{self.head_dim} {self.dtype}"]
        if self.mask != "none":
            parts.append(f"mask={self.mask}" + ("(empty rows)" if self.empty_rows else ""))
        if self.bias:
            parts.append("bias" + ("[1,H]" if self.bias_shape == "shared_batch" else ""))
        if self.causal:
            parts.append(f"causal={self.causal}")
        if self.window:
            parts.append(f"window={self.window}")
        if self.lengths:
            parts.append("lengths")
        if self.segments:
            parts.append("segments")
        if self.soft_cap:
            parts.append(f"soft_cap={self.soft_cap}")
        if self.scale is not None:
            parts.append(f"scale={self.scale}")
        if self.logit_scale != 1.0:
            parts.append(f"logits x{self.logit_scale ** 2:g}")
        if self.dropout:
            parts.append(f"dropout={self.dropout:g}")
        if self.sinks:
            parts.append("sinks")
        if self.page_size:
            parts.append(f"paged={self.page_size}")
        if self.mods:
            parts.append(f"mods={self.mods}" + (f" block_mask={self.block_size}" if self.block_size else ""))
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True, eq=False)
class Inputs:
    """numpy arrays, JAX layout. Optional entries are None when the case does not use them."""

    case: Case
    q: np.ndarray                      # [B, Lq, Hq, D] case dtype
    k: np.ndarray                      # [B, Lk, Hkv, D]
    v: np.ndarray                      # [B, Lk, Hkv, D]
    cotangent: np.ndarray              # [B, Lq, Hq, D]
    bias: np.ndarray | None = None     # [B|1, Hq, Lq, Lk] case dtype
    mask: np.ndarray | None = None     # [B, 1|Hq, Lq, Lk] or [B, 1, 1, Lk] bool
    q_lengths: np.ndarray | None = None   # [B] int32
    kv_lengths: np.ndarray | None = None  # [B] int32
    q_segment_ids: np.ndarray | None = None   # [B, Lq] int32
    kv_segment_ids: np.ndarray | None = None  # [B, Lk] int32
    sinks: np.ndarray | None = None           # [Hq] float32
    mod_aux: dict = dataclasses.field(default_factory=dict)  # name -> the mods' aux array, in order

    @property
    def mods(self) -> mods_mod.Mods | None:
        return mods_mod.get(self.case.mods) if self.case.mods else None

    def attention_kwargs(self) -> dict[str, Any]:
        """Keyword arguments in ``flash_attention``'s (and torch_ref's) names; only those in use."""
        c = self.case
        kw: dict[str, Any] = {}
        if c.scale is not None:
            kw["scale"] = float(c.scale)
        if c.causal is not None:
            kw["is_causal"] = True
            if c.causal == "bottom_right":
                kw["causal_alignment"] = "bottom_right"
        if c.window is not None:
            kw["local_window_size"] = tuple(c.window)
        if self.q_lengths is not None:
            kw["query_seq_lengths"] = self.q_lengths
            kw["key_value_seq_lengths"] = self.kv_lengths
        if self.q_segment_ids is not None:
            kw["q_segment_ids"] = self.q_segment_ids
            kw["kv_segment_ids"] = self.kv_segment_ids
        if c.soft_cap is not None:
            kw["logits_soft_cap"] = float(c.soft_cap)
        if self.sinks is not None:
            kw["attention_sinks"] = self.sinks
        if c.dropout:  # the pattern: dropout_key() for jax_impl, dropout_keep() for the oracle
            kw["dropout_rate"] = float(c.dropout)
        return kw

    def dropout_key(self):
        """The PRNG key of the case's dropout (flash_attention's ``dropout_rng``)."""
        import jax
        return jax.random.key(self.case.seed)

    def dropout_keep(self) -> np.ndarray:
        """Bool ``[B, Hq, Lq, Lk]`` keep mask that ``flash_attention`` draws from ``dropout_key()``
        with ``broadcast_dropout=False``, materialised by its public ``jax_impl.dropout_mask``:
        the oracle applies this mask, so both sides drop the identical pairs."""
        from jax_impl import dropout_mask
        c = self.case
        return np.asarray(dropout_mask(self.dropout_key(), (c.batch, c.q_heads, c.q_len, c.kv_len),
                                       c.dropout, broadcast_dropout=False))

    def allowed(self, with_mods: bool = True) -> np.ndarray:
        """Bool ``[B, 1|Hq, Lq, Lk]``: which pairs may interact (masking.py's rules, in numpy),
        the mask_mod's pairs among them unless ``with_mods`` is False."""
        return allowed_pattern(self, with_mods)

    def mod_mask(self) -> np.ndarray | None:
        """Bool ``[B, Hq, Lq, Lk]``: the case's mask_mod, evaluated densely; None without one."""
        c = self.case
        shape = (c.batch, c.q_heads, c.q_len, c.kv_len)
        return None if self.mods is None else mods_mod.dense_mask(self.mods, shape, tuple(self.mod_aux.values()))

    def empty_row_count(self) -> int:
        """Query rows (over batch and heads) with no allowed key."""
        a = self.allowed()
        a = np.broadcast_to(a, (a.shape[0], self.case.q_heads) + a.shape[2:])
        return int((~a.any(-1)).sum())


def allowed_pattern(inputs: Inputs, with_mods: bool = True) -> np.ndarray:
    c = inputs.case
    b, lq, lk = c.batch, c.q_len, c.kv_len
    mask, mod_mask = inputs.mask, inputs.mod_mask() if with_mods else None
    if mod_mask is not None:
        mask = mod_mask if mask is None else mask & mod_mask
    return allowed_pairs(lq, lk, inputs.q_lengths if inputs.q_lengths is not None else np.full(b, lq),
                         inputs.kv_lengths if inputs.kv_lengths is not None else np.full(b, lk),
                         c.causal, c.window, q_segment_ids=inputs.q_segment_ids,
                         kv_segment_ids=inputs.kv_segment_ids, mask=mask)


def allowed_pairs(lq: int, lk: int, q_lengths, kv_lengths, causal: str | None, window,
                  position_offset=None, q_segment_ids=None, kv_segment_ids=None, mask=None):
    """Bool ``[B, 1|Hm, Lq, Lk]``: which pairs may attend, from docs/semantics.md's rules in
    numpy (sharing no code with jax_impl). Lengths ``[B]`` (within [0, L]); ``causal`` None,
    "top_left" or "bottom_right"; ``window`` (left, right) with None sides, or None;
    ``position_offset`` ``[B]`` is added to the alignment's offset (a ring's key slice keeps its
    global band); ``mask`` broadcastable to ``[B, Hm, Lq, Lk]``."""
    i = np.arange(lq)[None, :, None]
    j = np.arange(lk)[None, None, :]
    ql = np.asarray(q_lengths, np.int64)[:, None, None]
    kl = np.asarray(kv_lengths, np.int64)[:, None, None]
    ok = (i < ql) & (j < kl)
    offset = kl - ql if causal == "bottom_right" else np.zeros_like(ql)
    if position_offset is not None:
        offset = offset + np.asarray(position_offset, np.int64)[:, None, None]
    diag = i + offset
    if causal is not None:
        ok &= j <= diag
    if window is not None:
        left, right = window
        if left is not None:
            ok &= j >= diag - left
        if right is not None:
            ok &= j <= diag + right
    if q_segment_ids is not None:
        ok &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    ok = ok[:, None]
    if mask is not None:
        ok = ok & mask
    return ok


def _normal(rng, shape, dtype, scale=1.0):
    x = rng.standard_normal(shape) * scale
    x = np.where(x == 0, 1e-3, x)  # never an exact zero
    return x.astype(dtype)


def _segments(rng, batch: int, length: int, other: int, count: int):
    """Contiguous segments with the same count in both sequences, each non-empty."""
    def cuts(n):
        if count <= 1 or n < count:
            return np.zeros(n, np.int32) if count <= 1 else np.minimum(np.arange(n), count - 1).astype(np.int32)
        bounds = np.sort(rng.choice(np.arange(1, n), count - 1, replace=False))
        return np.searchsorted(bounds, np.arange(n), side="right").astype(np.int32)
    return (np.stack([cuts(length) for _ in range(batch)]),
            np.stack([cuts(other) for _ in range(batch)]))


def make_inputs(case: Case) -> Inputs:
    """Seeded draw for ``case``; the same call always returns the same bytes."""
    rng = np.random.default_rng([case.seed, 0x5EED])
    dt = case.np_dtype
    b, hq, hkv, lq, lk, d = case.batch, case.q_heads, case.kv_heads, case.q_len, case.kv_len, case.head_dim
    q = _normal(rng, (b, lq, hq, d), dt, case.logit_scale)
    k = _normal(rng, (b, lk, hkv, d), dt, case.logit_scale)
    v = _normal(rng, (b, lk, hkv, d), dt)
    cotangent = _normal(rng, (b, lq, hq, d), dt)
    bias = mask = q_lengths = kv_lengths = q_seg = kv_seg = None
    if case.bias:
        bias = _normal(rng, (1 if case.bias_shape == "shared_batch" else b, hq, lq, lk), dt)
    if case.mask != "none":
        if case.mask == "key_padding":
            mask = rng.random((b, 1, 1, lk)) < 0.8
            mask[..., 0] = True
        else:
            mask = rng.random((b, hq if case.mask == "bool_heads" else 1, lq, lk)) < 0.7
            mask[..., np.arange(lq), np.arange(lq) % lk] = True  # every row keeps one key
            if case.empty_rows:
                rows = rng.choice(lq, max(1, lq // 4), replace=False)
                mask[0, :, rows, :] = False
    if case.lengths:
        q_lengths = rng.integers(1, lq + 1, b).astype(np.int32)
        kv_lengths = rng.integers(1, lk + 1, b).astype(np.int32)
        q_lengths[0], kv_lengths[-1] = lq, lk  # the full length occurs too
    if case.segments:
        count = int(rng.integers(2, 5))
        q_seg, kv_seg = _segments(rng, b, lq, lk, count)
    sinks = rng.standard_normal(hq).astype(np.float32) if case.sinks else None
    mod_aux = mods_mod.get(case.mods).aux(rng, case) if case.mods else {}
    return Inputs(case, q, k, v, cotangent, bias, mask, q_lengths, kv_lengths, q_seg, kv_seg, sinks, mod_aux)


# --- Named shapes (the benchmarks reuse them) ----------------------------------------------

@dataclasses.dataclass(frozen=True)
class Shape:
    """(batch, heads, seq_len, head_dim) plus dtype: a benchmark point."""
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    dtype: str = "float32"
    kv_heads: int | None = None
    kv_len: int | None = None

    def case(self, name: str | None = None, **features) -> Case:
        name = name or (f"B{self.batch}_H{self.heads}_L{self.seq_len}_D{self.head_dim}_{self.dtype}"
                        + ("_" + "_".join(f"{k}={v}" for k, v in sorted(features.items())) if features else ""))
        return Case(name, batch=self.batch, q_heads=self.heads, kv_heads=self.kv_heads or self.heads,
                    q_len=self.seq_len, kv_len=self.kv_len or self.seq_len, head_dim=self.head_dim,
                    dtype=self.dtype, interpret_ok=self.seq_len <= 256, **features)


COURSE_SHAPES = {
    "course_small_fp32": Shape(2, 4, 128, 64, "float32"),
    "course_long_fp16": Shape(1, 8, 2048, 64, "float16"),
}

SHAPES = {
    **COURSE_SHAPES,
    "gpt2_fp16": Shape(8, 12, 1024, 64, "float16"),
    "llama_gqa_bf16": Shape(1, 32, 4096, 128, "bfloat16", kv_heads=8),
    "long_bf16": Shape(1, 16, 8192, 128, "bfloat16"),
    "decode_bf16": Shape(8, 32, 1, 128, "bfloat16", kv_heads=8, kv_len=4096),
}


def sweep(seq_lens=(256, 512, 1024, 2048, 4096), *, batch: int = 1, heads: int = 8, head_dim: int = 64,
          dtype: str = "float16", **features) -> list[Case]:
    """Cases over sequence lengths, all else fixed (a benchmark sweep)."""
    return [Shape(batch, heads, n, head_dim, dtype).case(**features) for n in seq_lens]


# --- Suites ----------------------------------------------------------------------------------

def _quick() -> list[Case]:
    C = Case
    return [
        C("fp32_plain", 2, 4, 4, 64, 64, 64, "float32", seed=1),
        C("fp16_plain", 2, 4, 4, 64, 64, 64, "float16", seed=2),
        C("bf16_plain", 2, 4, 4, 64, 64, 64, "bfloat16", seed=3),
        C("fp32_bool_mask_d40", 2, 2, 2, 37, 45, 40, "float32", mask="bool", seed=4),
        C("fp32_bias", 2, 4, 4, 64, 96, 64, "float32", bias=True, seed=5),
        C("bf16_bias_shared_batch_heads_mask", 2, 4, 2, 48, 48, 64, "bfloat16", bias=True,
          bias_shape="shared_batch", mask="bool_heads", seed=6),
        C("fp32_causal_top_left_q<k", 1, 2, 2, 37, 100, 64, "float32", causal="top_left", seed=7),
        C("fp32_causal_bottom_right_q<k", 1, 2, 2, 37, 100, 64, "float32", causal="bottom_right", seed=8),
        C("fp16_causal_top_left_q>k", 1, 2, 2, 100, 37, 64, "float16", causal="top_left", seed=9),
        C("fp32_causal_bottom_right_q>k", 1, 2, 2, 100, 37, 64, "float32", causal="bottom_right", seed=10),
        C("fp32_window", 1, 2, 2, 96, 96, 64, "float32", window=(16, 8), seed=11),
        C("bf16_causal_window_br", 1, 2, 2, 64, 80, 64, "bfloat16", causal="bottom_right", window=(12, 0), seed=12),
        C("fp32_lengths", 3, 2, 2, 64, 72, 64, "float32", lengths=True, seed=13),
        C("fp16_lengths_causal_br", 3, 2, 2, 48, 64, 64, "float16", lengths=True, causal="bottom_right", seed=14),
        C("fp32_segments", 2, 2, 2, 64, 64, 64, "float32", segments=True, seed=15),
        C("fp32_soft_cap", 1, 2, 2, 64, 64, 64, "float32", soft_cap=5.0, logit_scale=2.0, seed=16),
        C("fp32_gqa", 2, 8, 2, 64, 64, 64, "float32", seed=17),
        C("bf16_mqa_causal", 2, 4, 1, 64, 64, 64, "bfloat16", causal="top_left", seed=18),
        C("fp32_len1_query", 2, 4, 4, 1, 129, 64, "float32", seed=19),
        C("fp32_len1_key", 1, 2, 2, 37, 1, 64, "float32", seed=20),
        C("fp32_odd_129", 1, 2, 2, 129, 129, 128, "float32", causal="top_left", seed=21),
        C("fp16_d128_bias_causal", 1, 2, 2, 64, 64, 128, "float16", bias=True, causal="top_left", seed=22),
        C("fp32_key_padding_scale", 2, 2, 2, 40, 40, 64, "float32", mask="key_padding", scale=0.3, seed=23),
        C("fp32_paged16_gqa_br_lengths", 2, 8, 2, 1, 129, 64, "float32", causal="bottom_right",
          lengths=True, page_size=16, seed=24),
        C("bf16_paged1_4rows_window", 1, 4, 1, 4, 37, 64, "bfloat16", causal="bottom_right",
          window=(20, 0), page_size=1, seed=25),
    ]


def _full() -> list[Case]:
    """Quick, plus a grid over dtypes x features x shapes (GPU, or a patient CPU)."""
    cases = list(_quick())
    seed = 100
    features = [
        {}, {"mask": "bool"}, {"bias": True}, {"causal": "top_left"}, {"causal": "bottom_right"},
        {"window": (32, 32)}, {"lengths": True}, {"segments": True}, {"soft_cap": 20.0},
        {"bias": True, "causal": "bottom_right", "lengths": True},
    ]
    shapes = [(2, 4, 4, 128, 128, 64), (1, 8, 2, 257, 300, 64), (1, 4, 4, 33, 511, 128),
              (1, 4, 1, 512, 512, 256), (2, 4, 4, 200, 100, 40)]
    for dtype in ("float32", "float16", "bfloat16"):
        for shape in shapes:
            for feat in features:
                seed += 1
                b, hq, hkv, lq, lk, d = shape
                tag = "_".join(f"{k}={v}" for k, v in feat.items()) or "plain"
                cases.append(Case(f"{dtype}_{b}x{hq}/{hkv}x{lq}x{lk}x{d}_{tag}", b, hq, hkv, lq, lk, d, dtype,
                                  seed=seed, interpret_ok=max(lq, lk) <= 300, **feat))
    return cases


def _decode() -> list[Case]:
    """A few query rows against a longer cache: the decode path (dense: at least 512 keys) and
    the paged cache (page sizes 1, 16, 64 and one that is not a tile multiple)."""
    C = Case
    no_interpreter = dict(interpret_ok=False)
    return [
        C("fp32_decode_gqa_br_lengths", 2, 8, 2, 1, 600, 64, "float32", causal="bottom_right",
          lengths=True, seed=601, **no_interpreter),
        C("bf16_decode_4rows_window_softcap", 2, 4, 1, 4, 520, 64, "bfloat16", causal="bottom_right",
          window=(200, 0), soft_cap=5.0, seed=602, **no_interpreter),
        C("fp16_decode_16rows_top_left_sinks", 1, 4, 4, 16, 700, 64, "float16", causal="top_left",
          sinks=True, seed=603, **no_interpreter),
        C("fp32_paged64_gqa_br_lengths", 2, 8, 2, 1, 600, 64, "float32", causal="bottom_right",
          lengths=True, page_size=64, seed=604),  # paged: small enough for the interpreter
        C("bf16_paged16_4rows_sinks", 2, 4, 2, 4, 300, 64, "bfloat16", causal="bottom_right",
          sinks=True, page_size=16, seed=605),
        C("fp32_paged7_mqa_window", 1, 4, 1, 2, 250, 64, "float32", causal="bottom_right",
          window=(64, 0), page_size=7, seed=606, **no_interpreter),
    ]


def _mods() -> list[Case]:
    """FlexAttention-style score_mod / mask_mod (conformance/mods.py), judged against the oracle's
    dense mask and bias; PyTorch's flex_attention runs the same definitions."""
    C = Case
    return [
        C("fp32_mods_documents", 2, 2, 2, 48, 48, 32, "float32", mods="documents", seed=1001),
        C("fp32_mods_documents_block16", 2, 2, 2, 48, 48, 32, "float32", mods="documents",
          block_size=16, seed=1002),
        C("fp32_mods_prefix_lm_block16", 2, 2, 2, 40, 40, 32, "float32", mods="prefix_lm",
          block_size=16, seed=1003),
        C("bf16_mods_sliding_global_block16", 1, 2, 2, 64, 64, 32, "bfloat16", mods="sliding_global",
          block_size=16, seed=1004),
        C("fp32_mods_alibi_gqa_causal_br_bias", 2, 4, 2, 40, 48, 32, "float32", mods="alibi",
          causal="bottom_right", bias=True, seed=1005),
        C("fp32_mods_t5", 1, 4, 4, 48, 40, 32, "float32", mods="t5", seed=1006),
        C("fp16_mods_t5_lengths", 2, 2, 2, 32, 32, 32, "float16", mods="t5", lengths=True, seed=1007),
        C("fp32_mods_soft_cap", 1, 2, 2, 48, 48, 32, "float32", mods="soft_cap", logit_scale=2.0, seed=1008),
        C("fp32_mods_empty_rows_block16", 1, 2, 2, 32, 32, 32, "float32", mods="empty_rows",
          block_size=16, seed=1009),
        C("fp32_mods_alibi_documents_window", 2, 4, 4, 48, 48, 32, "float32", mods="alibi_documents",
          window=(16, 0), seed=1010),
    ]


def _course() -> list[Case]:
    return [shape.case(name, seed=i) for i, (name, shape) in enumerate(COURSE_SHAPES.items())] + \
        [shape.case(name + "_causal", causal="top_left", seed=10 + i)
         for i, (name, shape) in enumerate(COURSE_SHAPES.items())]


def _probes() -> list[Case]:
    """Semantic probes: observations of what each framework does (see conformance/probes.py)."""
    C = Case
    return [
        C("probe_empty_rows", 1, 2, 2, 16, 16, 32, "float32", mask="bool", empty_rows=True, seed=901),
        C("probe_causal_q<k", 1, 2, 2, 32, 64, 32, "float32", causal="top_left", native_causal=True, seed=902),
        C("probe_causal_q>k", 1, 2, 2, 64, 32, 32, "float32", causal="top_left", native_causal=True, seed=903),
        C("probe_mask_convention", 1, 2, 2, 16, 16, 32, "float32", mask="bool", seed=904),
        C("probe_fp16_large_logits", 1, 2, 2, 32, 32, 64, "float16", logit_scale=12.0, seed=905),
        C("probe_default_scale", 1, 2, 2, 16, 16, 64, "float32", seed=906),
    ]


def _training() -> list[Case]:
    """Attention dropout (the oracle applies the identical materialised pattern) and sinks."""
    C = Case
    return [
        C("fp32_dropout", 2, 4, 2, 48, 64, 32, "float32", dropout=0.2, causal="top_left", seed=801),
        C("bf16_dropout_lengths", 2, 4, 4, 40, 40, 32, "bfloat16", dropout=0.1, lengths=True, seed=802),
        C("fp32_sinks_gqa_causal_br", 2, 4, 2, 37, 50, 32, "float32", sinks=True,
          causal="bottom_right", seed=803),
        C("fp16_sinks_mask_empty_rows", 1, 2, 2, 32, 32, 32, "float16", sinks=True, mask="bool",
          empty_rows=True, seed=804),
        C("fp32_dropout_sinks_bias", 2, 2, 2, 32, 48, 32, "float32", dropout=0.1, sinks=True,
          bias=True, seed=805),
    ]


SUITES = {"quick": _quick(), "full": _full() + _training() + _decode() + _mods(), "course": _course(),
          "probes": _probes(), "training": _training(), "decode": _decode(), "mods": _mods()}


def get_suite(name: str) -> list[Case]:
    if name not in SUITES:
        raise ValueError(f"suite {name!r} must be one of {tuple(SUITES)}")
    return SUITES[name]
