"""dbias only when the bias is differentiated: a constant bias (an additive mask, ALiBi) costs
the backward no [B, Hq, Lq, Lk] array; a differentiated one still gets its exact gradient."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _flash_helpers import torch_arrays
from jax_impl import BlockSizes
from jax_impl.flash_attention import flash_attention

B, H, LQ, LK, D = 2, 2, 64, 128, 16  # whole tiles: no padded copy of the bias
# Tiles smaller than the bias, so that a tile of it is not a score-sized array.
IMPLEMENTATIONS = {"xla": dict(implementation="xla", block_sizes=BlockSizes(block_q=32, block_k=32)),
                   "pallas_triton": dict(implementation="pallas_triton", interpret=True)}


def _inputs(seed):
    rng = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return draw(B, LQ, H, D), draw(B, LK, H, D), draw(B, LK, H, D), draw(B, H, LQ, LK), draw(B, LQ, H, D)


def _loss(options, cotangent):
    def loss(q, k, v, bias):
        return jnp.sum(flash_attention(q, k, v, bias, is_causal=True, **options) * cotangent)
    return loss


def _intermediate_shapes(jaxpr):
    """Shapes of every value an equation produces, in sub-jaxprs too (loop bodies, conds,
    custom-VJP calls, pallas_call kernels)."""
    shapes = []
    for eqn in jaxpr.eqns:
        shapes += [tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars]
        for sub in _sub_jaxprs(eqn):
            shapes += _intermediate_shapes(sub)
    return shapes


def _sub_jaxprs(eqn):
    for param in eqn.params.values():
        for value in param if isinstance(param, (tuple, list)) else (param,):
            if isinstance(value, jax.extend.core.ClosedJaxpr):
                yield value.jaxpr
            elif isinstance(value, jax.extend.core.Jaxpr):
                yield value


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_constant_bias_gets_no_score_sized_gradient(implementation):
    q, k, v, bias, cotangent = _inputs(0)
    loss = _loss(IMPLEMENTATIONS[implementation], cotangent)
    score_shape = (B, H, LQ, LK)
    constant = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, bias).jaxpr
    assert constant.eqns, "an empty jaxpr: the test inspects the wrong object"
    assert score_shape not in _intermediate_shapes(constant), (
        f"grad w.r.t. q, k, v only with a constant bias made a {score_shape} array")
    # The check can fail: differentiating the bias does make one (its gradient).
    differentiated = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias).jaxpr
    assert score_shape in _intermediate_shapes(differentiated)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gradients_with_and_without_dbias_match_the_oracle(implementation):
    q, k, v, bias, cotangent = _inputs(1)
    loss = _loss(IMPLEMENTATIONS[implementation], cotangent)
    oracle = torch_arrays(*(np.asarray(x) for x in (q, k, v, cotangent)), bias=np.asarray(bias),
                          is_causal=True)
    with_bias = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    without = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, bias)
    for name, got in (*zip(("dq", "dk", "dv", "dbias"), with_bias), *zip(("dq", "dk", "dv"), without)):
        np.testing.assert_allclose(np.asarray(got, np.float64), oracle[name], atol=2e-5, rtol=1e-4,
                                   err_msg=name)


def test_constant_bias_under_jit_remat_and_vmap_matches_the_oracle():
    q, k, v, bias, cotangent = _inputs(2)
    loss = _loss(IMPLEMENTATIONS["xla"], cotangent)
    oracle = torch_arrays(*(np.asarray(x) for x in (q, k, v, cotangent)), bias=np.asarray(bias),
                          is_causal=True)
    jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    assert (B, H, LQ, LK) not in _intermediate_shapes(jax.make_jaxpr(jitted)(q, k, v, bias).jaxpr)
    # Under jax.checkpoint JAX may instantiate the bias's zero tangent (then dbias is computed
    # and dropped: docs/limitations.md), so only the values are checked there.
    remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))
    for name, got in zip(("dq", "dk", "dv"), remat(q, k, v, bias)):
        np.testing.assert_allclose(got, oracle[name], atol=2e-5, rtol=1e-4, err_msg=name)
    # vmap over the batch: each example's dq with its own constant bias row.
    per_example = lambda q, k, v, bias, ct: jax.grad(
        lambda q: _loss(IMPLEMENTATIONS["xla"], ct[None])(q[None], k[None], v[None], bias[None]))(q)
    dq = jax.jit(jax.vmap(per_example))(q, k, v, bias, cotangent)
    np.testing.assert_allclose(dq, oracle["dq"], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_bias_computed_from_a_learned_parameter_still_gets_its_gradient(implementation):
    """ALiBi with learned per-head slopes: the bias [1, H, Lq, Lk] is perturbed through them,
    so dbias is computed and reduced over the batch; d(slopes) matches the oracle."""
    q, k, v, _, cotangent = _inputs(3)
    slopes = jnp.asarray(np.random.default_rng(4).uniform(0.1, 1.0, H), jnp.float32)
    distance = -jnp.abs(jnp.arange(LQ)[:, None] - jnp.arange(LK)[None, :]).astype(jnp.float32)
    alibi = lambda slopes: slopes[None, :, None, None] * distance
    loss = _loss(IMPLEMENTATIONS[implementation], cotangent)
    d_slopes = jax.jit(jax.grad(lambda slopes, q: loss(q, k, v, alibi(slopes))))(slopes, q)
    oracle = torch_arrays(*(np.asarray(x) for x in (q, k, v, cotangent)),
                          bias=np.asarray(alibi(slopes)), is_causal=True)
    expected = np.sum(oracle["dbias"] * np.asarray(distance, np.float64), axis=(0, 2, 3))
    np.testing.assert_allclose(d_slopes, expected, atol=1e-4, rtol=1e-4)


def test_logsumexp_only_cotangent_with_a_constant_bias():
    """Only the logsumexp is differentiated (the output's cotangent is a symbolic zero)."""
    q, k, v, bias, _ = _inputs(5)
    weights = jnp.asarray(np.random.default_rng(6).standard_normal((B, LQ, H)), jnp.float32)

    def lse_loss(q, lse_of):
        return jnp.sum(lse_of(q) * weights)

    flash_lse = lambda q: flash_attention(q, k, v, bias, is_causal=True, implementation="xla",
                                          return_residual=True)[1]

    def dense_lse(q):  # float64, written here from the definition
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k.astype(jnp.float64)) / np.sqrt(D) + bias
        causal = jnp.arange(LK)[None, :] <= jnp.arange(LQ)[:, None]
        lse = jax.nn.logsumexp(jnp.where(causal, logits, -jnp.inf), axis=-1)
        return jnp.swapaxes(lse, 1, 2)

    got = jax.grad(lse_loss)(q, flash_lse)
    with jax.enable_x64(True):
        expected = jax.grad(lse_loss)(jnp.asarray(q, jnp.float64), dense_lse)
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_second_order_with_a_constant_bias_is_still_refused(implementation):
    q, k, v, bias, cotangent = _inputs(7)
    loss = _loss(IMPLEMENTATIONS[implementation], cotangent)
    inner = jax.grad(lambda q: loss(q, k, v, bias))
    with pytest.raises(NotImplementedError, match="first-order VJP.*implementation='reference'"):
        jax.grad(lambda q: jnp.sum(inner(q)))(q)


