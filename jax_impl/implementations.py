"""The one table of implementations: name -> how it runs, and when it can run.

Every implementation, cuDNN included, is an entry whose own rule (``Implementation.unsupported``:
head_dim, platform, interpreter, then the entry's ``call_unsupported``) says why it cannot run a
call (``CallFeatures``). ``flash_attention`` (its dispatch, the automatic choice and
``explain_implementation``), the custom VJP and the conformance registry all read this table;
nothing else restates which implementation can run a call.

A blocked implementation provides
  ``forward(cfg, q, k, v, bias, masks) -> (out, RowStats)`` and
  ``backward(cfg, q, k, v, bias, masks, stats, d_out, delta, extras) -> (dq, dk, dv, dbias | None,
  d_mod_aux)``
with q ``[B, Lq, Hq, D]``, k/v ``[B, Lk, Hkv, D]``, bias ``[Bb, Hb, Lq, Lk]`` or None and
``delta = rowsum(dO * O) - d(lse)`` ``[B, Hq, Lq]`` float32; ``d_mod_aux`` the cotangents of
``extras.mod_aux`` (a tuple aligned with it, None where not floating; ``()`` when it takes no
score_mod); ``recompute_vjp`` wires them into
one custom VJP. A dense implementation (the reference, jax.nn's cuDNN kernel) has neither: it
provides ``dense(cfg, q, k, v, bias, masks, extras) -> (out, lse or None)``, differentiated by
autodiff.
An implementation may also provide a decode path, forward only, for a few query rows against a
long (dense or paged) KV cache:
  ``decode(cfg, q, k, v, masks, extras, page_table) -> (out, RowStats)``
with ``page_table`` None (k/v ``[B, Lk, Hkv, D]``) or int32 ``[B, P]`` (k/v pages
``[num_pages, page_size, Hkv, D]``, ids within range); its RowStats follow ``forward``'s
convention, so the regular backward differentiates a dense decode call. ``decode_path`` says
when it runs.
The layers above (recompute_vjp, partitioned, ring) receive the chosen ``Implementation``;
only the API (flash_attention, context_parallel, arguments) reads this table.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np
from jax import lax

import jax.numpy as jnp

from jax_impl import (block_mask, cpu_kernel, cudnn, mods, mosaic_gpu, mosaic_tpu, pallas_triton,
                      reference, xla)
from jax_impl.call_features import CallFeatures
from jax_impl.platform import CUDA_PLATFORMS
from jax_impl.config import AttentionConfig, BlockSizes
from jax_impl.pallas_triton.heuristics import MAX_HEAD_DIM

@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str
    summary: str
    forward: Callable | None = None   # None: dense (``dense``), differentiated by autodiff
    backward: Callable | None = None
    # A dense implementation: ``dense(cfg, q, k, v, bias, masks, extras) -> (out, lse or None)``.
    dense: Callable | None = None
    max_head_dim: int | None = None
    needs_cuda: bool = False          # unless interpret=True (the Pallas interpreter)
    needs_cpu: bool = False
    needs_tpu: bool = False           # unless interpret=True (the TPU interpreter)
    has_interpreter: bool = False     # interpret=True runs its Pallas kernels interpreted
    automatic: bool = True            # may be chosen by implementation=None
    # Why it is never chosen by implementation=None (explain_implementation says it).
    manual_because: str = "it materialises the [Lq, Lk] logits"
    # Takes MaskInputs.position_offset (ring.py's local step, a key slice with its global band).
    takes_position_offset: bool = False
    # Hashes dropout at SinksAndDropout.dropout_offset (the ring's global positions).
    takes_dropout_offset: bool = False
    # Its interpreter (interpret=True) runs ordered io callbacks, which custom_partitioning cannot
    # lower: interpreted calls run unpartitioned (partitioned.py), on one device.
    interpreter_has_effects: bool = False
    # Its own rule: why it cannot take a call's features (CallFeatures), or None: it takes them.
    call_unsupported: Callable[[CallFeatures], str | None] | None = None
    # Few query rows against a long or paged cache (decode_path); None: dense calls run
    # `forward`, paged calls cannot run here.
    decode: Callable | None = None
    decode_takes_pages: bool = True   # False: its decode reads dense caches only
    decode_takes_mods: bool = False   # its decode evaluates score_mod and mask_mod
    # Why its decode cannot take a call (q_len=, dtype=, has_bias= ...), or None: takes it.
    decode_unsupported: Callable[..., str | None] | None = None
    # Why its decode cannot read pages of this shape (page_size=, head_dim=), or None: takes them.
    pages_unsupported: Callable[..., str | None] | None = None
    # Whose kernel its decode path is and why, where not its own (explain_implementation says it).
    decode_note: str = ""
    # (block_q, block_k) of its forward for (cfg, q, k, masks), q and k arrays or
    # ShapeDtypeStructs: tiles_visited reads its tile classes there. None: not reported.
    forward_tiles: Callable | None = None

    def unsupported(self, features: CallFeatures, platform: str | None = None) -> str | None:
        """Why this implementation cannot run the call ``features`` describes on ``platform``,
        or None if it can. ``platform`` None: the platform is not judged (a call whose
        implementation is named is judged where it is lowered)."""
        if self.max_head_dim is not None and features.head_dim > self.max_head_dim:
            return f"head_dim={features.head_dim} exceeds the kernel's maximum of {self.max_head_dim}"
        interpret = features.cfg.interpret
        if interpret and not self.has_interpreter:
            return (f"interpret=True runs a Pallas kernel in its interpreter; {self.name} has "
                    "none (pallas_triton, mosaic_gpu and mosaic_tpu do)")
        if platform is not None:
            if self.needs_cuda and not interpret and platform not in CUDA_PLATFORMS:
                how = " (interpret=True runs it anywhere)" if self.has_interpreter else ""
                return f"the {self.name} kernel needs a CUDA GPU; platform is {platform!r}{how}"
            if self.needs_tpu and not interpret and platform != "tpu":
                return (f"the {self.name} kernel needs a TPU; platform is {platform!r} "
                        "(interpret=True runs it in the TPU interpreter)")
            if self.needs_cpu and platform != "cpu":
                return f"the fused C++ kernel runs on the CPU; platform is {platform!r}"
        if self.call_unsupported is not None:
            return self.call_unsupported(features)
        return None


def _reference(cfg: AttentionConfig, q, k, v, bias, masks, extras):
    """The dense reference at float32 logits (float64 for float64 inputs): (out, lse)."""
    return reference.attention(q, k, v, bias, masks, cfg,
                               logits_dtype=jnp.promote_types(q.dtype, jnp.float32), extras=extras)


def _mosaic_gpu_backward(cfg: AttentionConfig, q, k, v, bias, masks, *args, **kwargs):
    """mosaic_gpu's backward: its own kernels, or, where ``mosaic_gpu.backward_unsupported``
    gives a reason (head_dim 256, dbias with the fused dQ, the caller's
    ``Config(backward="pallas_triton")``, an interpreted call), the Pallas Triton kernels from
    the same RowStats with their own tiles (the mosaic_gpu.Config in cfg.block_sizes is the
    forward's)."""
    if mosaic_gpu.backward_unsupported(cfg, has_bias=bias is not None,
                                       head_dim=q.shape[-1]) is None:
        return _with_mod_aux_gradient(mosaic_gpu.backward, cfg, q, k, v, bias, masks, *args,
                                      **kwargs)
    if not isinstance(cfg.block_sizes, (BlockSizes, type(None))):
        cfg = dataclasses.replace(cfg, block_sizes=None)
    return _pallas_triton_backward(cfg, q, k, v, bias, masks, *args, **kwargs)


def _with_mod_aux_gradient(kernel_backward: Callable, cfg: AttentionConfig, q, k, v, bias, masks,
                           stats, d_out, delta, extras=None):
    """A kernels' backward, with the gradient of the floating mod_aux that a score_mod reads
    taken from the xla backward (the kernels return none: summing it there would need atomics
    or a buffer per program)."""
    found = kernel_backward(cfg, q, k, v, bias, masks, stats, d_out, delta, extras)
    if extras is None or not any(mods.gradient_entries(cfg, extras.mod_aux)):
        return found
    if not isinstance(cfg.block_sizes, (BlockSizes, type(None))):
        cfg = dataclasses.replace(cfg, block_sizes=None)  # a mosaic_gpu.Config: not xla's
    d_mod_aux = xla.backward(cfg, q, k, v, bias, masks, stats, d_out, delta, extras)[4]
    return (*found[:4], d_mod_aux)


def _pallas_triton_backward(cfg: AttentionConfig, *args, **kwargs):
    """pallas_triton's backward, its mod_aux gradient from the xla backward."""
    return _with_mod_aux_gradient(pallas_triton.backward, cfg, *args, **kwargs)


def _mosaic_gpu_decode(cfg: AttentionConfig, *args, **kwargs):
    """mosaic_gpu's decode path: pallas_triton's split-K kernel, with its own tiles (a
    mosaic_gpu.Config in cfg.block_sizes sets the training kernels' tiles, not these)."""
    if not isinstance(cfg.block_sizes, (BlockSizes, type(None))):
        cfg = dataclasses.replace(cfg, block_sizes=None)
    return pallas_triton.decode(cfg, *args, **kwargs)


MOSAIC_GPU_DECODE_NOTE = (
    "mosaic_gpu's decode path is pallas_triton's split-K kernel: a decode step reads the KV "
    "cache once and is bound by memory bandwidth, which the Triton kernel already streams "
    "split over the keys on sm_90; no Mosaic GPU decode kernel is built (docs/limitations.md)")


IMPLEMENTATIONS: dict[str, Implementation] = {  # in order of preference
    "pallas_triton": Implementation(
        "pallas_triton", "the Pallas Triton GPU kernels (forward, dK/dV, dQ)",
        pallas_triton.forward, _pallas_triton_backward, max_head_dim=MAX_HEAD_DIM, needs_cuda=True,
        has_interpreter=True,
        call_unsupported=pallas_triton.unsupported, takes_position_offset=True, takes_dropout_offset=True, decode=pallas_triton.decode,
        decode_takes_mods=True, decode_unsupported=pallas_triton.decode_unsupported,
        pages_unsupported=pallas_triton.pages_unsupported,
        forward_tiles=lambda cfg, q, k, masks: pallas_triton.forward_blocks(cfg, q, k)),
    "mosaic_gpu": Implementation(
        "mosaic_gpu", "FlashAttention-3's design in Pallas Mosaic GPU for Hopper (sm_90a: TMA "
        "producer, two wgmma consumers, persistent): forward (ping-ponging consumers), dK/dV "
        "and dQ (no atomics); pallas_triton's backward when interpreted, at head_dim 256, for "
        "dbias with the fused dQ, or by Config(backward='pallas_triton'); decode: "
        "pallas_triton's split-K kernel",
        mosaic_gpu.forward, _mosaic_gpu_backward, needs_cuda=True, has_interpreter=True,
        automatic=False,
        manual_because="on an H200 (bf16, B=4, H=16, L=8192, D=128) it runs 1.3x "
                       "pallas_triton's throughput forward and 1.7x forward+backward, but the "
                       "quick conformance suite has not completed on a GPU and a choice made "
                       "while lowering cannot tell sm_90 from another CUDA GPU "
                       "(docs/limitations.md)",
        call_unsupported=mosaic_gpu.unsupported, takes_position_offset=True,
        takes_dropout_offset=True, interpreter_has_effects=True, decode=_mosaic_gpu_decode,
        decode_unsupported=pallas_triton.decode_unsupported,
        pages_unsupported=pallas_triton.pages_unsupported, decode_note=MOSAIC_GPU_DECODE_NOTE),
    "mosaic_tpu": Implementation(
        "mosaic_tpu", "FlashAttention in Pallas Mosaic TPU: forward, dK/dV and dQ kernels "
        "walking scalar-prefetched lists of the non-empty tiles (proven in the TPU interpreter "
        "and compiled for v4/v5e/v5p/v6e; speed unmeasured on TPU hardware)",
        mosaic_tpu.forward, mosaic_tpu.backward, needs_tpu=True, has_interpreter=True,
        takes_position_offset=True,
        interpreter_has_effects=True,
        call_unsupported=mosaic_tpu.unsupported,
        forward_tiles=lambda cfg, q, k, masks: mosaic_tpu.block_shape(cfg, q.shape[1], k.shape[1], masks)),
    "cpu": Implementation(
        "cpu", "fused C++ kernels for the CPU (XLA FFI, built on first use)", cpu_kernel.forward, cpu_kernel.backward, needs_cpu=True,
        decode=cpu_kernel.decode, decode_takes_mods=True,
        decode_unsupported=cpu_kernel.decode_unsupported,
        call_unsupported=cpu_kernel.unsupported, takes_position_offset=True,
        forward_tiles=lambda cfg, q, k, masks: cpu_kernel.forward_blocks(cfg, masks)),
    "xla": Implementation(
        "xla", "the same blocked algorithm in plain JAX: linear memory, any device",
        xla.forward, xla.backward, takes_position_offset=True, takes_dropout_offset=True,
        decode=xla.decode, decode_takes_mods=True,
        forward_tiles=lambda cfg, q, k, masks: xla.chunk_sizes(cfg, q.shape[1], k.shape[1], masks)),
    "reference": Implementation(
        "reference", "dense attention (materialises [Lq, Lk]); the oracle of the tests",
        dense=_reference, automatic=False),
    "cudnn": Implementation(
        "cudnn", "jax.nn.dot_product_attention's cuDNN kernel, for the calls whose meaning is "
        "this library's (cudnn.py)", dense=cudnn.attention, needs_cuda=True, automatic=False,
        manual_because="no conformance run on a GPU has passed it and no committed table says "
                       "it is faster (docs/limitations.md)",
        call_unsupported=cudnn.unsupported),
}


# The decode path runs for at most this many query rows against at least this many keys.
DECODE_MAX_QUERY_ROWS = 16
DECODE_MIN_KEYS = 512


def decode_path(implementation: Implementation, *, lq: int, lk: int, features: CallFeatures,
                paged: bool = False) -> str | None:
    """Why ``implementation`` runs this call on its regular path, or None: its decode path.

    A paged call has only the decode path (``paged_unsupported`` says when it cannot run)."""
    if paged:
        return None
    if implementation.decode is None:
        return f"{implementation.name} has no decode path"
    if features.cfg.has_mods and not implementation.decode_takes_mods:
        return f"{implementation.name}'s decode path takes no score_mod or mask_mod"
    if implementation.decode_unsupported is not None:
        why = implementation.decode_unsupported(
            q_len=lq, dtype=features.dtype, has_bias=features.has_bias,
            has_mask=features.has_mask, has_segment_ids=features.has_segment_ids,
            dropout_rate=features.cfg.dropout_rate)
        if why is not None:
            return why
    if lq > DECODE_MAX_QUERY_ROWS:
        return f"{lq} query rows (the decode path takes at most {DECODE_MAX_QUERY_ROWS})"
    if lk < DECODE_MIN_KEYS:
        return f"{lk} keys (the decode path starts at {DECODE_MIN_KEYS})"
    for present, what in ((features.has_bias, "a bias"), (features.has_mask, "a dense mask"),
                          (features.has_segment_ids, "segment ids"),
                          (features.cfg.dropout_rate > 0, "dropout"),
                          (features.cfg.mask.has_block_mask, "block_mask")):
        if present:
            return f"the decode path takes no {what}"
    return None


def tiles_visited(implementation: Implementation, cfg: AttentionConfig, q, k, masks) -> str:
    """How many tiles the implementation's forward computes, partial and full, summed over the
    batch rows and heads (``block_mask.tile_classes`` on its tiles), or "" where its tiles are
    not known or the mask inputs are traced."""
    if implementation.forward_tiles is None:
        return ""
    lq, lk = q.shape[1], k.shape[1]
    block_q, block_k = implementation.forward_tiles(cfg, q, k, masks)
    classes = block_mask.tile_classes(cfg.mask, masks, lq, lk, block_q, block_k,
                                      mask_mod=cfg.mask_mod is not None, band_only=True)
    try:
        classes = np.broadcast_to(np.asarray(classes), (q.shape[0], q.shape[2]) + classes.shape[2:])
    except jax.errors.ConcretizationTypeError:
        return ""
    partial, full = ((classes == c).sum() for c in (block_mask.PARTIAL, block_mask.FULL))
    return (f"{partial + full:,} of {classes.size:,} tiles of {block_q}x{block_k} "
            f"({partial:,} partial, {full:,} full; batch rows x heads x query tiles x key tiles)")


def paged_unsupported(implementation: Implementation, *, lq: int | None = None, dtype=None,
                      page_size: int | None = None, head_dim: int | None = None) -> str | None:
    """Why ``implementation`` cannot run a paged-cache call, or None. A paged call has only the
    decode path, so the decode's own limits (query rows, cache dtype, page shape) refuse it too;
    unknown arguments (None) are not judged."""
    if implementation.decode is None or not implementation.decode_takes_pages:
        what = (f"{implementation.name} has none" if implementation.decode is None
                else f"{implementation.name}'s reads dense caches only")
        return (f"a paged KV cache runs on an implementation's decode path; {what} "
                f"(implementations that take pages: {', '.join(paged_capable())})")
    if implementation.decode_unsupported is not None:
        why = implementation.decode_unsupported(q_len=lq, dtype=dtype)
        if why is not None:
            return f"its decode path cannot take this paged call: {why}"
    if implementation.pages_unsupported is not None:
        why = implementation.pages_unsupported(page_size=page_size, head_dim=head_dim)
        if why is not None:
            return f"its decode path cannot read these pages: {why}"
    return None


def paged_capable() -> tuple[str, ...]:
    return tuple(name for name, impl in IMPLEMENTATIONS.items()
                 if impl.decode is not None and impl.decode_takes_pages)


def get(name: str) -> Implementation:
    try:
        return IMPLEMENTATIONS[name]
    except KeyError:
        raise ValueError(f"implementation={name!r} must be one of "
                         f"{tuple(IMPLEMENTATIONS)} or None") from None


def reasons(platform: str, features: CallFeatures, *, paged: dict | None = None) -> dict:
    """Why each implementation cannot run a call on ``platform``: {name: reason, or None if it
    can}. ``paged``: the paged call's ``paged_unsupported`` arguments (None: a dense call)."""
    return {name: impl.unsupported(features, platform)
                  or (paged_unsupported(impl, **paged) if paged is not None else None)
            for name, impl in IMPLEMENTATIONS.items()}


def automatic(reasons_by_name: dict, among: tuple[str, ...] | None = None) -> str:
    """What ``implementation=None`` runs: the first automatic implementation, in order of
    preference, that ``reasons_by_name`` (``reasons``) lets run the call and, for a strategy
    that can use only some, is one of ``among``."""
    for name, impl in IMPLEMENTATIONS.items():
        if impl.automatic and reasons_by_name[name] is None and (among is None or name in among):
            return name
    raise ValueError(f"no implementation can run this call: {reasons_by_name}")


def on_lowering_platform(choose: Callable[[str], str], run: Callable[[str], Callable], *args):
    """``run(choose(platform))(*args)`` for the platform the call is lowered for, decided there
    (so that jax.export for "cuda" works on a CPU host); platforms other than CUDA, TPU and
    the CPU take ``choose("other")``."""
    default = choose("other")
    branches = {platform: run(name) for platform in ("cuda", "tpu", "cpu")
                if (name := choose(platform)) != default}
    if not branches:
        return run(default)(*args)
    return lax.platform_dependent(*args, **branches, default=run(default))


def blocked() -> tuple[str, ...]:
    """The implementations with a blocked forward and backward (a strategy's local kernel)."""
    return tuple(name for name, impl in IMPLEMENTATIONS.items() if impl.forward is not None)


def ring_capable() -> tuple[str, ...]:
    """The implementations a ring may run as its local step, in order of preference."""
    return tuple(name for name, impl in IMPLEMENTATIONS.items() if impl.takes_position_offset)


def ring_dropout_capable() -> tuple[str, ...]:
    """The ring-capable implementations that hash dropout at the ring's global positions."""
    return tuple(name for name in ring_capable() if IMPLEMENTATIONS[name].takes_dropout_offset)


def unsupported(name: str, features: CallFeatures, platform: str | None = None) -> str | None:
    """Why implementation ``name`` cannot run the call ``features`` describes (on ``platform``,
    where given), or None."""
    return get(name).unsupported(features, platform)
