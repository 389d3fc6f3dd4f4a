"""JAX implementations: jax_impl's, dense JAX, jax.nn, JAX's Pallas ``mha`` (Triton) and Hopper
attention (Mosaic GPU), and tokamax."""
from __future__ import annotations

import dataclasses
import functools

from conformance import mods as mods_mod
from conformance.adapters.base import Adapter, JaxFunctionAdapter
from conformance.cases import Case
from conformance.runs import JaxPrepared, NotSupported


def _jax_impl_unsupported(implementation: str, case: Case, device: str,
                          interpret: bool) -> str | None:
    """jax_impl's own eligibility rule (its implementation table, cuDNN included) for the
    case's features, on the harness's device (``interpret``: the Pallas kernel interpreted)."""
    import jax
    import numpy as np
    from jax_impl.call_features import CallFeatures
    from jax_impl.config import AttentionConfig
    from jax_impl.implementations import unsupported
    from jax_impl.masking import MaskSpec
    score_mod, mask_mod = jax_mods(mods_mod.get(case.mods)) if case.mods else (None, None)
    window = case.window or (None, None)
    spec = MaskSpec(is_causal=case.causal is not None, bottom_right=case.causal == "bottom_right",
                    window_left=window[0], window_right=window[1], has_q_lengths=case.lengths,
                    has_kv_lengths=case.lengths, has_block_mask=bool(case.block_size),
                    block_mask_of_mask_mod=bool(case.block_size))
    cfg = AttentionConfig(scale=1.0, mask=spec, logits_soft_cap=case.soft_cap,
                          dropout_rate=case.dropout, interpret=interpret, score_mod=score_mod,
                          mask_mod=mask_mod)
    mod_aux = (tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in
                     mods_mod.get(case.mods).aux(np.random.default_rng(0), case).values())
               if case.mods else ())
    block = (case.block_size, case.block_size) if case.block_size else None
    features = CallFeatures(cfg, case.head_dim, np.dtype(case.np_dtype), 1, case.q_len,
                            case.kv_len, case.bias, case.mask != "none", case.sinks,
                            case.segments, mod_aux, block, bool(case.page_size))
    return unsupported(implementation, features, device)


@dataclasses.dataclass(frozen=True)
class JaxImplAdapter(Adapter):
    """``jax_impl.flash_attention`` with one implementation forced."""

    implementation: str = "xla"
    extras_ok = True  # takes attention sinks and hashed dropout (Inputs.dropout_key)
    paged_ok = True
    mods_ok = True

    @property
    def interpret(self) -> bool:
        from jax_impl.implementations import get
        return get(self.implementation).has_interpreter and self.device == "cpu"

    def _reason(self, case):
        if case.page_size:
            from jax_impl.implementations import get, paged_unsupported
            reason = paged_unsupported(get(self.implementation), lq=case.q_len, dtype=case.dtype,
                                       page_size=case.page_size, head_dim=case.head_dim)
            if reason:
                return reason
        reason = _jax_impl_unsupported(self.implementation, case, self.device, self.interpret)
        if reason is None and self.interpret and not case.interpret_ok:
            reason = "too large for the Pallas interpreter on CPU (runs on a GPU)"
        return reason

    def _prepare(self, inputs, *, backward):
        from jax_impl.flash_attention import flash_attention
        extra = {"implementation": self.implementation}
        if self.interpret:
            extra["interpret"] = True
        if inputs.case.dropout:
            extra.update(dropout_rng=inputs.dropout_key(), broadcast_dropout=False, deterministic=False)

        def attn(q, k, v, bias, mask, **kw):
            if inputs.case.page_size:
                k, v, kw = _paged(inputs.case, k, v, kw)
            if inputs.mods is not None:
                kw = _with_mods(inputs, kw)
            return flash_attention(q, k, v, bias, mask, **extra, **kw)
        return JaxPrepared(attn, inputs, backward=backward, device=self.device,
                           info={"interpret": self.interpret})


def jax_mods(mods):
    """The case's (score_mod, mask_mod) with ``jax.numpy`` as their namespace (None where absent)."""
    import jax.numpy as jnp
    return tuple(None if fn is None else mods_mod.bound(fn, jnp) for fn in (mods.score_mod, mods.mask_mod))


def _with_mods(inputs, kw):
    """flash_attention's keywords with the case's mods (``kw`` holds ``mod_aux``), and with
    ``Case.block_size`` the block mask ``create_block_mask`` makes of the mask_mod."""
    import jax_impl
    c = inputs.case
    score_mod, mask_mod = jax_mods(inputs.mods)
    kw = dict(kw, score_mod=score_mod, mask_mod=mask_mod)
    if c.block_size:
        kw["block_mask"] = jax_impl.create_block_mask(mask_mod, c.batch, c.q_heads, c.q_len, c.kv_len,
                                                      block_size=c.block_size, mod_aux=kw.get("mod_aux", ()))
    return kw


