"""The public API: argument errors, transformations, empty rows, residuals, batch dims."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_impl import BlockSizes
from jax_impl.flash_attention import flash_attention


def _qkv(b=2, lq=24, lk=24, hq=4, hkv=2, d=16, seed=0, dtype=jnp.float32, batch=None):
    rng = np.random.default_rng(seed)
    lead = batch if batch is not None else (b,)
    draw = lambda *s: jnp.asarray(rng.standard_normal(lead + s), dtype)
    return draw(lq, hq, d), draw(lk, hkv, d), draw(lk, hkv, d)


# --- Bad input: a clear error that names the argument and the rule ---------------------------

BAD_CALLS = {
    "rank": (lambda q, k, v: flash_attention(q[0, 0], k[0, 0], v[0, 0]), ValueError, "query must have shape"),
    "head_dim": (lambda q, k, v: flash_attention(q, k[..., :8], v[..., :8]), ValueError, "head_dim"),
    "dtype": (lambda q, k, v: flash_attention(q, k.astype(jnp.bfloat16), v), TypeError, "share a dtype"),
    "int_dtype": (lambda q, k, v: flash_attention(q.astype(jnp.int32), k, v), TypeError, "query.dtype"),
    "gqa": (lambda q, k, v: flash_attention(q[:, :, :3], k, v), ValueError, "num_q_heads=3 must be a multiple of num_kv_heads=2"),
    "mask_shape": (lambda q, k, v: flash_attention(q, k, v, mask=jnp.ones((5, 24), bool)), ValueError, "mask.shape"),
    "mask_dtype": (lambda q, k, v: flash_attention(q, k, v, mask=jnp.ones((24, 24))), TypeError, "mask.dtype"),
    "bias_shape": (lambda q, k, v: flash_attention(q, k, v, bias=jnp.ones((3, 1, 24, 24))), ValueError, "bias.shape"),
    "lengths_range": (lambda q, k, v: flash_attention(q, k, v, key_value_seq_lengths=jnp.array([3, 25])), ValueError, r"key_value_seq_lengths must lie in \[0, 24\]"),
    "lengths_shape": (lambda q, k, v: flash_attention(q, k, v, query_seq_lengths=jnp.array([3])), ValueError, "query_seq_lengths.shape"),
    "segments_alone": (lambda q, k, v: flash_attention(q, k, v, q_segment_ids=jnp.zeros((2, 24), jnp.int32)), ValueError, "together"),
    "alignment": (lambda q, k, v: flash_attention(q, k, v, causal_alignment="bottom"), ValueError, "causal_alignment"),
    "window": (lambda q, k, v: flash_attention(q, k, v, local_window_size=(-1, 2)), ValueError, "local_window_size"),
    "scale": (lambda q, k, v: flash_attention(q, k, v, scale=-1.0), ValueError, "scale"),
    "soft_cap": (lambda q, k, v: flash_attention(q, k, v, logits_soft_cap=0.0), ValueError, "logits_soft_cap"),
    "implementation": (lambda q, k, v: flash_attention(q, k, v, implementation="cuDNN"), ValueError, r"implementation='cuDNN' must be None \(.*\) or one of \('pallas_triton'"),
    "implementation_list": (lambda q, k, v: flash_attention(q, k, v, implementation=["xla"]), TypeError, r"implementation=\['xla'\] must be None \(.*\) or one of \('pallas_triton'.*'cudnn'\): a str"),
    "return_residual_str": (lambda q, k, v: flash_attention(q, k, v, return_residual="yes"), TypeError, "return_residual='yes' must be a Python bool"),
    "interpret_int": (lambda q, k, v: flash_attention(q, k, v, interpret=0), TypeError, "interpret=0 must be a Python bool"),
    "is_causal_str": (lambda q, k, v: flash_attention(q, k, v, is_causal="False"), TypeError, "is_causal='False' must be a Python bool"),
    "broadcast_dropout_str": (lambda q, k, v: flash_attention(q, k, v, broadcast_dropout="no"), TypeError, "broadcast_dropout='no' must be a Python bool"),
    "deterministic_str": (lambda q, k, v: flash_attention(q, k, v, deterministic="true"), TypeError, r"deterministic='true' must be None \(.*\) or a Python bool"),
    "force_fp32_int": (lambda q, k, v: flash_attention(q, k, v, force_fp32_for_softmax=1), TypeError, "force_fp32_for_softmax=1 must be a Python bool"),
    "alignment_list": (lambda q, k, v: flash_attention(q, k, v, causal_alignment=["top_left"]), TypeError, r"causal_alignment=\['top_left'\] must be one of"),
    "strategy_tuple": (lambda q, k, v: flash_attention(q, k, v, context_parallel_strategy=("ring",)), TypeError, r"context_parallel_strategy=\('ring',\) must be None"),
    "interpret_xla": (lambda q, k, v: flash_attention(q, k, v, implementation="xla", interpret=True), ValueError, "interpret=True"),
    "block_sizes_type": (lambda q, k, v: flash_attention(q, k, v, block_sizes=(64, 64)), TypeError, "block_sizes"),
    "head_dim_pallas": (lambda q, k, v: flash_attention(*(jnp.ones((1, 4, 1, 512)),) * 3, implementation="pallas_triton"), ValueError, "head_dim=512"),
    "dropout_rng": (lambda q, k, v: flash_attention(q, k, v, dropout_rate=0.1, deterministic=False), ValueError, "dropout_rng must be a PRNG key"),
    "dropout_rate": (lambda q, k, v: flash_attention(q, k, v, dropout_rate=1.0, dropout_rng=jax.random.key(0)), ValueError, r"dropout_rate=1.0 must be"),
    "sinks_shape": (lambda q, k, v: flash_attention(q, k, v, attention_sinks=jnp.zeros((3,))), ValueError, r"attention_sinks.shape=\(3,\)"),
    "sinks_dtype": (lambda q, k, v: flash_attention(q, k, v, attention_sinks=jnp.zeros((2,), jnp.int32)), TypeError, "attention_sinks must be floating"),
    "precision": (lambda q, k, v: flash_attention(q, k, v, precision="turbo"), ValueError, "precision"),
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_input_raises_a_clear_error(name):
    call, error, message = BAD_CALLS[name]
    with pytest.raises(error, match=message):
        call(*_qkv())


@pytest.mark.parametrize("field, value", [("block_q", 48), ("block_k", 8), ("num_warps", 3)])
def test_invalid_block_sizes_are_refused(field, value):
    with pytest.raises(ValueError, match=f"BlockSizes.{field}"):
        BlockSizes(**{field: value})


# --- Empty rows, residuals -----------------------------------------------------------------

@pytest.mark.parametrize("options", [dict(implementation="xla"), dict(implementation="reference"),
                                     dict(implementation="pallas_triton", interpret=True)],
                         ids=["xla", "reference", "pallas_triton"])
def test_rows_with_no_allowed_key_give_zero_output_and_gradients(options):
    q, k, v = _qkv(lq=20, lk=12)
    mask = jnp.asarray(np.random.default_rng(1).random((2, 4, 20, 12)) < 0.6).at[:, :, :5].set(False)
    lengths = jnp.array([12, 0], jnp.int32)  # batch row 1 has no keys at all
    cotangent = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)

    def attend(q, k, v):
        return flash_attention(q, k, v, mask=mask, key_value_seq_lengths=lengths,
                               return_residual=True, **options)

    (out, lse), vjp = jax.vjp(attend, q, k, v)
    dq, dk, dv = vjp((cotangent, jnp.zeros_like(lse)))
    for x in (out, dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(x)))
    assert np.all(np.asarray(out[:, :5]) == 0) and np.all(np.asarray(out[1]) == 0)
    assert np.all(np.asarray(dq[:, :5]) == 0) and np.all(np.asarray(dk[1]) == 0)
    assert np.all(np.isneginf(np.asarray(lse[:, :5]))) and np.all(np.isneginf(np.asarray(lse[1])))
    assert np.all(np.isfinite(np.asarray(lse[0, 5:])))
    assert np.any(np.asarray(out[0, 5:]) != 0)


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton"])
def test_logsumexp_residual_matches_dense_and_is_differentiable(implementation):
    q, k, v = _qkv(lq=20, lk=28, seed=3)
    options = dict(interpret=True) if implementation == "pallas_triton" else {}
    rng = np.random.default_rng(4)
    out_ct = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    lse_ct = jnp.asarray(rng.standard_normal(q.shape[:-1]), jnp.float32)

    def grads(attention, **kw):
        fn = lambda q, k, v: attention(q, k, v, is_causal=True, return_residual=True, **kw)
        (out, lse), vjp = jax.vjp(fn, q, k, v)
        return (out, lse) + vjp((out_ct, lse_ct))

    ours, dense = grads(flash_attention, implementation=implementation, **options), grads(_dense)
    assert ours[1].shape == q.shape[:-1]  # [B, Lq, Hq], as jax.nn's residual
    dense_lse = jax.nn.dot_product_attention(q, jnp.repeat(k, 2, 2), jnp.repeat(v, 2, 2),
                                             is_causal=True, return_residual=True)[1]
    np.testing.assert_allclose(ours[1], dense_lse, atol=2e-5)
    for a, b in zip(ours, dense):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)


# --- Forward-mode autodiff: refused by the blocked paths, naming the one that has it ----------

FORWARD_MODE = {
    "jvp": lambda f, q: jax.jvp(f, (q,), (q * 0.5,)),
    "jit_of_jvp": lambda f, q: jax.jit(lambda q: jax.jvp(f, (q,), (q * 0.5,)))(q),
    "jvp_of_jit": lambda f, q: jax.jvp(jax.jit(f), (q,), (q * 0.5,)),
    "jacfwd": lambda f, q: jax.jacfwd(f)(q),
    "linearized": lambda f, q: jax.linearize(f, q)[1](q),
    "hessian": lambda f, q: jax.hessian(lambda q: f(q).sum())(q),
}


@pytest.mark.parametrize("implementation", ["xla", None])
@pytest.mark.parametrize("transform", FORWARD_MODE)
def test_forward_mode_is_refused_naming_the_reference(transform, implementation):
    """JAX's own message ("can't apply forward-mode autodiff (jvp) to a custom_vjp function")
    names no way out and, under jit, is raised far from the call."""
    q, k, v = _qkv(b=1, lq=6, lk=6, hq=2, hkv=1, d=4, seed=17)
    flash = lambda q: flash_attention(q, k, v, is_causal=True, implementation=implementation)
    with pytest.raises(NotImplementedError, match=r"Forward mode \(jax.jvp, .*implementation='reference'"):
        FORWARD_MODE[transform](flash, q)


def test_the_reference_pushes_tangents_forward_as_the_float64_oracle():
    """The way the refusal names works: jax.jvp of implementation='reference' against the
    float64 oracle's central difference along the tangent (step 1e-5: error ~1e-10)."""
    import torch
    import torch_ref
    q, k, v = _qkv(b=2, lq=7, lk=9, hq=4, hkv=2, d=8, seed=18)
    rng = np.random.default_rng(19)
    tangents = [jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (q, k, v)]
    attend = lambda q, k, v: flash_attention(q, k, v, is_causal=True, implementation="reference")
    out, out_tangent = jax.jvp(attend, (q, k, v), tuple(tangents))

    def oracle(step):  # float64 attention at primals + step * tangents
        moved = (torch.tensor(np.asarray(x, np.float64) + step * np.asarray(t, np.float64))
                 .permute(0, 2, 1, 3) for x, t in zip((q, k, v), tangents))
        return torch_ref.manual_attention(*moved, is_causal=True).permute(0, 2, 1, 3).numpy()

    np.testing.assert_allclose(np.asarray(out), oracle(0.0), atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(out_tangent), (oracle(1e-5) - oracle(-1e-5)) / 2e-5,
                               atol=5e-5, rtol=0)


