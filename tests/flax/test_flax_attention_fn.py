"""flash_attention as the ``attention_fn`` of Flax's linen and NNX attention modules.

Each case runs the same module (same parameters, same inputs) three times: with
flash_attention in float32, with Flax's default attention in float32 (the plain
implementation), and with Flax's default attention in float64 (the oracle). Outputs and
parameter gradients (under a random cotangent) are judged by ``conformance.tolerance.judge``:
flash's error against the float64 oracle must be at most 2x (outputs) / 3x (gradients) the
default float32 attention's own error, plus float32 rounding of the oracle.

Linen passes only the keywords flash_attention names (all of them); NNX passes all of them,
``module`` and ``is_causal`` included. Flax's masks are float 0/1 (make_attention_mask,
make_causal_mask); flash_attention reads them as Flax does when called by a module.

One deliberate difference: a query row with no allowed key (a padded query) gives 0 in
flash_attention and the mean of the values in Flax's default attention; padded queries are
left out of the comparison and get a zero cotangent (as a loss on padded positions would).
"""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from _flax_attn_helpers import (FEATURES, assert_verdicts, linen_mha, max_abs_diff, nnx_mha,
                                random_inputs, to_float64, value_and_vjp, verdicts)
from jax_impl.flash_attention import flash_attention

NNX_PASSES_IS_CAUSAL = "is_causal" in inspect.signature(nnx.MultiHeadAttention.__call__).parameters
PALLAS_INTERPRET = functools.partial(flash_attention, implementation="pallas_triton", interpret=True)


# --- cases: (batch_shape, Lq, Lkv, mask kind) ----------------------------------------------

CASES = {
    "cross_padding": ((2,), 24, 40, "padding"),
    "self_causal_mask": ((2,), 32, 32, "causal"),
    "self_causal_and_padding": ((2,), 20, 20, "causal+padding"),
    "extra_batch_dims_cross_padding": ((2, 3), 16, 24, "padding"),
    "self_padding": ((2,), 20, 20, "padding"),
}


