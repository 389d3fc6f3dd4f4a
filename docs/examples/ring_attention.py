"""Ring attention inside ``jax.shard_map`` on 4 virtual CPU devices, checked against the same
call on one device. On GPUs, drop the XLA flag: the mesh is built from ``jax.devices()``.

    python docs/examples/ring_attention.py
"""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")  # before jax starts

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from jax_impl import flash_attention, ring, ring_attention  # noqa: E402

B, L, H, D = 1, 256, 2, 16
kq, kk, kv = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(key, (B, L, H, D)) for key in (kq, kk, kv))

mesh = Mesh(np.array(jax.devices()), ("seq",))
n = mesh.shape["seq"]
# Zigzag layout: device r holds chunks r and 2n-1-r of 2n, so causal work is equal everywhere.
qz, kz, vz = (ring.to_zigzag(x, n, axis=1) for x in (q, k, v))


@jax.jit
@jax.shard_map(mesh=mesh, in_specs=(P(None, "seq"),) * 3, out_specs=P(None, "seq"))
def attend(q, k, v):
    return ring_attention(q, k, v, axis_name="seq", is_causal=True)


out = ring.from_zigzag(attend(qz, kz, vz), n, axis=1)
one_device = flash_attention(q, k, v, is_causal=True, implementation="xla")
error = float(np.abs(np.asarray(out) - np.asarray(one_device)).max())
print(f"ring over {n} devices vs one device: max |difference| = {error:.1e}")
assert error < 1e-5
