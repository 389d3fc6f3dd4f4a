"""Public API: ``flash_attention``, a superset of ``jax.nn.dot_product_attention``, and
``explain_implementation``.

This file holds the signature, the docstring and the dispatch; ``arguments.py`` checks the
arguments, ``implementations.py`` says what can run a call, ``recompute_vjp.py`` wires the
chosen implementation into the custom VJP.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jax_impl import arguments, block_mask, implementations, partitioned, recompute_vjp
from jax_impl.call_features import CallFeatures
from jax_impl.config import BlockSizes
from jax_impl.implementations import IMPLEMENTATIONS


def flash_attention(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, bias: ArrayLike | None = None,
    mask: ArrayLike | None = None, *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size: int | tuple[int | None, int | None] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    causal_alignment: str = "top_left",
    q_segment_ids=None,
    kv_segment_ids=None,
    logits_soft_cap: float | None = None,
    block_sizes: BlockSizes | None = None,
    precision=None,
    interpret: bool = False,
    attention_sinks=None,
    context_parallel_strategy: str | None = None,
    # Keywords that Flax's attention modules pass to an `attention_fn`:
    dropout_rng=None,
    dropout_rate: float = 0.0,
    broadcast_dropout: bool = True,
    deterministic: bool | None = None,
    dtype=None,
    module=None,
    force_fp32_for_softmax: bool = False,
    qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None,
    page_table=None,
    score_mod=None,
    mask_mod=None,
    mod_aux=(),
    block_mask=None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Exact softmax attention, computed tile by tile (FlashAttention), forward and backward.

    A superset of ``jax.nn.dot_product_attention``: the arguments it shares with jax.nn mean
    the same, the others are additions. ``...`` below is any number of batch dims, possibly
    none. Bad input raises an error that names the argument and the rule.

    Args:
      query: ``[..., Lq, Hq, D]``, float32, float16 or bfloat16 (float64 with
        implementation="reference" only); accumulation is float32.
      key: ``[..., Lk, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA/MQA: query head h reads kv head
        ``h // (Hq // Hkv)``; K and V are never repeated in memory). With ``page_table``: pages
        ``[num_pages, page_size, Hkv, D]``.
      value: the same shape as key.
      bias: float, broadcastable to ``[..., Hq, Lq, Lk]``, added to the logits; differentiable.
      mask: bool, broadcastable to ``[..., Hq, Lq, Lk]``; True = may attend.
      scale: multiplies q.k; default ``1/sqrt(D)``.
      is_causal: key j allowed for query i when ``j <= i`` (top-left, as jax.nn and torch SDPA).
      query_seq_lengths: int ``[...]``; queries at or past the length take no part (their
        output rows are 0). Concrete lengths outside ``[0, L]`` raise; traced ones are clamped.
      key_value_seq_lengths: int ``[...]``; keys at or past the length take no part.
      local_window_size: ``w`` or ``(left, right)`` (None = unbounded side): key j allowed when
        ``i - left <= j <= i + right``, measured from the same diagonal as causal.
      implementation: a name of the implementation table (``jax_impl.implementations``):
        "pallas_triton" (the Pallas Triton GPU kernels), "mosaic_gpu" (FlashAttention-3's design
        in Pallas Mosaic GPU for H100/H200, by name only; 16-bit, head_dim 64/128/256, the
        backward at 256 pallas_triton's), "mosaic_tpu" (the Pallas Mosaic TPU kernels), "cpu" (the
        fused C++ CPU kernel), "xla" (the same blocked algorithm in plain JAX, linear memory, any
        device), "reference" (dense; for checking), "cudnn" (jax.nn.dot_product_attention's cuDNN
        kernel, by name only, for the calls whose meaning is this library's: 16-bit, no mask,
        lengths, window or additions; others are refused with the reason), or None: the first of
        pallas_triton (cuda), mosaic_tpu (tpu), cpu (cpu), xla (any platform) that can run the
        call, decided where it is lowered; ``explain_implementation`` says why.
      return_residual: also return the logsumexp ``[..., Lq, Hq]`` (float32, natural log,
        ``-inf`` for a row with no allowed key), as jax.nn does; differentiable.

    Additions:
      causal_alignment: "top_left" or "bottom_right" (the last valid query aligns with the last
        valid key, as FlashAttention-2 and KV-cache decoding; with lengths, per batch row).
      q_segment_ids: int ``[..., Lq]``; only equal ids attend (packed sequences).
      kv_segment_ids: int ``[..., Lk]``, compared with ``q_segment_ids``.
      logits_soft_cap: c > 0: logits become ``c * tanh(logits / c)`` before the bias is added.
      block_sizes: tile sizes (``BlockSizes``; with implementation="mosaic_gpu" a
        ``jax_impl.mosaic_gpu.Config``); None: per-device heuristics.
      precision: of float32 matmuls: a ``lax.Precision`` or its name in any case ("highest",
        jnp.dot's aliases; default HIGHEST: full fp32, never silent TF32) or, for float32
        inputs, one of ``PRECISION_PRESETS`` (or its name)
        (``lax.DotAlgorithmPreset``: TF32_TF32_F32_X3 is 3xTF32 on the tensor cores; TF32
        presets and BF16_BF16_F32_X9 run only on a CUDA GPU).
      interpret: run the Pallas kernel in the Pallas interpreter (any device; slow; for tests;
        with implementation="mosaic_gpu" the Mosaic GPU interpreter, jax >= 0.11).
      attention_sinks: float, broadcastable to ``[..., Hq]``: one learnable logit per head that
        joins every row's softmax denominator and carries no value (gpt-oss); differentiable.
        It enters the logsumexp; a row with no allowed key gives output 0.
      context_parallel_strategy: for inputs whose sequence is sharded over a mesh axis, under
        ``jit``: "ring", "all_to_all" (Ulysses: heads resharded), "hybrid" (a sequence over two
        mesh axes) or "all_gather"; None lets the cost model (``cp_cost.py``) pick by bytes
        moved per device. ``explain_implementation(...).strategy`` names the choice and its
        estimates; an unavailable choice is refused.

    Flax keywords:
      dropout_rate: attention dropout as Flax means it: active when ``dropout_rate > 0`` and
        not ``deterministic``; P is dropped with a pattern hashed from the key and (batch, head,
        query, key) indices, the same in every implementation, and kept values are scaled by
        ``1 / (1 - dropout_rate)``. ``jax_impl.dropout_mask`` materialises the pattern.
      dropout_rng: the key of that hash; required when dropout is active.
      broadcast_dropout: share one ``[Lq, Lk]`` pattern across batch and heads (Flax's default).
      deterministic: True switches dropout off; None (a direct call): as Flax's
        ``dot_product_attention``, not deterministic. When given (Flax's modules always give
        it), a non-bool mask is read as Flax reads it (nonzero = may attend); a direct call
        with a float mask is refused, so an additive mask is never misread.
      dtype: cast query, key and value to this dtype first.
      module: refused (NotImplementedError): the weights never exist, so they cannot be sown;
        call the Flax module with ``sow_weights=False``.
      force_fp32_for_softmax: accepted and always true here (the softmax is float32).
      qk_attn_weights_einsum: refused (NotImplementedError): no custom einsum runs inside the
        fused kernel.
      attn_weights_value_einsum: refused likewise.

    Programmable attention:
      score_mod: ``score_mod(score, b, h, q_idx, kv_idx, *mod_aux) -> score``, applied to the
        logits after the scale, the soft cap and the bias (PyTorch FlexAttention's model;
        ``jax_impl.mods``). Written elementwise: ``score`` is
        float32 and the int32 indices (flat batch row b, query head h, query and key position)
        are arrays that broadcast against it (a tile's, or the whole ``[B, Hq, Lq, Lk]``), so
        plain ``jnp`` indexing of ``mod_aux`` works (``score - slopes[h] * abs(q_idx - kv_idx)``);
        index with them, never reshape them.
      mask_mod: ``mask_mod(b, h, q_idx, kv_idx, *mod_aux) -> bool``, True = may attend, ANDed
        with every other mask argument.
      mod_aux: a tuple of the arrays the mods read; floating ones are differentiable (their
        gradient is summed tile by tile in a fixed order: repeatable bit for bit).
      block_mask: a ``BlockMask`` (``create_block_mask``), ``[B|1, Hq|1]`` tiles of the call's
        (Lq, Lk), per batch row and head: a pair in an empty tile is excluded, in a full tile
        allowed (mask_mod is not consulted there), in a partial tile as mask_mod says (FlexAttention's
        meaning). Any tile sizes work on every implementation (each reads the block_mask on its
        own tiles; mosaic_tpu needs tiles that are multiples of 128 and, with a mask_mod, a
        block_mask made from it by create_block_mask). Without a block_mask mask_mod is
        evaluated on every tile the other rules leave. Segment ids, causal, windows and lengths
        need none: their empty tiles are skipped from per-tile bounds. A block_mask with
        partial tiles needs its mask_mod.

        Where mods run: in every implementation's kernels. The fused C++ kernel (cpu) runs them
        as compiled programs and refuses, by name, what those cannot express (the automatic
        choice then runs xla); mosaic_tpu takes mods without mod_aux. A mod may close over
        concrete arrays (constants, read as mod_aux is); one that closes over a traced array is
        refused. Reads of mod_aux past an array's end clamp, forward and gradient alike; the
        gradient of mod_aux sums the allowed pairs only.

    Paged KV cache:
      page_table: int ``[..., pages_per_sequence]`` (inference, forward only); key and value
        are then pages ``[num_pages, page_size, Hkv, D]`` shared by the batch: logical key j of
        a batch row is slot ``j % page_size`` of page ``page_table[..., j // page_size]``
        (logical Lk = pages_per_sequence * page_size). key_value_seq_lengths (default: the whole
        table) says how many keys each row holds. Ids follow ``arguments.page_ids``, as
        ``kv_cache.gather`` and ``append`` do: concrete ids outside [0, num_pages) raise;
        traced ones are clamped (never read out of bounds), so a gather then a dense call gives
        this call's answer. Runs on the decode path (xla, or an implementation with one); takes
        lengths, causal, windows, soft cap and sinks, not bias, mask, segment ids or dropout;
        not differentiable. ``jax_impl.kv_cache`` writes pages.

    Returns:
      The output ``[..., Lq, Hq, D]`` in the input dtype; with ``return_residual=True`` the
      pair (output, logsumexp).

    Few query rows (<= 16) against a long cache (>= 512 keys) run on the implementation's
    decode path when it has one (split over the keys; ``explain_implementation(...).path``).

    A query row with no allowed key gives output 0, logsumexp -inf and zero gradients.
    Derivatives are reverse mode (a custom VJP); forward mode (``jax.jvp``, ``jax.jacfwd``)
    and higher orders run with implementation="reference" only, and elsewhere raise saying so.
    """
    call = arguments.validate(**locals())
    _refuse_requested(call)
    if call.cfg.context_parallel_strategy is not None and call.page_table is None:
        # A refused strategy raises here where q's sharding is known (a sharded array, a mesh
        # with explicit axes), not from inside XLA's partitioner when the program compiles.
        _strategy(query, call, call.implementation or implementations.automatic(
            _reasons(jax.default_backend(), call.features(), call.page_table, call.k)))
    refusal = (recompute_vjp.PAGED_GRADIENT_ERROR if call.page_table is not None
               else recompute_vjp.FORWARD_MODE_ERROR)
    out, lse = recompute_vjp.naming_forward_mode(_dispatch, refusal)(call)
    return call.to_user(out, lse, return_residual)


