"""explain_implementation(...).strategy for sharded inputs on 8 devices: its plan as data
(partitioned.Strategy's attributes), None for unsharded inputs."""
import json

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_impl import explain_implementation

grid = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
line = Mesh(np.array(jax.devices()), ("seq",))
rng = np.random.default_rng()
put = lambda mesh, spec: jax.device_put(rng.standard_normal((2, 64, 8, 16)).astype(np.float32),
                                        NamedSharding(mesh, spec))
explain = lambda mesh, spec, **kw: vars(explain_implementation(
    put(mesh, spec), put(mesh, spec), put(mesh, spec), **kw).strategy)
print(json.dumps({
    "batch_heads": explain(grid, P("data", None, "model"), implementation="xla"),
    "sequence": explain(line, P(None, "seq"), implementation="xla"),
    "sequence_ring": explain(line, P(None, "seq"), implementation="xla",
                             context_parallel_strategy="ring"),
    "sequence_pallas": explain(line, P(None, "seq"), implementation="pallas_triton",
                               interpret=True, context_parallel_strategy="ring"),
    "sequence_bias": explain(line, P(None, "seq"), implementation="xla",
                             bias=rng.standard_normal((1, 1, 64, 64)).astype(np.float32)),
    "sequence_bias_per_head": explain(line, P(None, "seq"), implementation="xla",
                                      bias=rng.standard_normal((2, 8, 64, 64)).astype(np.float32)),
    "sequence_two_axes": explain(grid, P(None, ("data", "model")), implementation="xla"),
    "head_dim": explain(line, P(None, None, None, "seq"), implementation="xla"),
    "unsharded": explain_implementation(*(rng.standard_normal((2, 8, 2, 16)).astype(np.float32)
                                          for _ in range(3))).strategy,
}))
