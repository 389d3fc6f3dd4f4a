"""Sharded suite: per-device memory and collectives of the compiled program vs device count.

At fixed L (default 32768, H=8, D=64 fp32, causal), for 1, 2, 4, 8 devices and each sharding
(sequence: the ring; batch x heads: local), compiles flash_attention's forward and fwd+bwd
under plain jit (never runs them) and records ``compiled.memory_analysis()`` (arguments +
temporaries per device) and the collectives in ``compiled.as_text()``. Needs the devices:
on a CPU host run with XLA_FLAGS=--xla_force_host_platform_device_count=8.

    python -m benchmarks.sharded --out results/sharded   # writes sharded.json and sharded.md
"""
from __future__ import annotations

import argparse
import json
import pathlib

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


def measure(length: int = 32768, heads: int = 8, head_dim: int = 64, batch: int = 1,
            devices=(1, 2, 4, 8)) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jax_impl.flash_attention import flash_attention

    attend = lambda q, k, v: flash_attention(q, k, v, is_causal=True, implementation="xla")
    grad = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v)), argnums=(0, 1, 2))
    rows = []
    for n in devices:
        if n > jax.device_count():
            continue
        for layout, spec, shape in (
                ("sequence", P(None, "x"), (batch, length, heads, head_dim)),
                ("heads", P(None, None, "x"), (batch, length // 4, heads, head_dim))):
            mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
            arg = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
            for program, fn in (("forward", attend), ("forward_backward", grad)):
                compiled = jax.jit(fn).lower(arg, arg, arg).compile()
                memory = compiled.memory_analysis()
                hlo = compiled.as_text()
                rows.append(dict(
                    devices=n, sharding=layout, program=program, shape=list(shape),
                    per_device_mib=(memory.argument_size_in_bytes + memory.temp_size_in_bytes) / 2**20,
                    collectives={c: hlo.count(c + "(") + hlo.count(c + "-start(") for c in COLLECTIVES}))
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| sharding | program | devices | shape | args+temps per device (MiB) | collectives |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        coll = ", ".join(f"{k} {v}" for k, v in r["collectives"].items() if v) or "none"
        lines.append(f"| {r['sharding']} | {r['program']} | {r['devices']} | {r['shape']} | "
                     f"{r['per_device_mib']:.1f} | {coll} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--out", default="benchmarks/results/sharded")
    args = parser.parse_args(argv)
    rows = measure(length=args.length)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharded.json").write_text(json.dumps(rows, indent=1))
    (out / "sharded.md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
