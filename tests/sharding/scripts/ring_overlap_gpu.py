"""Does XLA:GPU overlap the ring's sends with each step's compute? Compile for 8 H100s without a GPU.

Needs jax >= 0.11 with its CUDA plugin: ``jax.experimental.topologies.get_topology_desc`` with
``tools/gpu_targets/h100_sxm.txtpb`` gives compile-only devices (a 1x1x8 topology); the
ring (bf16, causal, local kernel ``xla``), forward+backward, is compiled for them and the
scheduled HLO read. argv: "shard_map" (ring_attention) or "jit" (flash_attention on
P(None, "seq") inputs). Prints {bodies: [{name, starts, dones, compute, sync_permutes}]}: for
every while body holding a collective-permute and the step's compute (a conditional per chunk
pair), the positions in the schedule of its permute starts and dones and of the conditionals.
"""
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from ring_overlap import computations  # noqa: E402
from jax_impl.context_parallel import ring_attention  # noqa: E402
from jax_impl.flash_attention import flash_attention  # noqa: E402

TARGET = Path(__file__).resolve().parents[3] / "tools" / "gpu_targets" / "h100_sxm.txtpb"


def compiled_hlo(mode: str, length: int = 4096) -> str:
    devices = topologies.get_topology_desc(platform="cuda", target_config=TARGET.read_text(),
                                           topology="1x1x8").devices
    mesh = Mesh(np.array(devices), ("seq",))
    shape = jax.ShapeDtypeStruct((1, length, 8, 64), jnp.bfloat16,
                                 sharding=NamedSharding(mesh, P(None, "seq")))
    if mode == "jit":
        attend = lambda q, k, v: flash_attention(q, k, v, is_causal=True, implementation="xla",
                                                 context_parallel_strategy="ring")
    else:
        attend = jax.shard_map(
            lambda q, k, v: ring_attention(q, k, v, axis_name="seq", is_causal=True,
                                           implementation="xla"),
            mesh=mesh, in_specs=(P(None, "seq"),) * 3, out_specs=P(None, "seq"))
    loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile().as_text()


def schedule_report(hlo: str) -> dict:
    """A compiled (scheduled) module prints each computation's instructions in schedule order."""
    bodies = []
    for name, comp in computations(hlo).items():
        order = list(comp.items())
        at = lambda opcode: [i for i, (_, (op, _)) in enumerate(order) if op == opcode]
        starts, compute = at("collective-permute-start"), at("conditional")
        if (starts or at("collective-permute")) and compute:
            bodies.append(dict(name=name, starts=starts, dones=at("collective-permute-done"),
                               compute=compute, sync_permutes=len(at("collective-permute"))))
    return dict(bodies=bodies, jax=jax.__version__)


if __name__ == "__main__":
    print(json.dumps(schedule_report(compiled_hlo(sys.argv[1]))))