# --- Transformations and shapes ---------------------------------------------------------------

def _dense(q, k, v, *, is_causal=False, mask=None, key_value_seq_lengths=None,
           return_residual=False):
    """Dense attention written here from the rules, sharing no code with jax_impl: the oracle
    of these tests. q [..., Lq, Hq, D], k/v [..., Lk, Hkv, D]; forward only for empty rows."""
    groups = q.shape[-2] // k.shape[-2]
    k, v = jnp.repeat(k, groups, axis=-2), jnp.repeat(v, groups, axis=-2)
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k, precision="highest") / np.sqrt(q.shape[-1])
    lq, lk = logits.shape[-2:]
    allowed = jnp.ones(logits.shape, bool)
    if is_causal:
        allowed &= jnp.arange(lk)[None, :] <= jnp.arange(lq)[:, None]
    if mask is not None:
        allowed &= mask
    if key_value_seq_lengths is not None:
        allowed &= jnp.arange(lk) < jnp.asarray(key_value_seq_lengths)[..., None, None, None]
    logits = jnp.where(allowed, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)                              # [..., Hq, Lq]
    p = jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0)[..., None])  # empty rows: 0
    out = jnp.einsum("...hqk,...khd->...qhd", p, v, precision="highest")
    return (out, jnp.swapaxes(lse, -1, -2)) if return_residual else out


