"""Masks and score functions: ALiBi as a ``score_mod``, packed documents as a ``mask_mod`` with a
``BlockMask``, each checked against the same rule written densely in numpy.

    python docs/examples/masks_and_scores.py
"""
import jax
import jax.numpy as jnp
import numpy as np

from jax_impl import create_block_mask, flash_attention

B, L, H, D = 2, 128, 2, 16
kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(kq, (B, L, H, D))
k = jax.random.normal(kk, (B, L, H, D))
v = jax.random.normal(kv, (B, L, H, D))
slopes = 2.0 ** -jnp.arange(1, H + 1, dtype=jnp.float32)  # ALiBi: one slope per head


def alibi(score, b, h, q_idx, kv_idx, slopes):
    # Elementwise: the indices broadcast against the score; index mod_aux with them.
    return score - slopes[h] * jnp.abs(q_idx - kv_idx)


# Packed documents: a key is visible inside its own document only, causally.
doc = jnp.sort(jax.random.randint(kd, (B, L), 0, 4), axis=1)


def documents(b, h, q_idx, kv_idx, doc):
    return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)


out_alibi = flash_attention(q, k, v, score_mod=alibi, mod_aux=(slopes,))
block_mask = create_block_mask(documents, B, None, L, L, block_size=32, mod_aux=(doc,))
out_docs = flash_attention(q, k, v, mask_mod=documents, mod_aux=(doc,), block_mask=block_mask)
print("tiles skipped:", float(block_mask.sparsity()))

# The same two rules, dense, in float64 numpy.
qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
logits = np.einsum("bqhd,bkhd->bhqk", qn, kn) / np.sqrt(D)
i, j = np.arange(L)[:, None], np.arange(L)[None, :]


def dense(logits, allowed):
    logits = np.where(allowed, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), vn)


expected_alibi = dense(logits - np.asarray(slopes)[None, :, None, None] * np.abs(i - j), True)
d = np.asarray(doc)
expected_docs = dense(logits, (d[:, None, :, None] == d[:, None, None, :]) & (j <= i))
for name, out, expected in (("alibi", out_alibi, expected_alibi),
                            ("documents", out_docs, expected_docs)):
    error = float(np.abs(np.asarray(out, np.float64) - expected).max())
    print(f"{name}: max |error| vs float64 = {error:.1e}")
    assert error < 1e-4, name