def _case(name, seed):
    """Inputs, the Flax mask (float32, as Flax makes it) and a random cotangent."""
    batch_shape, lq, lkv, mask_kind = CASES[name]
    xq, xkv = random_inputs(seed, batch_shape, lq, lkv)
    if name.startswith("self"):
        xkv = xq
    rng = np.random.default_rng(seed)
    q_valid = np.ones(batch_shape + (lq,), bool)
    mask = None
    if mask_kind and "padding" in mask_kind:
        # Every batch row keeps >= 1 valid key; some rows lose queries too.
        q_len = rng.integers(lq // 2, lq + 1, size=batch_shape)
        kv_len = q_len if name.startswith("self") else rng.integers(1, lkv + 1, size=batch_shape)
        q_valid = np.arange(lq) < q_len[..., None]
        kv_valid = np.arange(lkv) < kv_len[..., None]
        mask = nn.make_attention_mask(q_valid, kv_valid)
    if mask_kind and "causal" in mask_kind:
        causal = nn.make_causal_mask(jnp.ones(batch_shape + (lq,)))
        mask = causal if mask is None else nn.combine_masks(mask, causal)
    cotangent = jax.random.normal(jax.random.PRNGKey(seed + 1), xq.shape, jnp.float32)
    cotangent = cotangent * q_valid[..., None]
    return xq, xkv, mask, cotangent, q_valid


def _three_runs(run, attention_fn, default_fn, params, xq, xkv, mask, cotangent):
    """(flash fp32, default fp64 oracle, default fp32) -> each (out, param grads) as numpy."""
    numpy = lambda r: jax.tree.map(np.asarray, r)
    flash = numpy(run(attention_fn, params, xq, xkv, mask, cotangent))
    baseline = numpy(run(default_fn, params, xq, xkv, mask, cotangent))
    with jax.enable_x64(True):
        args64 = [None if a is None else to_float64(a) for a in (params, xq, xkv, mask, cotangent)]
        oracle = numpy(run(default_fn, *args64))
    assert oracle[0].dtype == np.float64 and flash[0].dtype == np.float32
    return flash, oracle, baseline


def _linen_run(module_kwargs=(), call_kwargs=()):
    def run(attention_fn, params, xq, xkv, mask, cotangent):
        module = linen_mha(attention_fn, **dict(module_kwargs))
        apply = lambda p: module.apply(p, xq, xkv, mask=mask, **dict(call_kwargs))
        return jax.jit(value_and_vjp, static_argnums=0)(apply, params, cotangent)
    return run


def _nnx_run(module_kwargs=(), call_kwargs=()):
    def run(attention_fn, params, xq, xkv, mask, cotangent):
        graphdef, _, rest = nnx.split(nnx_mha(attention_fn, **dict(module_kwargs)), nnx.Param, ...)
        apply = lambda p: nnx.merge(graphdef, p, rest)(xq, xkv, mask=mask, **dict(call_kwargs))
        return jax.jit(value_and_vjp, static_argnums=0)(apply, params, cotangent)
    return run


def _compare(kind, case, attention_fn=flash_attention, seed=0, module_kwargs=(), call_kwargs=()):
    xq, xkv, mask, cotangent, q_valid = _case(case, seed)
    if kind == "linen":
        params = jax.jit(lambda key: linen_mha(**dict(module_kwargs)).init(
            key, xq, xkv, **dict(call_kwargs)))(jax.random.PRNGKey(seed + 2))
        run, default_fn = _linen_run(module_kwargs, call_kwargs), nn.dot_product_attention
    else:
        _, params, _ = nnx.split(nnx_mha(seed=seed + 2, **dict(module_kwargs)), nnx.Param, ...)
        run, default_fn = _nnx_run(module_kwargs, call_kwargs), nnx.dot_product_attention
    flash, oracle, baseline = _three_runs(run, attention_fn, default_fn, params, xq, xkv, mask,
                                          cotangent)
    # Padded query rows: flash gives attention output 0, so the module output is the out bias.
    out_bias = params["params"]["out"]["bias"] if kind == "linen" else params["out"]["bias"][...]
    if not q_valid.all():
        np.testing.assert_allclose(flash[0][~q_valid], np.broadcast_to(
            out_bias, flash[0][~q_valid].shape), rtol=0, atol=1e-6)
    valid = lambda r: (r[0][q_valid], r[1])
    vs = verdicts(valid(flash), valid(oracle), valid(baseline))
    assert_verdicts(vs)
    return valid(flash), valid(baseline), vs


# (module, case, module kwargs, call kwargs). dropout_rate > 0 with deterministic=True must
# run (no dropout happens) and match; NNX's is_causal joins a padding mask where flax has it.
MODULE_CASES = [
    ("linen", "cross_padding", {}, {}),
    ("linen", "self_causal_and_padding", {}, {}),
    ("linen", "extra_batch_dims_cross_padding", {"dropout_rate": 0.1}, {"deterministic": True}),
    ("nnx", "cross_padding", {}, {}),
    ("nnx", "self_padding", {}, {"is_causal": True}) if NNX_PASSES_IS_CAUSAL
    else ("nnx", "self_causal_and_padding", {}, {}),
    ("nnx", "extra_batch_dims_cross_padding", {"dropout_rate": 0.1}, {"deterministic": True}),
]


@pytest.mark.parametrize("kind,case,module_kwargs,call_kwargs", MODULE_CASES,
                         ids=[f"{k}-{c}-{'-'.join(m) or 'plain'}-{'-'.join(ck) or 'plain'}"
                              for k, c, m, ck in MODULE_CASES])
def test_flash_matches_default_attention(kind, case, module_kwargs, call_kwargs):
    flash, baseline, vs = _compare(kind, case, seed=len(case), module_kwargs=tuple(module_kwargs.items()),
                                   call_kwargs=tuple(call_kwargs.items()))
    # Printed with -s: the measured differences behind the report (valid query rows).
    print(f"\n{kind}/{case}{module_kwargs}{call_kwargs}: max |out diff| "
          f"{np.max(np.abs(flash[0] - baseline[0])):.2e}, max |grad diff| "
          f"{max_abs_diff(flash[1], baseline[1]):.2e}, worst error/tolerance "
          f"{max(v.ratio for v in vs):.2f}")


def test_pallas_interpret_linen_causal():
    """The Pallas kernel (interpreted on CPU) as attention_fn; slow, so one small case."""
    _compare("linen", "self_causal_and_padding", attention_fn=PALLAS_INTERPRET, seed=3)


# --- dropout, sow_weights, custom einsums ------------------------------------------------

def _train(loss_and_grad, params, steps=5, lr=0.1):
    losses = []
    for step in range(steps):
        loss, grads = loss_and_grad(params, jax.random.key(100 + step))
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        losses.append(float(loss))
    return losses


def test_dropout_trains_under_jit_linen():
    xq, target = random_inputs(0, (2,), 16, 16)
    module = linen_mha(flash_attention, dropout_rate=0.1)
    params = jax.jit(lambda key: module.init(key, xq, deterministic=True))(jax.random.PRNGKey(0))
    apply = lambda params, key, det: module.apply(params, xq, deterministic=det, rngs={"dropout": key})
    step = jax.jit(jax.value_and_grad(lambda p, key: jnp.mean((apply(p, key, False) - target) ** 2)))
    losses = _train(step, params)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    key = jax.random.key(1)
    train = jax.jit(apply, static_argnums=2)
    np.testing.assert_array_equal(train(params, key, False), train(params, key, False))
    assert max_abs_diff({"o": train(params, key, False)}, {"o": train(params, jax.random.key(2), False)}) > 1e-3
    # deterministic=True is exactly the module without dropout.
    plain = linen_mha(flash_attention).apply(params, xq)
    np.testing.assert_array_equal(train(params, key, True), plain)


def test_dropout_trains_under_jit_nnx():
    xq, target = random_inputs(0, (2,), 16, 16)
    module = nnx_mha(flash_attention, dropout_rate=0.1)
    optimizer_lr = 0.1

    @nnx.jit
    def step(module, key):
        def loss_fn(module):
            return jnp.mean((module(xq, deterministic=False, rngs=nnx.Rngs(dropout=key)) - target) ** 2)
        loss, grads = nnx.value_and_grad(loss_fn)(module)
        params = nnx.state(module, nnx.Param)
        nnx.update(module, jax.tree.map(lambda p, g: p - optimizer_lr * g, params, grads))
        return loss

    losses = [float(step(module, jax.random.key(100 + i))) for i in range(5)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    out = lambda key: module(xq, deterministic=False, rngs=nnx.Rngs(dropout=key))
    np.testing.assert_array_equal(out(jax.random.key(3)), out(jax.random.key(3)))
    assert float(jnp.max(jnp.abs(out(jax.random.key(3)) - out(jax.random.key(4))))) > 1e-3
    plain = module(xq, deterministic=True)
    reference = nnx.clone(module)
    reference.dropout_rate = 0.0
    np.testing.assert_array_equal(plain, reference(xq, deterministic=False))


def test_sow_weights_is_refused():
    xq, _ = random_inputs(0, (2,), 16, 16)
    module = linen_mha(flash_attention)
    params = jax.jit(module.init)(jax.random.PRNGKey(0), xq)
    with pytest.raises(NotImplementedError, match="sow"):
        module.apply(params, xq, sow_weights=True, mutable=["intermediates"])
    with pytest.raises(NotImplementedError, match="sow"):
        nnx_mha(flash_attention)(xq, sow_weights=True)


def test_custom_einsum_is_refused():
    xq, _ = random_inputs(0, (2,), 16, 16)
    module = linen_mha(flash_attention, qk_attn_weights_einsum_cls=lambda: jnp.einsum)
    with pytest.raises(NotImplementedError, match="einsum"):
        module.init(jax.random.PRNGKey(0), xq)


def test_float_mask_is_read_as_flax_reads_it_only_in_a_flax_call():
    """A Flax call (deterministic given) reads a float mask as nonzero = may attend; a direct
    call still refuses it, so an additive 0/-inf mask is never misread as a bool mask."""
    k = jax.random.split(jax.random.PRNGKey(5), 3)
    q, kk, v = (jax.random.normal(key, (2, 12, 4, 16)) for key in k)
    bool_mask = jax.random.bernoulli(jax.random.PRNGKey(6), 0.6, (2, 1, 12, 12)) | jnp.eye(12, dtype=bool)
    attend = jax.jit(flash_attention, static_argnames="deterministic")
    want = attend(q, kk, v, mask=bool_mask)
    got = attend(q, kk, v, mask=bool_mask.astype(jnp.float32) * 2.5, deterministic=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.allclose(np.asarray(want), np.asarray(attend(q, kk, v)), atol=1e-3)
    with pytest.raises(TypeError, match="must be bool"):
        flash_attention(q, kk, v, mask=bool_mask.astype(jnp.float32))
