"""A paged KV cache: flash_attention(q, k_pages, v_pages, page_table=...) judged by
torch_ref.paged_attention (float64, gathers in torch), read in place (no [B, Lk, Hkv, D] array
in the HLO), validated, forward only; and the writer jax_impl.kv_cache (append round-trips, in
place under donation)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_ref
from jax_impl import explain_implementation, flash_attention, kv_cache

T = lambda x: torch.tensor(np.asarray(x, np.float64))


def _setup(seed, *, b=2, lq=1, hq=8, hkv=2, d=16, page_size=16, pages_per_sequence=40,
           spare_pages=7, shuffled=True, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    num_pages = b * pages_per_sequence + spare_pages
    draw = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32), dtype)
    q = draw(b, lq, hq, d)
    k_pages, v_pages = draw(num_pages, page_size, hkv, d), draw(num_pages, page_size, hkv, d)
    table = kv_cache.make_page_table(b, pages_per_sequence, num_pages=num_pages,
                                     key=jax.random.key(seed) if shuffled else None)
    return rng, q, k_pages, v_pages, table


def _oracle(q, k_pages, v_pages, table, sinks=None, **kwargs):
    kw = {n: (torch.tensor(np.asarray(x)) if n.endswith("lengths") else x) for n, x in kwargs.items()}
    out = torch_ref.paged_attention(T(q).permute(0, 2, 1, 3), T(k_pages), T(v_pages),
                                    torch.tensor(np.asarray(table)),
                                    attention_sinks=None if sinks is None else T(sinks), **kw)
    return out.permute(0, 2, 1, 3).numpy()


@pytest.mark.parametrize("page_size,pages_per_sequence,lq,options", [
    (1, 700, 1, dict(is_causal=True, causal_alignment="bottom_right")),
    (16, 40, 4, dict(is_causal=True, causal_alignment="bottom_right", logits_soft_cap=4.0, sinks=True)),
    (64, 9, 2, dict(local_window_size=(200, 0), is_causal=True, causal_alignment="bottom_right")),
    (3, 150, 1, dict()),                   # not a tile multiple
    (300, 3, 16, dict(is_causal=True)),    # larger than a tile; top-left
], ids=["page1", "page16_softcap_sinks", "page64_window", "page3", "page300_16rows"])
def test_paged_matches_the_oracle_and_the_dense_cache(page_size, pages_per_sequence, lq, options):
    rng, q, k_pages, v_pages, table = _setup(page_size, lq=lq, page_size=page_size,
                                             pages_per_sequence=pages_per_sequence)
    options = dict(options)
    sinks = jnp.asarray(rng.standard_normal(q.shape[2]), jnp.float32) if options.pop("sinks", False) else None
    capacity = page_size * pages_per_sequence
    lengths = jnp.asarray([capacity, capacity // 2 + 1], jnp.int32)
    out = flash_attention(q, k_pages, v_pages, page_table=table, key_value_seq_lengths=lengths,
                          attention_sinks=sinks, **options)
    expected = _oracle(q, k_pages, v_pages, table, sinks, key_value_seq_lengths=lengths, **options)
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=0)
    dense = flash_attention(q, kv_cache.gather(k_pages, table), kv_cache.gather(v_pages, table),
                            key_value_seq_lengths=lengths, attention_sinks=sinks, implementation="xla",
                            **options)
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense), atol=2e-6, rtol=0)


@pytest.mark.parametrize("page_size,pages_per_sequence,shuffled", [
    (1, 600, True), (16, 40, False), (16, 40, True), (64, 10, True)])
def test_cpu_kernel_paged_equals_dense(page_size, pages_per_sequence, shuffled):
    """implementation='cpu' reads the pages in place (C++ kernel): the float64 oracle's answer,
    and the C++ kernel's own answer on the gathered dense cache; GQA, bottom-right causal with
    per-row lengths."""
    rng, q, k_pages, v_pages, table = _setup(20 + page_size, lq=2, page_size=page_size,
                                             pages_per_sequence=pages_per_sequence, shuffled=shuffled)
    capacity = page_size * pages_per_sequence
    lengths = jnp.asarray([capacity - 5, int(rng.integers(2, capacity // 2))], jnp.int32)
    kw = dict(is_causal=True, causal_alignment="bottom_right", key_value_seq_lengths=lengths)
    out = flash_attention(q, k_pages, v_pages, page_table=table, implementation="cpu", **kw)
    np.testing.assert_allclose(np.asarray(out), _oracle(q, k_pages, v_pages, table, **kw), atol=2e-5, rtol=0)
    dense = flash_attention(q, kv_cache.gather(k_pages, table), kv_cache.gather(v_pages, table),
                            implementation="cpu", **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense), atol=2e-6, rtol=0)


def test_paged_many_query_rows_run_by_the_same_code():
    _, q, k_pages, v_pages, table = _setup(11, lq=40, hq=4, hkv=4, d=8, page_size=8, pages_per_sequence=12)
    kw = dict(is_causal=True, causal_alignment="bottom_right")
    out = flash_attention(q, k_pages, v_pages, page_table=table, **kw)
    np.testing.assert_allclose(np.asarray(out), _oracle(q, k_pages, v_pages, table, **kw), atol=2e-5)


def test_paged_bfloat16_pages():
    _, q, k_pages, v_pages, table = _setup(12, dtype=jnp.bfloat16)
    out = flash_attention(q, k_pages, v_pages, page_table=table)
    up = lambda x: x.astype(jnp.float32)
    expected = _oracle(up(q), up(k_pages), up(v_pages), table)
    assert np.abs(np.asarray(out, np.float64) - expected).max() < 2e-2


@pytest.mark.parametrize("implementation", ["xla", "cpu"])
def test_pages_are_read_in_place(implementation):
    """No cache-shaped array ([..., Hkv, D]) as large as the gathered cache [B, Lk, Hkv, D] in
    the compiled HLO, other than the pages themselves: xla gathers one tile per split and step;
    the C++ kernel receives the pages themselves."""
    b, page_size, per_sequence, hkv, d = 2, 16, 256, 2, 8
    _, q, k_pages, v_pages, table = _setup(0, b=b, lq=16, hq=8, hkv=hkv, d=d, page_size=page_size,
                                           pages_per_sequence=per_sequence)
    call = jax.jit(lambda q, k, v, t: flash_attention(q, k, v, page_table=t, is_causal=True,
                                                      causal_alignment="bottom_right",
                                                      implementation=implementation))
    hlo = call.lower(q, k_pages, v_pages, table).compile().as_text()
    gathered = b * per_sequence * page_size * hkv * d
    sizes = [int(np.prod([int(n) for n in dims.split(",")]))
             for dims in re.findall(rf"(?:f32|bf16)\[([\d,]*,{hkv},{d})\]", hlo)]
    pages = k_pages.size
    assert pages > gathered and pages in sizes
    assert max([n for n in sizes if n != pages], default=0) < gathered, sorted(set(sizes))[-5:]
    assert ("jax_flash_attention_cpu_decode" in hlo) == (implementation == "cpu")


def test_explain_reports_the_decode_path_for_pages():
    """On the CPU a paged call runs on the C++ kernel's decode path; more query rows than its
    decode takes run on xla's, and explain says why."""
    _, q, k_pages, v_pages, table = _setup(1)
    choice = explain_implementation(q, k_pages, v_pages, page_table=table, platform="cpu")
    assert choice.chosen == "cpu" and choice.path == "decode" and choice.reasons["cpu"] is None
    many = jnp.concatenate([q] * 17, axis=1)
    choice = explain_implementation(many, k_pages, v_pages, page_table=table, platform="cpu")
    assert choice.chosen == "xla" and choice.path == "decode"
    assert "17 query rows" in choice.reasons["cpu"]


