"""Per-device memory of each context-parallel strategy, compiled (never run).

argv: L [strategies...] -> {"<strategy>_<n>": {bytes: arguments + temporaries per device,
all_gathers, all_to_alls, permutes}} for fwd+bwd, causal, H=8, D=64 fp32, on 1 and 8 devices.
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_impl.flash_attention import flash_attention


def figures(length: int, strategies):
    shape = (1, length, 8, 64)
    out = {}
    for strategy in strategies:
        def grad(q, k, v):
            f = lambda q, k, v: jnp.sum(flash_attention(q, k, v, is_causal=True, implementation="xla",
                                                        context_parallel_strategy=strategy))
            return jax.grad(f, argnums=(0, 1, 2))(q, k, v)

        for n in (1, 8):
            if n == 1 and strategy != strategies[0]:
                continue  # one device: no collective, the same program
            mesh = Mesh(np.array(jax.devices()[:n]), ("seq",))
            arg = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P(None, "seq")))
            compiled = jax.jit(grad).lower(arg, arg, arg).compile()
            m, hlo = compiled.memory_analysis(), compiled.as_text()
            out[f"{'one' if n == 1 else strategy}_{n}"] = dict(
                bytes=m.argument_size_in_bytes + m.temp_size_in_bytes,
                all_gathers=hlo.count("all-gather"), all_to_alls=hlo.count("all-to-all("),
                permutes=hlo.count("collective-permute("))
    return out


if __name__ == "__main__":
    print(json.dumps(figures(int(sys.argv[1]), sys.argv[2:] or ["ring", "all_to_all"])))
