"""Generate text with the tiny LM of ``train_tiny_lm.py`` from a paged KV cache.

Decoding three ways (sampling with the same Gumbel noise each step: token = argmax(logits +
temperature * noise), so an untrained model gives varied text; temperature 0 is greedy), from
the same parameters (untrained by default, or trained for
``--train-steps`` steps with flash_attention):
  paged   each layer's keys/values live in pages ``[num_pages, page_size, H, D]`` addressed by a
          shuffled page table; ``jax_impl.kv_cache.append`` writes them (jitted, the pages
          donated: in place) and ``flash_attention(..., page_table=...)`` reads them;
  dense   the same with a dense cache ``[B, max_len, H, D]`` (``key_value_seq_lengths``);
  flax    no cache: every step reruns the whole prefix through ``TinyLM(attention="default")``,
          Flax's own ``dot_product_attention``.
The prompts have different lengths (per-row lengths in the cache). The script prints the
three generations and exits with status 1 unless they are token for token identical.

    python examples/generate_paged.py [--steps 40] [--page-size 4] [--train-steps 0] [--temperature 1]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

import train_tiny_lm as lm  # noqa: E402
from jax_impl import kv_cache  # noqa: E402
from jax_impl.flash_attention import flash_attention  # noqa: E402

PROMPTS = ("The ", "Attention is al")


# --- The model's layers, applied one position at a time from its parameters ----------------

def _dense(params, x, features, axis=-1):
    return nn.DenseGeneral(features, axis=axis).apply({"params": params}, x)


def _layer_norm(params, x):
    return nn.LayerNorm().apply({"params": params}, x)


def _step(cfg, params, tokens, positions, attend, caches):
    """The model on new tokens ``[B, n]`` at ``positions`` ``[B, n]``: each layer's new keys and
    values go to its cache and its queries read it (``attend(layer, q, k, v, caches)`` ->
    (out, caches)). Returns (logits [B, n, vocab], caches)."""
    heads = cfg.num_heads
    head_dim = cfg.d_model // heads
    embedding = params["embed"]["embedding"]
    x = embedding[tokens] + params["positions"][positions]
    for i in range(cfg.num_layers):
        p = params[f"block_{i}"]
        h = _layer_norm(p["ln_attn"], x)
        q, k, v = (_dense(p["attn"][name], h, (heads, head_dim)) for name in ("query", "key", "value"))
        o, caches = attend(i, q, k, v, caches)
        x = x + _dense(p["attn"]["out"], o, cfg.d_model, axis=(-2, -1))
        h = _layer_norm(p["ln_mlp"], x)
        x = x + _dense(p["mlp_out"], nn.gelu(_dense(p["mlp_in"], h, cfg.mlp_ratio * cfg.d_model)), cfg.d_model)
    return _layer_norm(params["ln_final"], x) @ embedding.T, caches


# --- Attention against a cache ---------------------------------------------------------------

@functools.partial(jax.jit, donate_argnums=(0, 1))
def _append_pages(k_pages, v_pages, table, lengths, k, v):
    return kv_cache.append(k_pages, v_pages, table, lengths, k, v)


def paged_attention(table, lengths, q_lengths):
    """attend(): append at ``lengths``, then attend to ``lengths + new`` keys in pages."""
    def attend(layer, q, k, v, caches):
        k_pages, v_pages = caches[layer]
        k_pages, v_pages = _append_pages(k_pages, v_pages, table, lengths, k, v)
        out = flash_attention(q, k_pages, v_pages, page_table=table, is_causal=True,
                              causal_alignment="bottom_right", query_seq_lengths=q_lengths,
                              key_value_seq_lengths=lengths + q_lengths)
        return out, caches[:layer] + [(k_pages, v_pages)] + caches[layer + 1:]
    return attend


def dense_attention(lengths, q_lengths):
    def attend(layer, q, k, v, caches):
        k_cache, v_cache = caches[layer]
        write = jax.vmap(lambda cache, new, at: jax.lax.dynamic_update_slice_in_dim(cache, new, at, 0))
        k_cache, v_cache = write(k_cache, k, lengths), write(v_cache, v, lengths)
        out = flash_attention(q, k_cache, v_cache, is_causal=True, causal_alignment="bottom_right",
                              query_seq_lengths=q_lengths, key_value_seq_lengths=lengths + q_lengths)
        return out, caches[:layer] + [(k_cache, v_cache)] + caches[layer + 1:]
    return attend


# --- Generation ------------------------------------------------------------------------------

def prompt_batch(vocab, prompts=PROMPTS):
    ids = lm.encode(list(prompts), vocab)
    lengths = np.array([len(x) for x in ids], np.int32)
    tokens = np.full((len(ids), lengths.max()), lm.PAD, np.int32)
    for row, x in enumerate(ids):
        tokens[row, :len(x)] = x
    return tokens, lengths


def gumbel_noise(steps, batch, vocab_size, temperature, seed=0):
    """The per-step sampling noise ``[steps, B, vocab]`` every method adds to its logits."""
    noise = np.random.default_rng(seed).gumbel(size=(steps, batch, vocab_size)).astype(np.float32)
    return temperature * noise


def generate_cached(cfg, params, tokens, lengths, noise, *, page_size=None, seed=0):
    """Tokens ``[B, steps]``: prefill the prompts in one call, then one token a step."""
    steps = noise.shape[0]
    b, prompt = tokens.shape
    heads, head_dim = cfg.num_heads, cfg.d_model // cfg.num_heads
    max_len = prompt + steps
    if page_size:
        per_sequence = -(-max_len // page_size)
        num_pages = b * per_sequence + 5
        table = kv_cache.make_page_table(b, per_sequence, num_pages=num_pages, key=jax.random.key(seed))
        empty = lambda: kv_cache.init_pages(num_pages, page_size, heads, head_dim)
        attention = lambda lengths, n: paged_attention(table, lengths, n)
    else:
        empty = lambda: jnp.zeros((b, max_len, heads, head_dim))
        attention = dense_attention
    caches = [(empty(), empty()) for _ in range(cfg.num_layers)]
    step = jax.jit(lambda params, tokens, positions, lengths, n, caches: _step(
        cfg, params, tokens, positions, attention(lengths, n), caches))

    zeros = jnp.zeros((b,), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(prompt), (b, prompt))
    logits, caches = step(params, jnp.asarray(tokens), positions, zeros, jnp.asarray(lengths), caches)
    lengths = jnp.asarray(lengths)
    token = jnp.argmax(logits[jnp.arange(b), lengths - 1] + noise[0], axis=-1)
    out = [token]
    for i in range(1, steps):
        logits, caches = step(params, token[:, None], lengths[:, None], lengths, jnp.ones((b,), jnp.int32), caches)
        lengths = lengths + 1
        token = jnp.argmax(logits[:, 0] + noise[i], axis=-1)
        out.append(token)
    return np.stack([np.asarray(t) for t in out], axis=1)


def generate_flax(cfg, params, vocab_size, tokens, lengths, noise):
    """Tokens with no cache: the whole prefix through Flax's own attention each step."""
    model = lm.TinyLM(cfg, vocab_size, attention="default")
    b = tokens.shape[0]
    buffer = np.full((b, cfg.seq_len), lm.PAD, np.int32)
    buffer[:, :tokens.shape[1]] = tokens
    lengths = np.array(lengths)
    apply = jax.jit(lambda params, t, s: model.apply({"params": params}, t, s))
    out = []
    for i in range(noise.shape[0]):
        segments = (np.arange(cfg.seq_len)[None] < lengths[:, None]).astype(np.int32)
        logits = np.asarray(apply(params, buffer, segments))
        token = (logits[np.arange(b), lengths - 1] + noise[i]).argmax(-1)
        buffer[np.arange(b), lengths] = token
        lengths = lengths + 1
        out.append(token)
    return np.stack(out, axis=1)