def test_paged_calls_go_to_the_cpu_kernel():
    """The default CPU paged call lowers to the C++ decode kernel (not xla's gathers)."""
    _, q, k_pages, v_pages, table = _setup(5)
    hlo = jax.jit(lambda q, k, v, t: flash_attention(q, k, v, page_table=t)).lower(
        q, k_pages, v_pages, table).as_text()
    assert "jax_flash_attention_cpu_decode" in hlo


@pytest.mark.parametrize("bad,message", [
    (dict(page_table=jnp.zeros((2, 40), jnp.float32)), "page_table must be integers"),
    (dict(page_table=jnp.zeros((3, 40), jnp.int32)), "page_table.shape"),
    (dict(page_table=jnp.full((2, 40), 500, jnp.int32)), r"page_table ids must lie in \[0, num_pages=87\)"),
    (dict(key_value_seq_lengths=jnp.array([641, 3])), r"key_value_seq_lengths must lie in \[0, 640\]"),
    (dict(bias=jnp.zeros((2, 8, 1, 640))), "bias cannot be used with page_table"),
    (dict(mask=jnp.ones((2, 8, 1, 640), bool)), "mask cannot be used with page_table"),
    (dict(q_segment_ids=jnp.zeros((2, 1), jnp.int32), kv_segment_ids=jnp.zeros((2, 640), jnp.int32)),
     "segment_ids cannot be used"),
    (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "dropout_rate > 0 cannot be used"),
    (dict(query=jnp.ones((2, 17, 8, 16)), implementation="cpu"),
     "implementation='cpu' cannot take page_table: .*17 query rows"),
    (dict(implementation="reference"), "implementation='reference' cannot take page_table"),
    (dict(value=jnp.zeros((87, 16, 2, 8))), "key and value must have the same shape"),
    (dict(key=jnp.zeros((2, 87, 16, 2, 16)), value=jnp.zeros((2, 87, 16, 2, 16))), "key and value are pages"),
])
def test_paged_arguments_are_validated(bad, message):
    _, q, k_pages, v_pages, table = _setup(2)
    args = dict(query=q, key=k_pages, value=v_pages, page_table=table)
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=message):
        flash_attention(args.pop("query"), args.pop("key"), args.pop("value"), **args)