# --- Dispatch ------------------------------------------------------------------------------

def _dispatch(call: arguments.Call):
    if call.q.shape[0] == 0:  # an empty batch: an empty result, as jax.nn gives
        return (jnp.zeros(call.q.shape, call.q.dtype),
                jnp.full((0, call.q.shape[2], call.q.shape[1]), -jnp.inf, jnp.float32))
    return _attention(call.q, call.k, call.v, call.bias, call.masks, call.extras, call.page_table,
                      implementation=call.implementation, cfg=call.cfg)


def _refuse_requested(call: arguments.Call) -> None:
    """A named implementation that cannot run the call raises here, with the table's reason
    (the platform is judged where the call is lowered)."""
    if call.implementation is None:
        return
    implementation = implementations.get(call.implementation)
    reason = implementation.unsupported(call.features())
    if reason:
        raise ValueError(f"implementation={call.implementation!r} cannot run this call: {reason}")
    if call.page_table is not None:
        reason = implementations.paged_unsupported(implementation, **_paged(call.features(), call.k))
        if reason:
            raise ValueError(f"implementation={call.implementation!r} cannot take page_table: "
                             f"{reason}")


# Jitted so that an eager call compiles once per shape and configuration, not on every call.
@functools.partial(jax.jit, static_argnames=("implementation", "cfg"))
def _attention(q, k, v, bias, masks, extras, page_table, *, implementation, cfg):
    paged = page_table is not None
    lk = page_table.shape[1] * k.shape[1] if paged else k.shape[1]
    features = CallFeatures.of(cfg, q, k, bias, masks, extras, lk=lk, paged=paged)

    def run(name):
        decode = implementations.decode_path(implementations.get(name), lq=q.shape[1], lk=lk,
                                             features=features, paged=paged) is None
        return lambda *args: _run(name, dataclasses.replace(cfg, decode=decode), *args)

    if implementation is not None:
        return run(implementation)(q, k, v, bias, masks, extras, page_table)
    choose = lambda platform: implementations.automatic(_reasons(platform, features, page_table, k))
    return implementations.on_lowering_platform(choose, run, q, k, v, bias, masks, extras,
                                                page_table)