def _paged(case: Case, k, v, kw):
    """The same keys as pages of ``case.page_size`` in a shuffled order (a seeded page table),
    with the key lengths given (default: the dense Lk, so that the last page's padding takes no
    part). -> (k_pages, v_pages, keywords with page_table)."""
    import jax.numpy as jnp
    import numpy as np
    b, lk = k.shape[:2]
    size = case.page_size
    per_sequence = -(-lk // size)
    num_pages = b * per_sequence + 3  # spare pages nobody reads
    table = np.random.default_rng(case.seed).permutation(num_pages)[:b * per_sequence]
    table = table.reshape(b, per_sequence).astype(np.int32)

    def pages(x):
        # NaN in the last page's slots past Lk and in the pages nobody's table holds: read but
        # not attended (slots), or not read at all (pages), they must not reach the output.
        x = jnp.pad(x, ((0, 0), (0, per_sequence * size - lk), (0, 0), (0, 0)), constant_values=jnp.nan)
        pool = jnp.full((num_pages, size) + x.shape[2:], jnp.nan, x.dtype)
        return pool.at[table.reshape(-1)].set(x.reshape((b * per_sequence, size) + x.shape[2:]))

    kw = dict(kw, page_table=jnp.asarray(table))
    kw.setdefault("key_value_seq_lengths", jnp.full((b,), lk, jnp.int32))
    return pages(k), pages(v), kw


@dataclasses.dataclass(frozen=True)
class JaxDenseAdapter(Adapter):
    """Plain dense JAX attention as anyone would write it: logits in fp32 (preferred element
    type), softmax over the allowed pattern, probabilities cast to the input dtype."""

    explicit_scale = "written here with 1/sqrt(D)"

    def _prepare(self, inputs, *, backward):
        import jax
        import jax.numpy as jnp
        c = inputs.case
        allowed = inputs.allowed()  # [B, 1|Hq, Lq, Lk]
        group = c.q_heads // c.kv_heads
        scale, cap = c.effective_scale, c.soft_cap

        def attn(q, k, v, bias, mask, **_):
            kk, vv = (jnp.repeat(x, group, axis=2) for x in (k, v))
            s = jnp.einsum("bqhd,bkhd->bhqk", q, kk, preferred_element_type=jnp.float32,
                           precision=jax.lax.Precision.HIGHEST) * scale
            if cap is not None:
                s = cap * jnp.tanh(s / cap)
            if bias is not None:
                s = s + bias.astype(jnp.float32)
            s = jnp.where(allowed, s, -jnp.inf)
            row_ok = allowed.any(-1, keepdims=True)
            p = jax.nn.softmax(jnp.where(row_ok, s, 0.0), axis=-1)
            p = jnp.where(row_ok, p, 0.0).astype(q.dtype)
            out = jnp.einsum("bhqk,bkhd->bqhd", p, vv, preferred_element_type=jnp.float32,
                             precision=jax.lax.Precision.HIGHEST)
            return out.astype(q.dtype)
        return JaxPrepared(attn, inputs, backward=backward, device=self.device)


def jax_nn_reason(adapter, case: Case) -> str | None:
    if case.segments:
        return "jax.nn has no segment ids"
    if case.soft_cap is not None:
        return "jax.nn has no logits soft cap"
    if case.causal == "bottom_right" and (case.q_len != case.kv_len or case.lengths):
        return "jax.nn's is_causal is top-left only (no bottom-right alignment)"
    if case.window is not None and case.causal == "bottom_right":
        return "jax.nn's window is measured from the top-left diagonal only"
    if dict(adapter.fixed_kwargs).get("implementation") == "cudnn" and case.dtype == "float32":
        return "jax.nn cuDNN attention takes fp16/bf16 only"
    return None


def jax_nn_attention(q, k, v, bias=None, mask=None, *, local_window_size=None, **kw):
    import jax
    if local_window_size is not None:  # jax.nn takes ints; None = unbounded
        big = q.shape[-3] + k.shape[-3]
        kw["local_window_size"] = tuple(big if s is None else int(s) for s in local_window_size)
    return jax.nn.dot_product_attention(q, k, v, bias, mask, **kw)


def _prepared_or_not_supported(library: str, prepare):
    """``prepare()``; a peer library's own refusal (any exception) becomes NotSupported naming it."""
    try:
        return prepare()
    except NotSupported:
        raise
    except Exception as e:
        raise NotSupported(f"{library}: {type(e).__name__}: {str(e)[:300]}") from e


@dataclasses.dataclass(frozen=True)
class JaxNNAdapter(JaxFunctionAdapter):
    def _prepare(self, inputs, *, backward):
        prepare = functools.partial(super()._prepare, inputs, backward=backward)
        if dict(self.fixed_kwargs).get("implementation") == "cudnn":  # cuDNN's own constraint checks
            return _prepared_or_not_supported("jax.nn cuDNN", prepare)
        return prepare()


@dataclasses.dataclass(frozen=True)
class PallasMhaAdapter(Adapter):
    """jax.experimental.pallas.ops.gpu.attention.mha: GPU only, [B, L, H, D], no GQA, no mask."""

    explicit_scale = "mha's own default sm_scale is 1.0; the adapter passes 1/sqrt(D)"

    def _reason(self, case):
        if case.q_heads != case.kv_heads:
            return "Pallas mha has no GQA/MQA (kv heads must equal q heads)"
        if case.mask != "none" or case.bias or case.lengths or case.window or case.soft_cap:
            return "Pallas mha has no mask, bias, lengths, window or soft cap"
        if case.segments and case.q_len != case.kv_len:
            return "Pallas mha takes one segment_ids array (needs Lq == Lk)"
        if case.causal == "bottom_right" and case.q_len != case.kv_len:
            return "Pallas mha's causal is top-left only"
        for n in (case.q_len, case.kv_len):
            if n % 128 and (n > 128 or n & (n - 1) or n < 16):
                return f"Pallas mha needs lengths that are multiples of its block (128), got {n}"
        if case.head_dim > 256:
            return "Pallas mha head_dim > 256"
        return None

    def _prepare(self, inputs, *, backward):
        from jax.experimental.pallas.ops.gpu.attention import mha
        c = inputs.case

        def attn(q, k, v, bias, mask, *, q_segment_ids=None, **_):
            # sm_scale passed explicitly: mha's default is 1.0, not 1/sqrt(D)
            return mha(q, k, v, q_segment_ids, sm_scale=c.effective_scale, causal=c.causal is not None)
        return _prepared_or_not_supported(
            "Pallas mha", lambda: JaxPrepared(attn, inputs, backward=backward, device=self.device))


@dataclasses.dataclass(frozen=True)
class MosaicMhaAdapter(Adapter):
    """jax.experimental.pallas.ops.gpu.attention_mgpu.attention: JAX's Hopper kernel (Mosaic GPU,
    wgmma + TMA, warp-specialized), [B, L, H, D], 16-bit, D % 64 == 0; no backward when causal."""

    explicit_scale = "the kernel applies no scale: the adapter multiplies q by 1/sqrt(D) first"
    tiles = dict(block_q=64, block_kv=128, max_concurrent_steps=2,
                 block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)

    def _reason(self, case):
        if case.dtype not in ("float16", "bfloat16"):
            return "Mosaic GPU attention takes fp16/bf16 only"
        if case.mask != "none" or case.bias or case.lengths or case.window or case.soft_cap \
                or case.segments:
            return "Mosaic GPU attention has no mask, bias, lengths, window, soft cap or segments"
        if case.causal == "bottom_right" and case.q_len != case.kv_len:
            return "Mosaic GPU attention's causal is top-left only"
        if case.head_dim % 64:
            return f"Mosaic GPU attention needs head_dim % 64 == 0, got {case.head_dim}"
        if case.kv_len % self.tiles["block_kv"] or case.q_len % self.tiles["block_q"]:
            return "Mosaic GPU attention needs lengths that are multiples of its blocks (64 queries, 128 keys)"
        return None

    def _prepare(self, inputs, *, backward):
        from jax.experimental.pallas.ops.gpu import attention_mgpu
        c = inputs.case
        config = attention_mgpu.TuningConfig(causal=c.causal is not None, **self.tiles)

        def attn(q, k, v, bias, mask, **_):
            return attention_mgpu.attention((q * c.effective_scale).astype(q.dtype), k, v, config)
        # its own checks (causal backward, shared memory, CUDA version) say what it cannot run
        return _prepared_or_not_supported(
            "Mosaic GPU attention", lambda: JaxPrepared(attn, inputs, backward=backward, device=self.device))


def _parse_absl_flags_once() -> None:
    """tokamax reads absl flags; unparsed, absl would parse the harness's own command line
    (``--impl`` ...) and fail. Parse them with only a program name instead."""
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS(["conformance"], known_only=True)


def tokamax_attention(q, k, v, bias=None, mask=None, **kw):
    _parse_absl_flags_once()
    import tokamax
    return tokamax.dot_product_attention(q, k, v, bias=bias, mask=mask, **kw)


def tokamax_reason(adapter, case):
    if case.segments:
        return "tokamax adapter: segment ids not mapped"
    if case.causal == "bottom_right" and case.q_len != case.kv_len:
        return "tokamax's is_causal is top-left"
    return None
