"""Sharded suite: per-device memory and collectives of the compiled program vs device count.

At fixed L (default 32768, H=8, D=64 fp32, causal), for 1, 2, 4, 8 devices and each sharding
(sequence: the ring; heads: local), compiles flash_attention's forward and fwd+bwd under plain
jit (never runs them) and records ``compiled.memory_analysis()`` (arguments + temporaries per
device) and the collectives in ``compiled.as_text()``. The local kernel is ``xla`` on a CPU
host (the Pallas interpreter's memory says nothing about the kernel) and the default (the
Pallas kernels) on a GPU. Step times vs devices need several GPUs: not measured here.

    python -m benchmarks --suite sharded [--out DIR | --update-reference]

On a CPU host the measurement runs in a subprocess with 8 virtual devices (the device count
is fixed when XLA starts); ``python -m benchmarks.sharded --out DIR`` is that subprocess.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
CPU_DEVICES = 8
NAME = "bench_sharded"


def measure(length: int = 32768, heads: int = 8, head_dim: int = 64, batch: int = 1,
            devices=(1, 2, 4, 8), implementation: str | None = "xla") -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jax_impl.flash_attention import flash_attention

    attend = lambda q, k, v: flash_attention(q, k, v, is_causal=True, implementation=implementation)
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


def markdown(rows: list[dict], env: dict | None = None) -> str:
    lines = []
    if env:
        lines += ["# Sharded suite: per-device memory and collectives vs devices", ""]
        lines += [f"- {k}: {v}" for k, v in env.items()] + [""]
    lines += ["| sharding | program | devices | shape | args+temps per device (MiB) | vs 1 device | collectives |",
              "|---|---|---|---|---|---|---|"]
    one = {(r["sharding"], r["program"]): r["per_device_mib"] for r in rows if r["devices"] == 1}
    for r in rows:
        coll = ", ".join(f"{k} {v}" for k, v in r["collectives"].items() if v) or "none"
        base = one.get((r["sharding"], r["program"]))
        ratio = f"{r['per_device_mib'] / base:.2f}x" if base else "n/a"
        lines.append(f"| {r['sharding']} | {r['program']} | {r['devices']} | {r['shape']} | "
                     f"{r['per_device_mib']:.1f} | {ratio} | {coll} |")
    return "\n".join(lines) + "\n"


def write(out: pathlib.Path, rows: list[dict], env: dict) -> list[pathlib.Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{NAME}.json", out / f"{NAME}.md"]
    paths[0].write_text(json.dumps(dict(environment=env, rows=rows), indent=1))
    paths[1].write_text(markdown(rows, env))
    return paths


def _measure_and_write(out: pathlib.Path, length: int, implementation: str | None) -> list[pathlib.Path]:
    import jax
    start = time.perf_counter()
    rows = measure(length=length, implementation=implementation)
    env = dict(command="python -m benchmarks --suite sharded", jax=jax.__version__,
               devices=f"{jax.device_count()} x {jax.devices()[0].device_kind}",
               implementation=implementation or "default (pallas_triton on a GPU)",
               seconds=round(time.perf_counter() - start, 1),
               note="compiled, never run: memory_analysis() arguments + temporaries per device; "
                    "step time vs devices needs several GPUs and is not measured")
    paths = write(out, rows, env)
    print(markdown(rows))
    return paths


def run_suite(out_dir, device: str, length: int = 32768) -> list[pathlib.Path]:
    """``python -m benchmarks --suite sharded``: writes bench_sharded.json and .md to out_dir."""
    out_dir = pathlib.Path(out_dir)
    if device != "cpu":
        return _measure_and_write(out_dir, length, None)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={CPU_DEVICES}").strip()
    root = pathlib.Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    subprocess.run([sys.executable, "-m", "benchmarks.sharded", "--out", str(out_dir),
                    "--length", str(length)], env=env, check=True)
    return [out_dir / f"{NAME}.json", out_dir / f"{NAME}.md"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args(argv)
    _measure_and_write(args.out, args.length, "xla")


if __name__ == "__main__":
    main()