def _paged(features: CallFeatures, pages) -> dict:
    """``implementations.paged_unsupported``'s arguments for a paged call."""
    return dict(lq=features.lq, dtype=pages.dtype, page_size=pages.shape[1],
                head_dim=features.head_dim)


def _reasons(platform, features: CallFeatures, page_table, k) -> dict:
    """implementations.reasons for a call (``k`` the pages of a paged call)."""
    return implementations.reasons(platform, features,
                                   paged=None if page_table is None else _paged(features, k))


def _strategy(query, call, chosen: str) -> str | None:
    """How sharded inputs run (partitioned.explain); a refused context_parallel_strategy raises."""
    return partitioned.explain(
        implementations.get(chosen), query, call.q.shape, call.k.shape,
        {n: x for n, x in (("bias", call.bias), ("mask", call.masks.mask)) if x is not None},
        cfg=call.cfg, extras=call.extras)


def with_evaluated_block_mask(implementation: str, cfg, q, k, masks, extras):
    """(cfg, masks) of a call with a mask_mod and no block_mask on a blocked path: with the
    BlockMask of the mask_mod evaluated chunk-wise (``block_mask.of_mask_mod``), so that its
    empty tiles are skipped. Other calls unchanged."""
    if (cfg.mask_mod is None or masks.block_mask is not None or cfg.decode
            or implementations.get(implementation).forward is None):
        return cfg, masks
    built = block_mask.of_mask_mod(cfg.mask_mod, q.shape[0], q.shape[2], q.shape[1], k.shape[1],
                                   extras.mod_aux)
    return (dataclasses.replace(cfg, mask=dataclasses.replace(cfg.mask, has_block_mask=True,
                                                              block_mask_of_mask_mod=True)),
            masks._replace(block_mask=built))