def test_jit_grad_vmap_checkpoint_agree_with_dense():
    q, k, v = _qkv(seed=5)
    ct = jnp.asarray(np.random.default_rng(6).standard_normal(q.shape), jnp.float32)
    loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v, is_causal=True) * ct)
    flash = lambda q, k, v, **kw: flash_attention(q, k, v, implementation="xla", **kw)
    expected = jax.grad(loss(_dense), argnums=(0, 1, 2))(q, k, v)
    got = jax.jit(jax.grad(jax.checkpoint(loss(flash)), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)
    vmapped = jax.vmap(lambda q, k, v: flash(q[None], k[None], v[None], is_causal=True)[0])(q, k, v)
    np.testing.assert_allclose(vmapped, _dense(q, k, v, is_causal=True), atol=2e-5)


def test_vmapped_gradient_with_per_example_lengths():
    q, k, v = _qkv(seed=7)
    lengths = jnp.array([24, 9], jnp.int32)
    ct = jnp.asarray(np.random.default_rng(8).standard_normal(q.shape), jnp.float32)

    def per_example(fn):
        def loss(q, k, v, n, c):
            return jnp.sum(fn(q[None], k[None], v[None], key_value_seq_lengths=n[None])[0] * c)
        return jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, lengths, ct)

    flash = lambda *a, **kw: flash_attention(*a, implementation="xla", **kw)
    for a, b in zip(per_example(flash), per_example(_dense)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)


