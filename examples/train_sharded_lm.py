"""A tiny causal LM trained on a (data, seq) mesh of 8 virtual CPU devices under plain jit.

Tokens are sharded over batch ("data") and sequence ("seq"); flash_attention sees
sequence-sharded q/k/v and runs context-parallel over "seq": 4 heads over 4 devices, so the
cost model picks the all-to-all (Ulysses) over the ring (see docs/many_devices.md). The same
steps run on one device; the losses are printed side by side and must match.

    python examples/train_sharded_lm.py
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jax_impl.flash_attention import flash_attention  # noqa: E402

VOCAB, WIDTH, HEADS, HEAD_DIM, BATCH, LENGTH, STEPS, LR = 64, 64, 4, 16, 4, 64, 5, 0.5


def init(key):
    keys = jax.random.split(key, 4)
    normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])
    return dict(embed=normal(keys[0], (VOCAB, WIDTH)),
                qkv=normal(keys[1], (WIDTH, 3, HEADS, HEAD_DIM)),
                proj=normal(keys[2], (HEADS * HEAD_DIM, WIDTH)),
                unembed=normal(keys[3], (WIDTH, VOCAB)))


def loss(params, tokens, constrain):
    x = params["embed"][tokens[:, :-1]]                                 # [B, L, W]
    q, k, v = constrain(jnp.einsum("blw,wthd->tblhd", x, params["qkv"]))
    attended = flash_attention(q, k, v, is_causal=True, implementation="xla")
    x = x + attended.reshape(*attended.shape[:2], -1) @ params["proj"]
    logits = x @ params["unembed"]
    targets = jax.nn.one_hot(tokens[:, 1:], VOCAB)
    return -jnp.mean(jnp.sum(targets * jax.nn.log_softmax(logits), axis=-1))


def train(tokens, params, constrain):
    @jax.jit
    def step(params, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens, constrain)
        return jax.tree.map(lambda p, g: p - LR * g, params, grads), value

    hlo = step.lower(params, tokens).compile().as_text()
    permutes, all_to_alls = hlo.count("collective-permute("), hlo.count("all-to-all(")
    print(f"compiled step: {permutes + all_to_alls} context-parallel collectives ({permutes} "
          f"collective-permutes, {all_to_alls} all-to-alls), {hlo.count('all-gather')} all-gathers")
    losses = []
    for _ in range(STEPS):
        params, value = step(params, tokens)
        losses.append(float(value))
    return losses


def main():
    rng = np.random.default_rng(0)
    # LENGTH + 1 tokens: inputs and shifted targets are LENGTH long.
    tokens = rng.integers(0, VOCAB, (BATCH, LENGTH + 1)).astype(np.int32)
    params = init(jax.random.key(0))
    single = train(jnp.asarray(tokens), params, lambda x: x)

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "seq"))
    # Place the activations' sequence axis on "seq": [3, B, L, H, D].
    qkv_sharding = NamedSharding(mesh, P(None, "data", "seq", None, None))
    constrain = lambda x: jax.lax.with_sharding_constraint(x, qkv_sharding)
    sharded = train(jax.device_put(tokens, NamedSharding(mesh, P("data", None))),
                    jax.device_put(params, NamedSharding(mesh, P())), constrain)
    for i, (a, b) in enumerate(zip(single, sharded)):
        print(f"step {i}: one device {a:.6f}   data=2 x seq=4 {b:.6f}   |diff| {abs(a - b):.2e}")
    assert np.allclose(single, sharded, rtol=1e-5, atol=1e-5), (single, sharded)


if __name__ == "__main__":
    main()