def _run(implementation, cfg, q, k, v, bias, masks, extras, page_table):
    q = arguments.gpu_only_precision_guard(implementation, cfg, q)
    if page_table is None:
        cfg, masks = with_evaluated_block_mask(implementation, cfg, q, k, masks, extras)
    chosen = implementations.get(implementation)
    if page_table is not None:
        return recompute_vjp.paged_attention(chosen, cfg, q, k, v, masks, extras, page_table)
    if chosen.dense is not None:  # differentiated by autodiff
        return chosen.dense(cfg, q, k, v, bias, masks, extras)
    return recompute_vjp.attention(chosen, cfg, q, k, v, bias, masks, extras)


class ImplementationChoice(NamedTuple):
    """What ``explain_implementation`` returns.

    Attributes:
      chosen: the implementation ``flash_attention`` runs for the call.
      reasons: for every implementation, None if it could run the call, else why not.
      strategy: how sharded inputs run (local, ring, all-to-all, hybrid, gathered) and why;
        None for unsharded inputs.
      path: "decode" (few query rows against a long or paged cache, split over the keys) or
        "regular"; ``path_reason`` says why.
      path_reason: why that path.
      tiles: the tiles the regular forward computes (partial and full), "" where unknown.
    """
    chosen: str
    reasons: dict  # implementation -> None if eligible, else why not
    # How sharded inputs run (partitioned.explain): local / ring / gathered; None unsharded.
    strategy: str | None = None
    # Which path of the chosen implementation runs: "decode" (few query rows against a long
    # or paged cache: split over the keys) or "regular"; and why.
    path: str = "regular"
    path_reason: str = ""
    # The tiles its regular forward computes (implementations.tiles_visited), "" where unknown.
    tiles: str = ""