def run(steps=40, page_size=4, train_steps=0, temperature=1.0, cfg=None, seed=0) -> dict:
    cfg = cfg or dataclasses.replace(lm.Config(), seed=seed)
    documents = lm.load_documents()
    vocab = lm.build_vocab(documents)
    params = lm.init_params(cfg, len(vocab))
    if train_steps:
        batches = lm.pack_batches(lm.encode(documents, vocab), cfg, steps=train_steps)
        params = lm.train(cfg, len(vocab), params, batches, "flash", progress=False)["params"]
    tokens, lengths = prompt_batch(vocab)
    if lengths.max() + steps > cfg.seq_len:
        raise ValueError(f"prompt + steps = {lengths.max() + steps} exceeds seq_len={cfg.seq_len}")
    noise = gumbel_noise(steps, len(tokens), len(vocab), temperature, seed)
    generated = {
        "paged": generate_cached(cfg, params, tokens, lengths, noise, page_size=page_size, seed=seed),
        "dense": generate_cached(cfg, params, tokens, lengths, noise),
        "flax": generate_flax(cfg, params, len(vocab), tokens, lengths, noise),
    }
    text = {name: ["".join(vocab[t] for t in row) for row in ids] for name, ids in generated.items()}
    identical = all(np.array_equal(generated["flax"], ids) for ids in generated.values())
    return dict(generated=generated, text=text, identical=identical)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--page-size", type=int, default=4)
    parser.add_argument("--train-steps", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args(argv)
    result = run(args.steps, args.page_size, args.train_steps, args.temperature)
    for name, rows in result["text"].items():
        for prompt, row in zip(PROMPTS, rows):
            print(f"{name:>5}: {prompt!r} -> {row!r}")
    print("token for token identical" if result["identical"] else "GENERATIONS DIFFER")
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
