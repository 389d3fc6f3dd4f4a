"""Calls with score_mod, mask_mod and a block_mask on inputs sharded over 8 devices (batch, or
sequence): the one-device answer, what explain says, and a ring refused by name."""
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_impl import create_block_mask, explain_implementation, flash_attention

B, L, H, D = 8, 128, 4, 16
rng = np.random.default_rng()
q, k, v = (rng.standard_normal((B, L, H, D)).astype(np.float32) for _ in range(3))
slopes = rng.uniform(0.05, 0.5, H).astype(np.float32)
doc = np.sort(rng.integers(0, 4, (B, L)), axis=1).astype(np.int32)
alibi = lambda s, b, h, qi, ki, slopes, doc: s - slopes[h] * jnp.abs(qi - ki)
documents = lambda b, h, qi, ki, slopes, doc: (doc[b, qi] == doc[b, ki]) & (ki <= qi)
block_mask = create_block_mask(lambda b, h, qi, ki, doc: documents(b, h, qi, ki, None, doc),
                               B, None, L, L, block_size=32, mod_aux=(doc,))
call = lambda q, k, v, slopes, **kw: flash_attention(
    q, k, v, score_mod=alibi, mask_mod=documents, mod_aux=(slopes, doc), block_mask=block_mask,
    implementation="xla", **kw)
loss = lambda q, k, v, slopes: (call(q, k, v, slopes) ** 2).sum()
want = call(q, k, v, slopes), jax.grad(loss, argnums=(0, 3))(q, k, v, slopes)
mesh = Mesh(np.array(jax.devices()), ("x",))
report = {}
for name, spec in (("batch", P("x")), ("sequence", P(None, "x"))):
    put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
    got = jax.jit(call)(put(q), put(k), put(v), slopes), jax.jit(jax.grad(loss, argnums=(0, 3)))(
        put(q), put(k), put(v), slopes)
    report[name] = max(float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())  # relative
                       for a, b in zip(jax.tree.leaves(got), map(np.asarray, jax.tree.leaves(want))))
    report[name + "_explain"] = explain_implementation(
        put(q), put(k), put(v), score_mod=alibi, mask_mod=documents, mod_aux=(slopes, doc),
        block_mask=block_mask).strategy
try:
    call(jax.device_put(q, NamedSharding(mesh, P(None, "x"))), k, v, slopes,
         context_parallel_strategy="ring")
    report["ring"] = None
except ValueError as e:
    report["ring"] = str(e)
print(json.dumps(report))