def explain_implementation(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                           bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                           platform: str | None = None,
                           implementation: str | None = None, interpret: bool = False,
                           **kwargs) -> ImplementationChoice:
    """Which implementation ``flash_attention`` would use for these arguments, and why not the others.

    ``platform`` defaults to ``jax.default_backend()``; pass "cuda" or "cpu" to ask about
    another. Arguments are validated exactly as ``flash_attention`` validates them; any
    argument of ``flash_attention`` may be passed.

    Returns:
      An ``ImplementationChoice``: the implementation chosen, why each other one was not, and
      for sharded inputs the collective strategy.
    """
    call = arguments.validate(query, key, value, bias, mask, implementation=implementation,
                              interpret=interpret, **kwargs)
    platform = platform or jax.default_backend()
    features = call.features()
    paged = call.page_table is not None
    reasons = _reasons(platform, features, call.page_table, call.k)

    def choice(chosen):
        impl = implementations.get(chosen)
        why_not = implementations.decode_path(impl, lq=features.lq, lk=features.lk,
                                              features=features, paged=paged)
        if why_not is not None:
            cfg, masks = with_evaluated_block_mask(chosen, call.cfg, call.q, call.k, call.masks,
                                                   call.extras)
            return ImplementationChoice(chosen, reasons, _strategy(query, call, chosen), "regular",
                                        why_not, implementations.tiles_visited(
                                            impl, cfg, call.q, call.k, masks))
        why = ("a paged KV cache runs on the decode path" if paged else
               f"{features.lq} query rows against {features.lk} keys, no bias, mask, segment ids "
               "or dropout")
        if impl.decode_note:
            why += f"; {impl.decode_note}"
        return ImplementationChoice(chosen, reasons, None if paged else _strategy(query, call, chosen),
                                    "decode", why)

    if call.implementation is not None:
        chosen = call.implementation
        if reasons[chosen] is not None:  # as flash_attention refuses it
            raise ValueError(f"implementation={chosen!r} cannot run this call on "
                             f"platform={platform!r}: {reasons[chosen]}")
        for name in reasons:
            if name != chosen and reasons[name] is None:
                reasons[name] = f"implementation={chosen!r} was requested"
        return choice(chosen)
    chosen = implementations.automatic(reasons)
    for name, impl in IMPLEMENTATIONS.items():
        if name == chosen or reasons[name] is not None:
            continue
        reasons[name] = (f"{chosen} is eligible and preferred" if impl.automatic else
                         f"never chosen automatically: {impl.manual_because}")
    return choice(chosen)


class _CallableModule(types.ModuleType):
    """This module calls ``flash_attention``, so ``jax_impl.flash_attention(q, k, v)`` works as
    users write it, while ``import jax_impl.flash_attention`` still names the module."""

    def __call__(self, *args, **kwargs):
        return flash_attention(*args, **kwargs)


__signature__ = inspect.signature(flash_attention)  # what inspect.signature(module) reports
sys.modules[__name__].__class__ = _CallableModule
