"""ring_attention (context parallelism) inside shard_map: exact against the float64 oracle."""
import numpy as np
import pytest

from _spawn import run_script
from jax_impl import ring

TOL = 2e-5  # float32 blocked attention vs float64 dense, unit-normal inputs, L <= 64


def _check(errors, names):
    assert set(errors) == set(names)
    for config, errs in errors.items():
        differentiated_bias = "bias" in config and "constant" not in config
        expected = {"out", "dq", "dk", "dv"} | ({"dbias"} if differentiated_bias else set())
        assert set(errs) == expected, config
        assert max(errs.values()) < TOL, (config, errs)


def test_ring_xla_matches_float64_oracle():
    """Causal in both alignments, window, lengths (one row empty), segment ids, GQA, Lq != Lk,
    zigzag and contiguous layouts, bias (per head, broadcast) and dense mask: out, dq, dk, dv,
    dbias against torch_ref.manual_attention in float64; and a constant bias (no dbias)."""
    names = ("causal_top_left", "bottom_right_gqa_window_lengths_segments",
             "contiguous_window_kv_lengths", "bias_causal_gqa",
             "bias_broadcast_mask_bottom_right_lengths", "contiguous_bias_mask_window",
             "constant_bias_causal")
    _check(run_script("ring_exact.py", "xla", *names), names)


def test_ring_pallas_interpret_matches_float64_oracle():
    """The same ring with the Pallas kernels (interpreter) as the local step: the per-pair
    position offset reaches the forward, dK/dV and dQ kernels."""
    names = ("causal_top_left", "bottom_right_gqa_window_lengths_segments",
             "bias_broadcast_mask_bottom_right_lengths", "contiguous_bias_mask_window")
    _check(run_script("ring_exact.py", "pallas_triton", *names), names)


def test_ring_cpu_kernel_matches_float64_oracle_under_check_vma():
    """The fused C++ kernel as the local step, under shard_map's default check_vma=True (its
    custom calls' results must vary over the ring axis like their operands), with the bias and
    dense mask slices each ring step passes it."""
    names = ("causal_top_left", "bottom_right_gqa_window_lengths_segments",
             "contiguous_window_kv_lengths", "bias_broadcast_mask_bottom_right_lengths")
    _check(run_script("ring_exact.py", "cpu", *names), names)


def test_ring_pallas_interpreter_under_check_vma_is_refused_by_name():
    message = run_script("ring_exact.py", "refusal")["message"]
    assert message and "interpret=True" in message and "check_vma=False" in message


def _causal_work(layout, n, length):
    """Allowed (query, key) pairs of a top-left causal mask each device's queries own."""
    if layout == "zigzag":
        positions = ring.zigzag_permutation(length, n).reshape(n, -1)
    else:
        positions = np.arange(length).reshape(n, -1)
    return (positions + 1).sum(axis=1)  # query i sees keys 0..i


def test_zigzag_balances_causal_work_on_8_devices():
    work = _causal_work("zigzag", 8, 32768)
    assert work.max() / work.min() <= 1.2
    assert work.sum() == 32768 * 32769 // 2  # every query row is owned exactly once
    contiguous = _causal_work("contiguous", 8, 32768)
    assert contiguous.max() / contiguous.min() > 10  # what the reordering fixes


def test_zigzag_round_trip_and_layout():
    x = np.arange(32)
    z = np.asarray(ring.to_zigzag(x, 4, 0))
    assert list(z[:8]) == [0, 1, 2, 3, 28, 29, 30, 31]  # device 0: chunks 0 and 7 of 8
    assert (np.asarray(ring.from_zigzag(z, 4, 0)) == x).all()
    with pytest.raises(ValueError, match="multiple of 2 \\* num_devices"):
        ring.zigzag_permutation(30, 4)


