"""The fused CPU kernel's tile classes (EMPTY / PARTIAL / FULL per tile of its own grid): packed
documents judged against the float64 oracle where most tiles are EMPTY or FULL, and the kernels
shown to act on the classes they are given (an EMPTY tile skipped, a FULL tile not masked).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import cpu_fuzz
from conformance import tolerance
from jax_impl import cpu_kernel, masking
from jax_impl.config import AttentionConfig, BlockSizes
from _flash_helpers import torch_arrays

EMPTY, PARTIAL, FULL = cpu_fuzz.EMPTY, cpu_fuzz.PARTIAL, cpu_fuzz.FULL


def _normal(rng, q_shape, kv_shape, d_out_shape):
    """Random float32 q, k, v, d_out."""
    shapes = (q_shape, kv_shape, kv_shape, d_out_shape)
    return (rng.standard_normal(shape).astype(np.float32) for shape in shapes)


def _documents(length: int, *starts):
    """Segment ids ``[B, length]`` int32: per batch row, documents starting at 0 and ``starts``."""
    return np.stack([np.searchsorted(cuts, np.arange(length), side="right")
                     for cuts in starts]).astype(np.int32)


@pytest.mark.parametrize("dropout", [None, (0.3, False)], ids=["no_dropout", "dropout"])
def test_packed_documents_at_small_tiles_match_the_float64_oracle(dropout):
    """Packed documents (cpu_fuzz's packed_tiles family: 8, or with dropout 3, per row), causal
    inside, lengths, GQA, sinks (and dropout): forward and gradients at 16 x 64 tiles, where
    most tiles are EMPTY, many FULL, the documents' edges PARTIAL."""
    config = cpu_fuzz.Config(b=2, lq=700, lk=700, hq=4, hkv=2, d=16, dtype="float32",
                             causal="top_left", lengths="concrete", segments=True,
                             block_sizes=(16, 64), sinks=True, dropout=dropout)
    call = cpu_fuzz.make_call("packed_tiles", config, seed=11, index=0)
    call.q_len, call.kv_len = np.array([700, 611], np.int32), np.array([653, 700], np.int32)
    classes = cpu_fuzz.tile_classes_of(cpu_fuzz.allowed_pattern(call), 16, 64)
    counts = np.bincount(classes.ravel(), minlength=3)
    assert counts[EMPTY] > 2 * counts[FULL] > 0 and counts[PARTIAL] > 0, counts
    results = cpu_fuzz.Runner("cpu").run(call)
    problems = cpu_fuzz.judge(call, results, *cpu_fuzz.references(call))
    assert not problems, problems


def test_the_kernels_act_on_the_tile_classes_they_are_given(monkeypatch):
    """Tile classes that differ from the pairs' rules, per batch row and head: the forward and
    the backward (its own call, same grid) exclude every pair of an EMPTY tile, attend every pair
    of a FULL tile unmasked (its segment ids would exclude some), and mask PARTIAL tiles per pair:
    the result is the oracle's for the pattern the classes describe."""
    b, length, hq, hkv, d, block_q, block_k = 2, 300, 2, 1, 16, 32, 64
    rng = np.random.default_rng(7)
    q, k, v, d_out = _normal(rng, (b, length, hq, d), (b, length, hkv, d), (b, length, hq, d))
    segments = _documents(length, [70, 150, 210], [40, 180])
    pos = np.arange(length)
    same_document = segments[:, :, None] == segments[:, None, :]
    rules = ((pos[None, :] <= pos[:, None])[None] & same_document)[:, None].repeat(hq, 1)
    classes = cpu_fuzz.tile_classes_of(rules, block_q, block_k)
    nq, nk = classes.shape[-2:]
    below_diagonal = (np.arange(nk)[None, :] + 1) * block_k <= np.arange(nq)[:, None] * block_q
    expected = rules.copy()
    for bh in np.ndindex(b, hq):
        visited = np.argwhere(classes[bh] != EMPTY)
        mixed = np.argwhere((classes[bh] == PARTIAL) & below_diagonal)  # causal-whole, ids mixed
        assert len(mixed) >= 2 and len(visited) >= 6
        for i, j in visited[rng.choice(len(visited), 3, replace=False)]:
            classes[bh][i, j] = EMPTY
            expected[bh][i * block_q:(i + 1) * block_q, j * block_k:(j + 1) * block_k] = False
        for i, j in mixed[rng.choice(len(mixed), 2, replace=False)]:
            if classes[bh][i, j] == PARTIAL:  # not just emptied
                classes[bh][i, j] = FULL
                expected[bh][i * block_q:(i + 1) * block_q, j * block_k:(j + 1) * block_k] = True
    monkeypatch.setattr(cpu_kernel, "_tile_classes", lambda *args: jnp.asarray(classes, jnp.int8))

    cfg = AttentionConfig(scale=0.3, mask=masking.MaskSpec(is_causal=True),
                          block_sizes=BlockSizes(block_q=block_q, block_k=block_k))
    full = jnp.full((b,), length, jnp.int32)
    masks = masking.MaskInputs(full, full, jnp.asarray(segments), jnp.asarray(segments), None)
    out, stats = cpu_kernel.forward(cfg, q, k, v, None, masks)
    delta = jnp.swapaxes(jnp.sum(out * d_out, axis=-1), 1, 2)  # [B, Hq, Lq]
    dq, dk, dv, _ = cpu_kernel.backward(cfg, q, k, v, None, masks, stats, d_out, delta)[:4]
    results = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    reference = torch_arrays(q, k, v, d_out, mask=expected, scale=0.3)
    plain = torch_arrays(q, k, v, d_out, dtype=np.float32, mask=expected, scale=0.3)
    for name, value in results.items():
        verdict = tolerance.judge(name, np.asarray(value, np.float64), reference[name], plain[name],
                                  "float32")
        assert verdict.passed, (name, verdict)


