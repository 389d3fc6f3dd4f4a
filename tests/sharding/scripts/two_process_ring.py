"""One of two processes (4 CPU devices each) running ring attention over all 8 devices.

argv: process_id, port. Each process checks the gathered result against the float64 oracle
computed locally in one process; process 0 prints the errors.
"""
import json
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
process_id, port = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2,
                           process_id=process_id)

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from _common import max_errors, oracle, problem  # noqa: E402
from jax_impl import ring  # noqa: E402
from jax_impl.context_parallel import ring_attention  # noqa: E402

assert jax.device_count() == 8 and jax.local_device_count() == 4
seed = int(multihost_utils.broadcast_one_to_all(np.int32(np.random.SeedSequence().entropy % 2**31)))
arrays, _ = problem(seed, 1, 64, 64, 2, 1, 16)  # the same arrays in both processes
kwargs = dict(is_causal=True, causal_alignment="bottom_right",
              key_value_seq_lengths=np.array([53], np.int32))
mesh = Mesh(np.array(jax.devices()), ("seq",))
sharding = NamedSharding(mesh, P(None, "seq"))
global_array = lambda x: jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])
zig = {n: np.asarray(ring.to_zigzag(arrays[n], 8, 1)) for n in ("q", "k", "v", "ct")}

body = jax.shard_map(lambda q, k, v, lens: ring_attention(q, k, v, axis_name="seq",
                                                          key_value_seq_lengths=lens,
                                                          is_causal=True, causal_alignment="bottom_right"),
                     mesh=mesh, in_specs=(P(None, "seq"),) * 3 + (P(),), out_specs=P(None, "seq"))


@jax.jit
def step(q, k, v, ct, lens):
    out, vjp = jax.vjp(lambda q, k, v: body(q, k, v, lens), q, k, v)
    return (out,) + vjp(ct)


lens = jax.device_put(kwargs["key_value_seq_lengths"], NamedSharding(mesh, P()))
results = step(*(global_array(zig[n]) for n in ("q", "k", "v", "ct")), lens)
out, dq, dk, dv = (np.asarray(ring.from_zigzag(multihost_utils.process_allgather(x, tiled=True), 8, 1))
                   for x in results)
if process_id == 0:
    ref_out, ref_grads = oracle(arrays, **kwargs)
    print(json.dumps(max_errors(out, dict(q=dq, k=dk, v=dv), ref_out, ref_grads)))
jax.distributed.shutdown()