def test_traced_page_ids_and_lengths_are_clamped():
    _, q, k_pages, v_pages, table = _setup(3)
    wild = table.at[0, 5].set(10 ** 6).at[1, 0].set(-4)
    call = jax.jit(lambda t, n: flash_attention(q, k_pages, v_pages, page_table=t, key_value_seq_lengths=n))
    out = call(wild, jnp.array([10 ** 5, 17]))
    clamped = np.clip(np.asarray(wild), 0, k_pages.shape[0] - 1)
    expected = _oracle(q, k_pages, v_pages, clamped, key_value_seq_lengths=jnp.array([640, 17]))
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5)


PAGED_ENTRY_POINTS = {
    "gather": lambda q, k_pages, v_pages, table: kv_cache.gather(k_pages, table),
    "append": lambda q, k_pages, v_pages, table: kv_cache.append(
        k_pages, v_pages, table, jnp.zeros((2,), jnp.int32), k_pages[:2, :1], v_pages[:2, :1]),
    "flash_attention": lambda q, k_pages, v_pages, table: flash_attention(q, k_pages, v_pages, page_table=table),
}


@pytest.mark.parametrize("entry", PAGED_ENTRY_POINTS)
@pytest.mark.parametrize("bad_id", [-1, 87, 10 ** 6])
def test_every_entry_point_refuses_concrete_ids_out_of_range(entry, bad_id):
    """One rule, one message: 0 <= id < num_pages (87 pages here)."""
    _, q, k_pages, v_pages, table = _setup(6)
    with pytest.raises(ValueError, match=r"page_table ids must lie in \[0, num_pages=87\) \(0 <= id < num_pages\)"):
        PAGED_ENTRY_POINTS[entry](q, k_pages, v_pages, table.at[1, 3].set(bad_id))


def test_traced_ids_are_clamped_alike_by_gather_append_and_the_paged_call():
    """Under jit a wild id reads (and is written at) the clamped page in every entry point: a
    gather then a dense call equals the paged call and the float64 oracle with clamped ids, and
    an append lands where both read."""
    _, q, k_pages, v_pages, table = _setup(8)
    wild = table.at[0, 5].set(10 ** 6).at[1, 0].set(-4)
    clamped = np.clip(np.asarray(wild), 0, k_pages.shape[0] - 1)
    expected = _oracle(q, k_pages, v_pages, clamped)
    paged = jax.jit(lambda t: flash_attention(q, k_pages, v_pages, page_table=t))(wild)
    gather = jax.jit(kv_cache.gather)
    dense = jax.jit(lambda t: flash_attention(q, gather(k_pages, t), gather(v_pages, t)))(wild)
    np.testing.assert_allclose(np.asarray(paged), expected, atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(dense), expected, atol=2e-5, rtol=0)

    lengths = jnp.array([5 * 16 + 3, 2])  # row 0 writes into page slot 5, row 1 into slot 0
    new = jnp.asarray(np.random.default_rng(9).standard_normal((2, 4, 2, 16)), jnp.float32)
    k_written, _ = jax.jit(kv_cache.append)(k_pages, v_pages, wild, lengths, new, new)
    read_back = np.asarray(gather(k_written, wild))
    for row in range(2):
        np.testing.assert_array_equal(read_back[row, int(lengths[row]):int(lengths[row]) + 4], new[row])


def test_paged_calls_refuse_gradients():
    _, q, k_pages, v_pages, table = _setup(4)
    with pytest.raises(NotImplementedError, match="forward only"):
        jax.grad(lambda k: flash_attention(q, k, v_pages, page_table=table).sum())(k_pages)
    with pytest.raises(NotImplementedError, match="forward only"):
        jax.grad(lambda q: flash_attention(q, k_pages, v_pages, page_table=table).sum())(q)
    with pytest.raises(NotImplementedError, match="forward only"):  # forward mode too
        jax.jvp(lambda q: flash_attention(q, k_pages, v_pages, page_table=table), (q,), (q,))