def _ring_shapes(n, local_len, pairwise=(), **kwargs):
    """ring_attention traced (not run) over an abstract mesh of ``n`` devices: its argument
    checks need the axis size, not devices, so this runs in-process. ``pairwise``: names of
    bias/mask given as ``[2, 1, L, L]`` arrays sharded along their query rows."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh, PartitionSpec as P
    from jax_impl.context_parallel import ring_attention

    length = local_len * n
    q = jax.ShapeDtypeStruct((2, length, 2, 16), jnp.float32)
    pairs = {name: jax.ShapeDtypeStruct((2, 1, length, length),
                                        jnp.bool_ if name == "mask" else jnp.float32)
             for name in pairwise}
    traced = {k: v for k, v in kwargs.items() if isinstance(v, jax.ShapeDtypeStruct)}
    concrete = {k: v for k, v in kwargs.items() if k not in traced}
    body = lambda q, lens, pairs: ring_attention(q, q, q, axis_name="seq", **pairs, **lens,
                                                 **concrete)
    mapped = jax.shard_map(body, mesh=AbstractMesh((n,), ("seq",)),
                           in_specs=(P(None, "seq"), P(), P(None, None, "seq", None)),
                           out_specs=P(None, "seq"))
    return jax.eval_shape(mapped, q, traced, pairs)


@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths"])
@pytest.mark.parametrize("bad", [65, -1, 2**40])
def test_concrete_lengths_outside_the_global_length_are_refused_by_name(name, bad):
    rng = np.random.default_rng()
    good = int(rng.integers(9, 65))  # past the local length 8: only the global 64 bounds it
    lengths = np.array([good, bad], np.int64)
    with pytest.raises(ValueError, match=rf"{name} must lie in \[0, 64\]; got values in "
                                         rf"\[{min(good, bad)}, {max(good, bad)}\].*global sequence "
                                         r"length 64"):
        _ring_shapes(8, 8, **{name: lengths})
    _ring_shapes(8, 8, **{name: np.array([good, 64], np.int32)})  # in range: accepted


def test_traced_lengths_past_the_sequence_mean_the_whole_sequence():
    """Traced lengths cannot be checked: they are clamped (a one-device ring, in-process)."""
    import jax
    from jax.sharding import Mesh, PartitionSpec as P
    from jax_impl.context_parallel import ring_attention
    from torch_ref import attention_with_grads, manual_attention

    rng = np.random.default_rng()
    q, k, v, ct = (rng.standard_normal((2, 16, 2, 16)).astype(np.float32) for _ in range(4))
    lengths = np.array([16 + rng.integers(1, 100), 2**31 - 1], np.int32)
    body = lambda q, k, v, lens: ring_attention(q, k, v, axis_name="seq", is_causal=True,
                                                query_seq_lengths=lens, key_value_seq_lengths=lens)
    seq = P(None, "seq")
    mapped = jax.shard_map(body, mesh=Mesh(np.array(jax.devices()[:1]), ("seq",)),
                           in_specs=(seq, seq, seq, P()), out_specs=seq)
    out, vjp = jax.vjp(jax.jit(lambda q, k, v: mapped(q, k, v, lengths)), q, k, v)
    got = dict(zip(("out", "dq", "dk", "dv"), (out, *vjp(ct))))
    ref = attention_with_grads(manual_attention, *(x.astype(np.float64) for x in (q, k, v, ct)),
                               is_causal=True)
    for name, value in got.items():
        np.testing.assert_allclose(np.asarray(value, np.float64), np.asarray(ref[name]),
                                   atol=TOL, rtol=0, err_msg=name)




@pytest.mark.parametrize("function", ["ring_attention", "ulysses_attention", "hybrid_attention"])
def test_implementation_none_runs_flash_attentions_automatic_choice(function):
    """implementation=None in the shard_map functions is what flash_attention chooses for the
    platform, among the kernels the strategy can use: on a CPU the fused C++ kernel; xla for
    tiles that kernel cannot take (block_k 32) and for dropout in a ring (it hashes local
    positions). A one-device mesh, in-process; values vs a numpy float64 oracle."""
    import jax
    from jax.sharding import Mesh, PartitionSpec as P
    import jax_impl
    from jax_impl.config import BlockSizes

    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((1, 32, 2, 16)).astype(np.float32) for _ in range(3))
    attention = getattr(jax_impl, function)
    hybrid = function == "hybrid_attention"
    axes = dict(all_to_all_axis="chip", ring_axis="host") if hybrid else dict(axis_name="seq")
    names = ("host", "chip") if hybrid else ("seq",)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(names)), names)
    seq = P(None, names)

    def run(**kwargs):
        body = lambda *xs: attention(*xs, is_causal=True, implementation=None, **axes, **kwargs)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq))
        return f(q, k, v), f.lower(q, k, v).compile().as_text()

    logits = np.einsum("bqhd,bkhd->bhqk", q, k, dtype=np.float64) / 4.0
    logits = logits + np.where(np.tri(32) > 0, 0, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    expected = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v.astype(np.float64))
    cpu_kernel = "jax_flash_attention_cpu_forward"
    for kwargs, kernel_runs in ((dict(), True), (dict(block_sizes=BlockSizes(block_k=32)), False)):
        out, hlo = run(**kwargs)
        assert (cpu_kernel in hlo) == kernel_runs, kwargs
        np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=TOL, rtol=0)
    if function != "ulysses_attention":
        _, hlo = run(dropout_rate=0.5, dropout_rng=jax.random.key(0))
        assert cpu_kernel not in hlo