def test_extra_batch_dims_and_no_batch_dims():
    q, k, v = _qkv(batch=(2, 3), seed=9)
    mask = jnp.asarray(np.random.default_rng(10).random((2, 1, 1, 24, 24)) < 0.8)
    lengths = jnp.array([[24, 10, 5], [1, 24, 17]], jnp.int32)
    got = flash_attention(q, k, v, mask=mask, key_value_seq_lengths=lengths)
    assert got.shape == q.shape
    for i in range(2):
        for j in range(3):
            expected = _dense(q[i, j][None], k[i, j][None], v[i, j][None], mask=mask[i],
                              key_value_seq_lengths=lengths[i, j][None])
            np.testing.assert_allclose(got[i, j], expected[0], atol=2e-5)
    unbatched = flash_attention(q[0, 0], k[0, 0], v[0, 0], is_causal=True)
    np.testing.assert_allclose(unbatched, _dense(q[0, 0], k[0, 0], v[0, 0], is_causal=True), atol=2e-5)


def test_matches_jax_nn_on_its_own_arguments():
    q, k, v = _qkv(lq=20, lk=33, hq=2, hkv=2, seed=11)
    bias = jnp.asarray(np.random.default_rng(12).standard_normal((1, 2, 20, 33)), jnp.float32)
    mask = jnp.asarray(np.random.default_rng(13).random((2, 1, 20, 33)) < 0.9)
    kw = dict(scale=0.3, key_value_seq_lengths=jnp.array([33, 20]), local_window_size=(5, 3))
    np.testing.assert_allclose(flash_attention(q, k, v, bias, mask, **kw),
                               jax.nn.dot_product_attention(q, k, v, bias, mask, **kw), atol=2e-5)
    np.testing.assert_allclose(flash_attention(q, k, v, is_causal=True),
                               jax.nn.dot_product_attention(q, k, v, is_causal=True), atol=2e-5)