# --- The writer ---------------------------------------------------------------------------

def test_append_round_trips():
    """Appends of 1 and 5 tokens at per-row lengths land where gather reads them back; other
    slots are untouched."""
    rng = np.random.default_rng(7)
    b, page_size, per_sequence, hkv, d = 3, 4, 6, 2, 3
    table = kv_cache.make_page_table(b, per_sequence, num_pages=b * per_sequence + 2, key=jax.random.key(7))
    k_pages = kv_cache.init_pages(b * per_sequence + 2, page_size, hkv, d)
    v_pages = kv_cache.init_pages(b * per_sequence + 2, page_size, hkv, d)
    dense_k = np.zeros((b, per_sequence * page_size, hkv, d), np.float32)
    dense_v = np.zeros_like(dense_k)
    lengths = np.array([0, 3, 9])
    append = jax.jit(kv_cache.append)
    for n in (5, 1, 1, 5):
        new_k, new_v = (rng.standard_normal((b, n, hkv, d)).astype(np.float32) for _ in range(2))
        k_pages, v_pages = append(k_pages, v_pages, table, jnp.asarray(lengths), new_k, new_v)
        for row in range(b):
            dense_k[row, lengths[row]:lengths[row] + n] = new_k[row]
            dense_v[row, lengths[row]:lengths[row] + n] = new_v[row]
        lengths = lengths + n
    np.testing.assert_array_equal(np.asarray(kv_cache.gather(k_pages, table)), dense_k)
    np.testing.assert_array_equal(np.asarray(kv_cache.gather(v_pages, table)), dense_v)
    unused = np.setdiff1d(np.arange(k_pages.shape[0]), np.asarray(table))
    assert not np.asarray(k_pages)[unused].any()


def test_append_in_place_under_donation():
    b, page_size, per_sequence, hkv, d = 2, 16, 64, 4, 32
    k_pages = jnp.asarray(np.random.default_rng(0).standard_normal((b * per_sequence, page_size, hkv, d)), jnp.float32)
    v_pages = k_pages + 1
    table = kv_cache.make_page_table(b, per_sequence)
    new = jnp.ones((b, 1, hkv, d))
    append = jax.jit(kv_cache.append, donate_argnums=(0, 1))
    hlo = append.lower(k_pages, v_pages, table, jnp.array([5, 700]), new, new).compile().as_text()
    assert "scatter" in hlo
    shape = f"f32[{','.join(map(str, k_pages.shape))}]"
    assert not [line for line in hlo.splitlines() if " copy(" in line and shape in line]
    pointer = k_pages.unsafe_buffer_pointer()
    k2, _ = append(k_pages, v_pages, table, jnp.array([5, 700]), new, new)
    assert k_pages.is_deleted() and k2.unsafe_buffer_pointer() == pointer


@pytest.mark.parametrize("lengths", [jnp.array([1.7, 0.0]), jnp.array([[1], [0]]), jnp.array([1, 0, 2])],
                         ids=["float", "column", "too_many"])
def test_append_checks_the_type_of_traced_lengths(lengths):
    """dtype and shape are known at trace time: a float or misshapen traced length is refused
    by name, as a concrete one is (not cast: 1.7 would write slot 1)."""
    table = kv_cache.make_page_table(2, 2)
    pages = kv_cache.init_pages(4, 4, 1, 2)
    new = jnp.ones((2, 1, 1, 2))
    for append in (kv_cache.append, jax.jit(kv_cache.append)):
        with pytest.raises(ValueError, match=r"lengths must be int \[batch=2\]; got shape"):
            append(pages, pages, table, lengths, new, new)


def test_append_refuses_concrete_overflow_and_drops_traced():
    table = kv_cache.make_page_table(2, 2)
    pages = kv_cache.init_pages(4, 4, 1, 2)
    new = jnp.ones((2, 3, 1, 2))
    with pytest.raises(ValueError, match=r"lengths \+ n must lie in \[0, 8\]"):
        kv_cache.append(pages, pages, table, jnp.array([0, 6]), new, new)
    with pytest.raises(ValueError, match="page_table ids must lie"):
        kv_cache.append(pages, pages, table.at[0, 0].set(9), jnp.array([0, 0]), new, new)
    k, _ = jax.jit(kv_cache.append)(pages, pages, table, jnp.array([0, 6]), new, new)
    written = np.asarray(kv_cache.gather(k, table))[..., 0, 0]
    np.testing.assert_array_equal(written, [[1, 1, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 1, 1]])