def test_ring_attention_with_a_constant_bias_gets_no_score_sized_gradient():
    """ring_attention's own custom VJP (one-device ring, in process): the same rule."""
    from jax.sharding import Mesh, PartitionSpec as P

    from jax_impl.context_parallel import ring_attention
    q, k, v, bias, cotangent = _inputs(8)
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    seq, rows = P(None, "seq"), P(None, None, "seq", None)
    ring = jax.shard_map(lambda q, k, v, bias: ring_attention(q, k, v, bias, axis_name="seq",
                                                              is_causal=True),
                         mesh=mesh, in_specs=(seq, seq, seq, rows), out_specs=seq)
    loss = lambda q, k, v, bias: jnp.sum(ring(q, k, v, bias) * cotangent)
    constant = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, bias).jaxpr
    assert (B, H, LQ, LK) not in _intermediate_shapes(constant)
    differentiated = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias).jaxpr
    assert (B, H, LQ, LK) in _intermediate_shapes(differentiated)
    oracle = torch_arrays(*(np.asarray(x) for x in (q, k, v, cotangent)), bias=np.asarray(bias),
                          is_causal=True)
    for name, got in zip(("dq", "dk", "dv"), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, bias)):
        np.testing.assert_allclose(got, oracle[name], atol=2e-5, rtol=1e-4, err_msg=name)