def test_causal_alignments_differ_as_defined():
    """Lq=2, Lk=4: top-left lets query 0 see key 0 only; bottom-right lets it see keys 0..2."""
    q, _, _ = _qkv(b=1, lq=2, lk=4, hq=1, hkv=1, d=16, seed=14)
    k = jnp.asarray(np.random.default_rng(15).standard_normal((1, 4, 1, 16)), jnp.float32)
    v = jnp.eye(4, 16, dtype=jnp.float32)[None, :, None, :]  # output = probability per key
    for alignment, visible in (("top_left", 1), ("bottom_right", 3)):
        out = flash_attention(q, k, v, is_causal=True, causal_alignment=alignment)
        probs = np.asarray(out[0, 0, 0, :4])
        assert np.all(probs[:visible] > 0) and np.all(probs[visible:] == 0), (alignment, probs)
        np.testing.assert_allclose(probs.sum(), 1.0, rtol=1e-6)


def test_eager_calls_trace_once_per_shape(monkeypatch):
    """Calling without jit reuses one compilation (a re-trace per call cost ~100x the call)."""
    from jax_impl import flash_attention as fa_module
    traced = []
    original = fa_module._run
    monkeypatch.setattr(fa_module, "_run", lambda *a, **k: traced.append(1) or original(*a, **k))
    q, k, v = _qkv(lq=19, lk=23, seed=16)
    first = flash_attention(q, k, v, is_causal=True, local_window_size=(3, 2))
    count = len(traced)
    second = flash_attention(q + 1, k, v, is_causal=True, local_window_size=(3, 2))
    assert count >= 1 and len(traced) == count
    assert not np.allclose(first, second)
    flash_attention(q, k, v, is_causal=False)  # another configuration traces again
    assert len(traced) > count


def test_the_package_attribute_is_callable_as_users_write_it():
    import importlib
    import importlib.metadata
    import inspect

    import jax_impl
    import jax_impl.flash_attention as module
    from jax_impl.flash_attention import flash_attention as function
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 8, 2, 16))
    expected = np.asarray(function(q, q, q, is_causal=True))
    for attention in (jax_impl.flash_attention, module, importlib.import_module("jax_impl").flash_attention):
        np.testing.assert_array_equal(attention(q, q, q, is_causal=True), expected)
    assert module.explain_implementation is jax_impl.explain_implementation  # still the module
    assert "is_causal" in inspect.signature(jax_impl.flash_attention).parameters
    assert importlib.metadata.version("jax-flash-attention-ref") == jax_impl.__version__


def test_the_argument_checks_default_as_the_function_does():
    """arguments.validate serves flash_attention, explain_implementation and ring_attention:
    its keyword defaults are the public signature's, so a call means the same through each."""
    import inspect
    from jax_impl import arguments
    public = inspect.signature(flash_attention).parameters
    checks = inspect.signature(arguments.validate).parameters
    assert list(public) == list(checks)
    assert {n: p.default for n, p in public.items()} == {n: p.default for n, p in checks.items()}


