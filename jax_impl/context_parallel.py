"""``ring_attention``: flash_attention for a sequence split over a mesh axis, inside shard_map.

The arguments mean what they mean for ``flash_attention``, for the GLOBAL sequence: query,
key, value and the segment ids are this device's blocks (sequence axis sharded over
``axis_name``), lengths are global (``[batch...]``, replicated over ``axis_name``), and causal,
window and alignment refer to global positions. A bias or dense mask holds this device's query
rows and every key column (``[..., Hq|1, Lq_loc, Lk_global]``, columns in global key order).
``ring.py`` has the algorithm and the layouts.
"""
from __future__ import annotations

import dataclasses

from jax import lax

from jax_impl import arguments, implementations, masking, mods, ring, ulysses, vma
from jax_impl import block_mask as block_mask_lib
from jax_impl.call_features import CallFeatures


def ring_attention(query, key, value, bias=None, mask=None, *, axis_name,
                   scale: float | None = None,
                   is_causal: bool = False, causal_alignment: str = "top_left",
                   local_window_size=None, query_seq_lengths=None, key_value_seq_lengths=None,
                   q_segment_ids=None, kv_segment_ids=None, logits_soft_cap: float | None = None,
                   implementation: str | None = "xla", block_sizes=None, precision=None,
                   interpret: bool = False, layout: str = "zigzag",
                   attention_sinks=None, dropout_rng=None, dropout_rate: float = 0.0,
                   broadcast_dropout: bool = True, return_residual: bool = False,
                   score_mod=None, mask_mod=None, mod_aux=(), block_mask=None):
    """Exact attention over a sequence sharded along mesh axis ``axis_name`` (call inside
    ``jax.shard_map``). Forward and backward are rings of ``lax.ppermute`` steps.

    The arguments not listed here mean what they mean for ``flash_attention``, for the GLOBAL
    sequence.

    Args:
      layout: "zigzag" (device r holds global chunks r and 2N-1-r of 2N: balanced causal work;
        reorder global arrays with ``ring.to_zigzag`` before sharding) or "contiguous" (device r
        holds chunk r of N).
      implementation: the local kernel each ring step runs, one of ``implementations.ring_capable()``:
        "xla", "pallas_triton" (a CUDA GPU, or anywhere with interpret=True; the Pallas
        interpreter of jax 0.10 needs ``check_vma=False`` on the enclosing ``jax.shard_map``) or
        "cpu" (the fused C++ kernel on a CPU); None: flash_attention's automatic choice among
        these for the platform the call is lowered for.
      bias: broadcastable to ``[..., Hq, Lq_loc, Lk]`` where ``Lq_loc`` is this device's
        query rows (in the order of its query block, i.e. the layout's) and ``Lk`` is the GLOBAL
        key length, columns in global (natural) key order whatever the layout: shard it along
        the query rows only. It stays on its device; each ring step slices the columns of the
        visiting key chunk. Differentiable; its gradient has the same layout.
      mask: bool, in the bias's layout.
      query_seq_lengths: global, ``[batch...]``; concrete values outside
        [0, global length] are refused, traced ones clamped (as ``flash_attention``).
      key_value_seq_lengths: global, likewise.
      attention_sinks: as ``flash_attention`` (``[..., Hq]``, the same on every device): each
        query row's denominator takes them once, after the ring's merge; their gradient is the
        sum over the ring.
      dropout_rate: as ``flash_attention`` (with ``dropout_rng`` and ``broadcast_dropout``);
        every step hashes global (query, key) positions, so the pattern is the one-device
        call's, bit for bit (the batch index hashed is this device's: shard the batch outside
        and it is local). Needs an implementation that hashes at an offset, one of
        ``implementations.ring_dropout_capable()`` (not "cpu").

    Returns:
      ``[..., Lq_loc, Hq, D]``, and with return_residual the logsumexp ``[..., Lq_loc, Hq]``.
    """
    num_devices = _axis_size("axis_name", axis_name, "ring_attention")
    if layout not in ring.LAYOUTS:
        raise ValueError(f"{layout=} must be one of {ring.LAYOUTS}")
    if implementation not in implementations.ring_capable() + (None,):
        raise ValueError(f"{implementation=} must be one of {implementations.ring_capable()} or None "
                         "for ring_attention")
    call = arguments.validate(
        query, key, value, scale=scale, is_causal=is_causal, causal_alignment=causal_alignment,
        local_window_size=local_window_size, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, logits_soft_cap=logits_soft_cap,
        implementation=implementation, block_sizes=block_sizes, precision=precision,
        interpret=interpret, attention_sinks=attention_sinks, dropout_rng=dropout_rng,
        dropout_rate=dropout_rate, broadcast_dropout=broadcast_dropout, score_mod=score_mod,
        mask_mod=mask_mod, mod_aux=mod_aux)
    if call.cfg.interpret and vma.axes_of(call.q, call.k, call.v):
        raise ValueError("implementation='pallas_triton' with interpret=True inside jax.shard_map "
                         "needs check_vma=False on the shard_map (the Pallas interpreter mixes "
                         "varying and unvarying values); the compiled GPU kernel does not")
    chunks = 2 if layout == "zigzag" else 1
    lq, lk = call.q.shape[1], call.k.shape[1]
    for name, length in (("query", lq), ("key", lk)):
        if length % chunks:
            raise ValueError(f"{name}'s local sequence length {length} must be even for "
                             "layout='zigzag' (two chunks per device)")
    spec, masks = _global_masks(call, query_seq_lengths, key_value_seq_lengths,
                                num_devices * lq, num_devices * lk, block_mask,
                                (lq // chunks, lk // chunks))
    spec = dataclasses.replace(spec, bottom_right=False)  # the ring passes the alignment itself
    bias, mask = (_rows_local(name, x, call.batch_shape + (call.q.shape[2], lq, num_devices * lk))
                  for name, x in (("bias", bias), ("mask", mask)))
    masks = masks._replace(mask=mask)

    def run(name):
        chosen = implementations.get(name)
        _refuse_pairwise(chosen, call, bias, masks, "this ring")
        _refuse_local_dropout(chosen, call.cfg, "a ring")
        description = ring.Ring(axis_name, num_devices, layout, chosen,
                                dataclasses.replace(call.cfg, mask=spec), call.cfg.mask.bottom_right)
        return lambda q, *args: ring.ring_vjp(
            description, arguments.gpu_only_precision_guard(name, description.cfg, q), *args)

    out, lse = _local_kernel(call, _ring_kernels(call.cfg), run, bias, masks)
    return call.to_user(out, lse, return_residual)


def _ring_kernels(cfg) -> tuple[str, ...]:
    """The implementations a ring's local step can be (with dropout: those hashing global positions)."""
    return implementations.ring_dropout_capable() if cfg.dropout_rate else implementations.ring_capable()


def _local_kernel(call, among, run, bias, masks):
    """``run(name)(q, k, v, bias, masks, extras)`` with the implementation requested, or for
    None the one flash_attention chooses automatically, among those the strategy can use
    (``among``), decided where the call is lowered."""
    args = (call.q, call.k, call.v, bias, masks, call.extras)
    # Judged as the local kernel runs them: a strategy's mods see global indices (mods.at_offset).
    features = CallFeatures.of(mods.at_offset(call.cfg), call.q, call.k, bias, masks,
                               call.extras._replace(mod_aux=mods.offset_aux(call.extras.mod_aux)
                                                    if call.cfg.has_mods else ()))
    if call.implementation is not None:
        reason = implementations.unsupported(call.implementation, features)
        if reason:
            raise ValueError(f"implementation={call.implementation!r} cannot run this call's "
                             f"local steps: {reason}")
        return run(call.implementation)(*args)
    choose = lambda platform: implementations.automatic(
        implementations.reasons(platform, features), among)
    return implementations.on_lowering_platform(choose, run, *args)


def _refuse_local_dropout(chosen, cfg, where):
    if cfg.dropout_rate and not chosen.takes_dropout_offset:
        raise ValueError(f"implementation={chosen.name!r} cannot run dropout in {where}: its "
                         "kernels hash local positions; use one that hashes the ring's global "
                         f"positions: {implementations.ring_dropout_capable()}")


def _refuse_pairwise(chosen, call, bias, masks, what):
    """arguments.validate saw no bias or mask (they are per-device here): the kernel must take them."""
    if bias is None and masks.mask is None:
        return
    reason = chosen.unsupported(CallFeatures.of(call.cfg, call.q, call.k, bias, masks, call.extras))
    if reason:
        raise ValueError(f"implementation={chosen.name!r} cannot run {what}: {reason}")


def _rows_local(name, x, shape, function="ring_attention"):
    """A bias/mask -> ``[Bx, Hx, Lq_loc, Lk]`` (arguments.pairwise), with the layout rule named."""
    try:
        return arguments.pairwise(name, x, shape, is_mask=name == "mask")
    except ValueError as err:
        raise ValueError(f"{err}; in {function} {name} holds this device's {shape[-2]} query "
                         f"rows and all {shape[-1]} key columns (the global key length)") from None


def _axis_size(name, axis, function) -> int:
    """The size of mesh axis ``axis`` (the argument ``name``), or an error saying where to call
    ``function``."""
    try:
        return lax.axis_size(axis)
    except (NameError, KeyError, ValueError) as err:
        raise ValueError(f"{name}={axis!r} is not a mesh axis bound here: call {function} "
                         "inside jax.shard_map over a mesh with that axis") from err


def _global_masks(call, query_seq_lengths, key_value_seq_lengths, global_lq: int, global_lk: int,
                  block_mask=None, ring_chunks: tuple[int, int] | None = None):
    """(mask spec, mask inputs) with the lengths and the block_mask judged against the GLOBAL
    sequence lengths; a ring's ``(query, key) chunk sizes``, which the block_mask's tiles must
    divide (each step cuts its chunk pair's tiles)."""
    block_mask = arguments.checked_block_mask(
        block_mask, call.cfg.mask_mod, batch=call.q.shape[0], heads=call.q.shape[2],
        q_len=global_lq, kv_len=global_lk)
    if ring_chunks is not None and (why := ring.block_mask_unfit(block_mask, *ring_chunks)):
        raise ValueError(f"block_mask: {why}")
    spec = dataclasses.replace(call.cfg.mask, has_q_lengths=query_seq_lengths is not None,
                               has_kv_lengths=key_value_seq_lengths is not None,
                               has_block_mask=block_mask is not None,
                               block_mask_of_mask_mod=block_mask_lib.made_from(
                                   block_mask, mods.origin(call.cfg.mask_mod)))
    masks = call.masks._replace(
        q_len=_global_lengths("query_seq_lengths", query_seq_lengths, call.batch_shape, global_lq),
        kv_len=_global_lengths("key_value_seq_lengths", key_value_seq_lengths, call.batch_shape,
                               global_lk),
        block_mask=block_mask)
    return spec, masks


def _global_lengths(name, lengths, batch_shape, global_len: int):
    """masking.lengths against the GLOBAL length: concrete values outside [0, global_len] are
    refused, traced ones clamped."""
    try:
        return masking.lengths(name, lengths, batch_shape, global_len)
    except ValueError as err:
        raise ValueError(f"{err} (in ring_attention lengths are global, the same on every device "
                         f"of the ring: at most the global sequence length {global_len})") from None


def ulysses_attention(query, key, value, bias=None, mask=None, *, axis_name,
                      scale: float | None = None,
                      is_causal: bool = False, causal_alignment: str = "top_left",
                      local_window_size=None, query_seq_lengths=None, key_value_seq_lengths=None,
                      q_segment_ids=None, kv_segment_ids=None, logits_soft_cap: float | None = None,
                      implementation: str | None = "xla", block_sizes=None, precision=None,
                      attention_sinks=None, dropout_rng=None, dropout_rate: float = 0.0,
                      broadcast_dropout: bool = True, return_residual: bool = False,
                      score_mod=None, mask_mod=None, mod_aux=(), block_mask=None):
    """Exact attention over a sequence sharded along ``axis_name`` (call inside
    ``jax.shard_map``) by all-to-all (DeepSpeed-Ulysses, ``ulysses.py``): each device gets the
    whole sequence for ``1/N`` of the heads, runs ``implementation`` there, and the output goes
    back to sequence blocks. Device r holds chunk r of N (the natural, contiguous layout).

    The arguments mean what they mean for ``flash_attention`` for the GLOBAL sequence, as in
    ``ring_attention``; lengths are global. Query and kv heads must divide the axis size (kv
    heads travel with their query groups). ``bias``/``mask``: as ``ring_attention``'s (this
    device's query rows, every key column, ``[..., Hq, Lq_loc, Lk]``) but with one slice per
    query head (one shared by every head is refused: ``ring_attention`` takes it); resharded by
    head with q, k, v, dbias back in the same layout.
    Dropout and sinks hash and apply by global head index: the pattern is the one-device call's.
    score_mod, mask_mod, mod_aux, block_mask: as ``ring_attention``'s (global head and sequence
    indices; a per-head block_mask is cut to the device's heads).
    Returns ``[..., Lq_loc, Hq, D]`` (and with return_residual the logsumexp ``[..., Lq_loc, Hq]``).
    """
    num_devices = _axis_size("axis_name", axis_name, "ulysses_attention")
    if implementation not in implementations.blocked() + (None,):
        raise ValueError(f"{implementation=} must be one of {implementations.blocked()} or None "
                         "for ulysses_attention (it runs a blocked forward)")
    call = arguments.validate(
        query, key, value, scale=scale, is_causal=is_causal, causal_alignment=causal_alignment,
        local_window_size=local_window_size, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, logits_soft_cap=logits_soft_cap,
        implementation=implementation, block_sizes=block_sizes, precision=precision,
        attention_sinks=attention_sinks, dropout_rng=dropout_rng, dropout_rate=dropout_rate,
        broadcast_dropout=broadcast_dropout, score_mod=score_mod, mask_mod=mask_mod,
        mod_aux=mod_aux)
    lq, lk = call.q.shape[1], call.k.shape[1]
    bias, mask = (_rows_local(name, x, call.batch_shape + (call.q.shape[2], lq, num_devices * lk),
                              "ulysses_attention") for name, x in (("bias", bias), ("mask", mask)))
    shared = any(x is not None and x.shape[1] != call.q.shape[2] for x in (bias, mask))
    reason = ulysses.unavailable(num_devices, call.q.shape[2], call.k.shape[2], shared)
    if reason:
        raise ValueError(f"ulysses_attention over {axis_name!r}: {reason}; use ring_attention")
    spec, masks = _global_masks(call, query_seq_lengths, key_value_seq_lengths,
                                num_devices * lq, num_devices * lk, block_mask)
    masks = masks._replace(mask=mask)

    def run(name):
        chosen = implementations.get(name)
        _refuse_pairwise(chosen, call, bias, masks, "this call")
        description = ulysses.Ulysses(axis_name, num_devices, chosen,
                                      dataclasses.replace(call.cfg, mask=spec))
        return lambda q, *args: ulysses.ulysses_vjp(
            description, arguments.gpu_only_precision_guard(name, description.cfg, q), *args)

    out, lse = _local_kernel(call, implementations.blocked(), run, bias, masks)
    return call.to_user(out, lse, return_residual)


def hybrid_attention(query, key, value, *, all_to_all_axis, ring_axis,
                     scale: float | None = None, is_causal: bool = False,
                     causal_alignment: str = "top_left", local_window_size=None,
                     query_seq_lengths=None, key_value_seq_lengths=None, q_segment_ids=None,
                     kv_segment_ids=None, logits_soft_cap: float | None = None,
                     implementation: str | None = "xla", block_sizes=None, precision=None,
                     attention_sinks=None, dropout_rng=None, dropout_rate: float = 0.0,
                     broadcast_dropout: bool = True, return_residual: bool = False,
                     score_mod=None, mask_mod=None, mod_aux=(), block_mask=None):
    """Exact attention over a sequence sharded over two mesh axes (call inside
    ``jax.shard_map`` with the sequence spec ``P(..., (ring_axis, all_to_all_axis))``): the
    hybrid ("USP") that plain jit runs for such a sequence. Device (o, i) holds block
    ``o * |all_to_all_axis| + i`` of the sequence (the natural layout, no reordering). An
    all-to-all over ``all_to_all_axis`` (fast links, inside a host) gives each device block o
    of ``|ring_axis|`` for ``1/|all_to_all_axis|`` of the heads; a zigzag ring over
    ``ring_axis`` (slow links, across hosts) runs ``implementation`` on it; one more
    all-to-all gives the sequence blocks back.

    The arguments mean what they mean for ``flash_attention`` for the GLOBAL sequence, as in
    ``ring_attention``; lengths are global. Query and kv heads must divide the size of
    ``all_to_all_axis`` (kv heads travel with their query groups, as in ``ulysses_attention``);
    the global sequence must divide into ``2 * |ring_axis|`` chunks (the zigzag ring);
    ``implementation`` is one of ``implementations.ring_capable()`` (with dropout, of
    ``implementations.ring_dropout_capable()``).
    No bias or dense mask (use ``ring_attention`` over one axis). score_mod, mask_mod, mod_aux,
    block_mask: as ``ring_attention``'s (the block_mask's tiles divide the ring's chunks of
    ``L / (2 |ring_axis|)``). Returns ``[..., Lq_loc, Hq, D]``
    (and with return_residual the logsumexp ``[..., Lq_loc, Hq]``).
    """
    if all_to_all_axis == ring_axis:
        raise ValueError(f"all_to_all_axis and ring_axis must be two different mesh axes (both "
                         f"{ring_axis!r}); for one axis use ring_attention or ulysses_attention")
    inner = _axis_size("all_to_all_axis", all_to_all_axis, "hybrid_attention")
    outer = _axis_size("ring_axis", ring_axis, "hybrid_attention")
    if implementation not in implementations.ring_capable() + (None,):
        raise ValueError(f"{implementation=} must be one of {implementations.ring_capable()} "
                         "or None for hybrid_attention (its ring step takes position offsets)")
    call = arguments.validate(
        query, key, value, scale=scale, is_causal=is_causal, causal_alignment=causal_alignment,
        local_window_size=local_window_size, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, logits_soft_cap=logits_soft_cap,
        implementation=implementation, block_sizes=block_sizes, precision=precision,
        attention_sinks=attention_sinks, dropout_rng=dropout_rng, dropout_rate=dropout_rate,
        broadcast_dropout=broadcast_dropout, score_mod=score_mod, mask_mod=mask_mod,
        mod_aux=mod_aux)
    reason = ulysses.unavailable(inner, call.q.shape[2], call.k.shape[2], False)
    if reason:
        raise ValueError(f"hybrid_attention's all-to-all over {all_to_all_axis!r}: {reason}; "
                         "use ring_attention")
    lq, lk = (inner * outer * x.shape[1] for x in (call.q, call.k))
    for name, length in (("query", lq), ("key", lk)):
        if length % (2 * outer):
            raise ValueError(f"{name}'s global sequence length {length} must divide into "
                             f"2 * {outer} chunks (the zigzag ring over {ring_axis!r})")
    spec, masks = _global_masks(call, query_seq_lengths, key_value_seq_lengths, lq, lk,
                                block_mask, (lq // (2 * outer), lk // (2 * outer)))
    cfg = dataclasses.replace(call.cfg, mask=spec)

    def run(name):
        chosen = implementations.get(name)
        _refuse_local_dropout(chosen, cfg, "the hybrid's ring")
        description = ulysses.Hybrid(ulysses.Ulysses(all_to_all_axis, inner, chosen, cfg),
                                     ring.zigzag_ring(cfg, ring_axis, outer, chosen))
        return lambda q, *args: ulysses.ulysses_vjp(
            description, arguments.gpu_only_precision_guard(name, cfg, q), *args)

    out, lse = _local_kernel(call, _ring_kernels(cfg), run, None, masks)
    return call.to_user(out, lse, return_residual)
