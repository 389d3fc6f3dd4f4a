"""Can XLA overlap the ring's transfers with its compute? Read off the compiled HLO.

argv: "jit" (flash_attention fwd+bwd on P(None, "seq") inputs, 8 devices) or "shard_map"
(ring_attention). Prints {async_starts, async_dones, sync_permutes, bodies: [{permutes,
independent, compute}]}: for every while body that holds both a collective-permute and the
ring step's compute (its lax.cond per chunk pair), how many permutes neither depend on that
compute nor feed it (so a latency-hiding scheduler may run them during it).
"""
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_impl.context_parallel import ring_attention
from jax_impl.flash_attention import flash_attention

COMPUTE = {"conditional", "while", "custom-call", "dot", "call", "convolution"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")


def _operands(rest: str):
    depth, end = 1, 0
    for end, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


def computations(hlo: str):
    """{computation name: {instruction: (opcode, operand names)}}."""
    comps, current = {}, None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            current = comps.setdefault(line.split()[0].lstrip("%"), {})
        elif line.startswith("}"):
            current = None
        elif current is not None:
            m = _INSTRUCTION.match(line)
            if m:
                current[m.group(1)] = (m.group(3), _operands(m.group(4)))
    return comps


def _closure(start, edges):
    seen, stack = set(), [start]
    while stack:
        for nxt in edges.get(stack.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def overlap_report(hlo: str):
    bodies = []
    for comp in computations(hlo).values():
        permutes = [n for n, (op, _) in comp.items() if op.startswith("collective-permute")]
        compute = {n for n, (op, _) in comp.items() if op in COMPUTE}
        if not permutes or not any(comp[n][0] == "conditional" for n in compute):
            continue
        parents = {n: [o for o in ops if o in comp] for n, (_, ops) in comp.items()}
        children = {}
        for n, ops in parents.items():
            for o in ops:
                children.setdefault(o, []).append(n)
        independent = sum(1 for p in permutes
                          if not (_closure(p, parents) | _closure(p, children)) & compute)
        bodies.append(dict(permutes=len(permutes), independent=independent, compute=len(compute)))
    return dict(async_starts=hlo.count("collective-permute-start"),
                async_dones=hlo.count("collective-permute-done"),
                sync_permutes=len(re.findall(r" collective-permute\(", hlo)), bodies=bodies)


def compiled_hlo(mode: str) -> str:
    mesh = Mesh(np.array(jax.devices()), ("seq",))
    shape = jax.ShapeDtypeStruct((1, 128, 2, 16), jnp.float32,
                                 sharding=NamedSharding(mesh, P(None, "seq")))
    if mode == "jit":
        attend = lambda q, k, v: flash_attention(q, k, v, is_causal=True, implementation="xla")
    else:
        attend = jax.shard_map(
            lambda q, k, v: ring_attention(q, k, v, axis_name="seq", is_causal=True,
                                           implementation="xla"),
            mesh=mesh, in_specs=(P(None, "seq"),) * 3, out_specs=P(None, "seq"))
    loss = lambda q, k, v: jnp.sum(attend(q, k, v) ** 2)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile().as_text()


if __name__ == "__main__":
    print(json.dumps(overlap_report(compiled_hlo(sys.argv[1]))))