def _argument_entry(name: str) -> str:
    """The text of argument ``name``'s entry in flash_attention's docstring."""
    import re
    doc = flash_attention.__doc__
    match = re.search(rf"\n      {name}: (.*?)(?=\n      \w+: |\n\n  \w)", doc, re.S)
    assert match, name
    return " ".join(match.group(1).split())


def test_the_docstring_names_every_implementation_and_the_automatic_choice_the_table_makes():
    """The API reference (this docstring) against the implementation table: every
    implementation named, and the automatic choice it states per platform is the one
    explain_implementation makes there; where mods run is what the table does."""
    import re
    from jax_impl import explain_implementation, implementations
    entry = _argument_entry("implementation")
    for name in (*implementations.IMPLEMENTATIONS, "cudnn"):
        assert f'"{name}"' in entry, name
    stated = re.search(r"the first of (.*?) that can run the call", entry).group(1)
    order = re.findall(r"(\w+) \((\w+)(?: platform)?\)", stated)
    assert [name for name, _ in order] == [
        name for name, impl in implementations.IMPLEMENTATIONS.items() if impl.automatic]
    q = jnp.zeros((1, 128, 2, 64), jnp.float32) + 1.0
    for name, platform in order:
        platform = "rocm" if platform == "any" else platform
        assert explain_implementation(q, q, q, platform=platform).chosen == name, (name, platform)
    mods = _argument_entry("block_mask")
    assert "in every implementation's kernels" in mods and "mosaic_tpu takes mods without mod_aux" in mods
    slopes = jnp.linspace(0.1, 0.5, 2)
    alibi = lambda s, b, h, i, j, w: s - w[h] * jnp.abs(i - j)
    index_only = lambda s, b, h, i, j: s - 0.1 * jnp.abs(i - j)
    choice = lambda platform, **kw: explain_implementation(q, q, q, platform=platform, **kw).chosen
    assert choice("cpu", score_mod=alibi, mod_aux=(slopes,)) == "cpu"
    assert choice("cuda", score_mod=alibi, mod_aux=(slopes,)) == "pallas_triton"
    assert choice("tpu", score_mod=index_only) == "mosaic_tpu"
    assert choice("tpu", score_mod=alibi, mod_aux=(slopes,)) == "xla"


def test_one_entry_of_the_table_decides_for_flash_attention_and_explain(monkeypatch):
    """Eligibility is read from the table only: a changed rule of one entry moves the
    automatic choice, explain_implementation's reasons and a named call's refusal together."""
    import dataclasses
    from jax_impl import explain_implementation, implementations
    q = jnp.asarray(np.random.default_rng().standard_normal((1, 40, 2, 48)), jnp.float32)
    lowered = lambda: jax.jit(lambda q: flash_attention(q, q, q)).lower(q).as_text()
    assert "jax_flash_attention_cpu_forward" in lowered()  # the C++ kernel, as the table says
    rule = lambda features: "head_dim=48 refused by this test" if features.head_dim == 48 else None
    entry = dataclasses.replace(implementations.IMPLEMENTATIONS["cpu"], call_unsupported=rule)
    monkeypatch.setitem(implementations.IMPLEMENTATIONS, "cpu", entry)
    choice = explain_implementation(q, q, q, platform="cpu")
    assert choice.chosen == "xla" and choice.reasons["cpu"] == "head_dim=48 refused by this test"
    with pytest.raises(ValueError, match="implementation='cpu' cannot run this call: head_dim=48"):
        flash_attention(q, q, q, implementation="cpu")
    from jax_impl import flash_attention as api
    api._attention.clear_cache()  # the automatic choice is made where the call is traced
    assert "jax_flash_attention_cpu_forward" not in lowered()
