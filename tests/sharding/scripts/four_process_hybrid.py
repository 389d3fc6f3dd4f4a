"""One of four processes ("hosts", 2 CPU devices each) running the hybrid strategy over all 8.

argv: process_id, port. The mesh is (host=4, chip=2), one row per process; q/k/v are sharded
P(None, ("host", "chip")): the sequence over both axes, so flash_attention under plain jit runs
the all-to-all over "chip" (inside a process) and the ring over "host" (across processes, gloo).
Causal GQA with dropout, sinks and kv lengths, forward+backward. Process 0 prints {errors: vs
torch_ref float64 with jax_impl.dropout_mask's pattern, single: max |hybrid - one-device call|,
all_gathers, all_to_alls, permutes} of the compiled program.
"""
import json
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
process_id, port = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=4,
                           process_id=process_id)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from _common import max_errors, problem  # noqa: E402
from ring_features import RATE, _oracle  # noqa: E402
from jax_impl.flash_attention import flash_attention  # noqa: E402

assert jax.device_count() == 8 and jax.local_device_count() == 2
hosts = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
mesh = Mesh(np.array(hosts).reshape(4, 2), ("host", "chip"))
assert all(len({d.process_index for d in row}) == 1 for row in mesh.devices)  # a row = a process

seed = int(multihost_utils.broadcast_one_to_all(np.int32(np.random.SeedSequence().entropy % 2**31)))
arrays, rng = problem(seed, 2, 64, 64, 4, 2, 16)  # the same arrays in every process
arrays["sinks"] = rng.standard_normal((4,)).astype(np.float32)
kwargs = dict(is_causal=True, key_value_seq_lengths=np.array([64, 41], np.int32))
features = dict(dropout_rng=jax.random.key(int(rng.integers(2**31))), dropout_rate=RATE,
                broadcast_dropout=False)
names = ("q", "k", "v", "sinks", "ct")


def loss_and_grads(strategy, implementation):
    def loss(q, k, v, sinks, ct):
        out = flash_attention(q, k, v, attention_sinks=sinks, implementation=implementation,
                              context_parallel_strategy=strategy, **kwargs, **features)
        return jnp.sum(out * ct), out
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


sequence = NamedSharding(mesh, P(None, ("host", "chip")))
replicated = NamedSharding(mesh, P())
global_array = lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])
args = [global_array(arrays[n], replicated if n == "sinks" else sequence) for n in names]
step = loss_and_grads("hybrid", "xla")
hlo = step.lower(*args).compile().as_text()
(_, out), grads = step(*args)
gathered = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in (out,) + grads]

if process_id == 0:
    (_, out_1), grads_1 = loss_and_grads(None, "xla")(*(jnp.asarray(arrays[n]) for n in names))
    ref_out, ref_grads, _ = _oracle(arrays, kwargs, features)
    errors = max_errors(gathered[0], dict(zip(("q", "k", "v", "sinks"), gathered[1:])),
                        ref_out, ref_grads)
    single = max(float(np.max(np.abs(x - np.asarray(y))))
                 for x, y in zip(gathered, (out_1,) + tuple(grads_1)))
    print(json.dumps(dict(errors=errors, single=single, all_gathers=hlo.count("all-gather"),
                          all_to_alls=hlo.count("all-to-all("),
                          permutes=hlo.count("collective-permute"))))
jax.distributed.shutdown()
