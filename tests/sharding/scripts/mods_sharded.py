"""Calls with score_mod, mask_mod and a block_mask on inputs sharded over 8 devices (batch, or
sequence): the one-device answer, what explain says, and a ring refused by name under plain
jit; inside shard_map, ring_attention, ulysses_attention and hybrid_attention with the same
mods give the one-device answer and the gradient of their mod_aux."""
import contextlib
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jax_impl import (create_block_mask, explain_implementation, flash_attention, hybrid_attention,
                      ring, ring_attention, ulysses_attention)

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


def compare(got, want):
    return max(float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())
               for a, b in zip(jax.tree.leaves(got), map(np.asarray, jax.tree.leaves(want))))


# A mesh with explicit axes: the sharding is in the types, and the call runs as one program
# on replicated operands (without it, its ops mixed shardings: a ShardingTypeError); the results
# come back with q's sharding, the gradients with their operands'; the same under set_mesh.
explicit = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
for name, spec in (("explicit_batch", P("x")), ("explicit_sequence", P(None, "x"))):
    put = lambda x: jax.device_put(x, NamedSharding(explicit, spec))
    with jax.sharding.set_mesh(explicit) if name.endswith("sequence") else contextlib.nullcontext():
        out = jax.jit(call)(put(q), put(k), put(v), slopes)
        grads = jax.jit(jax.grad(loss, argnums=(0, 3)))(put(q), put(k), put(v), slopes)
    report[name] = compare((out, grads), want)
    report[name + "_shardings"] = [str(x.sharding.spec) for x in (out, grads[0])]
    report[name + "_want"] = str(P(*spec, *(None,) * (4 - len(spec))))
try:
    put = lambda x: jax.device_put(x, NamedSharding(explicit, P("x")))
    flash_attention(put(q), put(k), put(v), implementation="mosaic_tpu", interpret=True)
    report["explicit_interpreter"] = None
except ValueError as e:
    report["explicit_interpreter"] = str(e)


# Inside shard_map: the strategies give the mods global indices (zigzag ring over 2 devices,
# all-to-all over 4, the hybrid over 2 x 2); mod_aux is replicated, its gradient summed.
mods = dict(score_mod=alibi, mask_mod=documents, block_mask=block_mask)
seq, rep = P(None, "x"), P()
strategies = {
    "ring_attention": (Mesh(np.array(jax.devices()[:2]), ("x",)), seq, 2,
                       lambda q, k, v, s: ring_attention(q, k, v, axis_name="x", mod_aux=(s, doc), **mods)),
    "ulysses_attention": (Mesh(np.array(jax.devices()[:4]), ("x",)), seq, 0,
                          lambda q, k, v, s: ulysses_attention(q, k, v, axis_name="x", mod_aux=(s, doc), **mods)),
    "hybrid_attention": (Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("r", "a")), P(None, ("r", "a")), 0,
                         lambda q, k, v, s: hybrid_attention(q, k, v, all_to_all_axis="a", ring_axis="r",
                                                             mod_aux=(s, doc), **mods)),
}
for name, (submesh, spec, zigzag, local) in strategies.items():
    sharded = jax.shard_map(local, mesh=submesh, in_specs=(spec,) * 3 + (rep,), out_specs=spec)
    order = (lambda x: ring.to_zigzag(x, zigzag, 1)) if zigzag else (lambda x: x)
    back = (lambda x: ring.from_zigzag(x, zigzag, 1)) if zigzag else (lambda x: x)
    strategy_loss = lambda q, k, v, s: (sharded(q, k, v, s) ** 2).sum()
    zq, zk, zv = map(order, (q, k, v))
    out = back(jax.jit(sharded)(zq, zk, zv, slopes))
    dq, ds = jax.jit(jax.grad(strategy_loss, argnums=(0, 3)))(zq, zk, zv, slopes)
    report[name] = compare((out, (back(dq), ds)), want)

# The C++ kernel as the local step: a plain ALiBi with causal masking. The strategies wrap the
# mods so that they see global indices; the choice judges them as wrapped, and the C++ mod
# programs run the wrapper (chosen automatically on the CPU, or by name).
alibi_only = lambda s, b, h, qi, ki, slopes: s - slopes[h] * jnp.abs(qi - ki)
causal = lambda q, k, v, slopes: flash_attention(q, k, v, is_causal=True, score_mod=alibi_only,
                                                 mod_aux=(slopes,), implementation="xla")
want = causal(q, k, v, slopes), jax.grad(lambda *a: (causal(*a) ** 2).sum(), argnums=(0, 3))(q, k, v, slopes)
for implementation in (None, "cpu"):
    for name, function, zigzag in (("ring_attention", ring_attention, 2),
                                   ("ulysses_attention", ulysses_attention, 0)):
        local = lambda q, k, v, s, function=function: function(
            q, k, v, axis_name="x", is_causal=True, score_mod=alibi_only, mod_aux=(s,),
            implementation=implementation)
        submesh = Mesh(np.array(jax.devices()[:2]), ("x",))
        sharded = jax.shard_map(local, mesh=submesh, in_specs=(seq,) * 3 + (rep,), out_specs=seq)
        order = (lambda x: ring.to_zigzag(x, zigzag, 1)) if zigzag else (lambda x: x)
        back = (lambda x: ring.from_zigzag(x, zigzag, 1)) if zigzag else (lambda x: x)
        zq, zk, zv = map(order, (q, k, v))
        out = back(jax.jit(sharded)(zq, zk, zv, slopes))
        dq, ds = jax.jit(jax.grad(lambda *a: (sharded(*a) ** 2).sum(), argnums=(0, 3)))(zq, zk, zv, slopes)
        report[f"alibi_{name}_{implementation}"] = compare((out, (back(dq), ds)), want)
print(json.dumps(report))
