"""Sharded suite: per-device memory and collectives of the compiled program vs device count.

At fixed L (default 32768, H=8, D=64 fp32, causal), for 1, 2, 4, 8 devices (``--devices``)
and each sharding (sequence: each context-parallel strategy side by side,
``context_parallel_strategy=`` ring, all_to_all, and hybrid on a (2, N/2) mesh; heads: local),
compiles flash_attention's forward and fwd+bwd under plain jit (never runs them) and records
``compiled.memory_analysis()``
(arguments + temporaries per device), the collectives in ``compiled.as_text()`` and the cost
model's estimated bytes sent per device (cp_cost.py, fwd+bwd). With ``--time-length`` it also
runs fwd+bwd of each strategy at that (short) L on the 8 virtual CPU devices, ``--repeats``
times: median and min-max seconds (virtual devices share the host's cores: a ranking of the
strategies' overheads, not a multi-device speed). The local kernel is ``xla`` on a CPU
host (the Pallas interpreter's memory says nothing about the kernel) and the default (the
Pallas kernels) on a GPU. Step times vs devices need several GPUs: not measured here.

    python -m benchmarks --suite sharded [--devices 1,8] [--out DIR | --update-reference]

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
DEVICE_COUNTS = (1, 2, 4, 8)
NAME = "bench_sharded"


def check_devices(devices, device: str) -> tuple[int, ...]:
    """The device counts to measure: powers of two (the hybrid mesh is 2 x N/2), at most the 8
    virtual devices on a CPU host. -> sorted, without repeats; ValueError naming --devices."""
    devices = tuple(sorted(set(devices)))
    odd = [n for n in devices if n < 1 or n & (n - 1)]
    if odd:
        raise ValueError(f"--devices {','.join(map(str, odd))}: each count must be a power of two "
                         "(the hybrid strategy's mesh is 2 x N/2)")
    if device == "cpu" and devices[-1] > CPU_DEVICES:
        raise ValueError(f"--devices {devices[-1]}: a CPU host runs at most {CPU_DEVICES} virtual devices")
    return devices


def _layouts(n: int, batch: int, length: int, heads: int, head_dim: int):
    """(sharding name, strategy, mesh shape, axis names, q spec, shape) for n devices."""
    from jax.sharding import PartitionSpec as P
    seq, short = (batch, length, heads, head_dim), (batch, length // 4, heads, head_dim)
    yield "sequence", None, (n,), ("x",), P(None, "x"), seq
    if n > 1:
        yield "sequence ring", "ring", (n,), ("x",), P(None, "x"), seq
        yield "sequence all_to_all", "all_to_all", (n,), ("x",), P(None, "x"), seq
    if n >= 4:
        yield "sequence hybrid (2 x N/2)", "hybrid", (2, n // 2), ("o", "i"), P(None, ("o", "i")), seq
    yield "heads", None, (n,), ("x",), P(None, None, "x"), short


def _estimated_mib(mesh, spec, shape, strategy):
    from jax_impl import cp_cost, partitioned
    plan = partitioned.sharding_plan(mesh, spec, shape, shape, ring_unavailable=None,
                                     call=partitioned.SequenceCall(itemsize=4, requested=strategy))
    if plan.choice is None:
        return None, None
    return plan.choice.strategy, plan.choice.bytes_per_device.get(plan.choice.strategy, 0) / 2**20


def measure(length: int = 32768, heads: int = 8, head_dim: int = 64, batch: int = 1,
            devices=DEVICE_COUNTS, implementation: str | None = "xla",
            strict: bool = False) -> list[dict]:
    """``strict``: a count above jax.device_count() is an error (asked for by name), not skipped."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    from jax_impl.flash_attention import flash_attention

    rows = []
    for n in devices:
        if n > jax.device_count():
            if strict:
                raise ValueError(f"--devices {n}: only {jax.device_count()} devices are visible")
            continue
        for layout, strategy, mesh_shape, names, spec, shape in _layouts(n, batch, length, heads, head_dim):
            attend = lambda q, k, v, s=strategy: flash_attention(
                q, k, v, is_causal=True, implementation=implementation, context_parallel_strategy=s)
            grad = jax.grad(lambda q, k, v, a=attend: jnp.sum(a(q, k, v)), argnums=(0, 1, 2))
            mesh = Mesh(np.array(jax.devices()[:n]).reshape(mesh_shape), names)
            arg = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
            chosen, estimate = (_estimated_mib(mesh, spec, shape, strategy) if layout.startswith("sequence")
                                and n > 1 else (None, None))
            for program, fn in (("forward", attend), ("forward_backward", grad)):
                compiled = jax.jit(fn).lower(arg, arg, arg).compile()
                memory = compiled.memory_analysis()
                hlo = compiled.as_text()
                rows.append(dict(
                    devices=n, sharding=layout, program=program, shape=list(shape),
                    strategy=chosen, estimated_mib_sent=estimate if program == "forward_backward" else None,
                    per_device_mib=(memory.argument_size_in_bytes + memory.temp_size_in_bytes) / 2**20,
                    collectives={c: hlo.count(c + "(") + hlo.count(c + "-start(") for c in COLLECTIVES}))
    return rows


def time_strategies(length: int, repeats: int, heads: int = 8, head_dim: int = 64,
                    implementation: str | None = "xla") -> list[dict]:
    """fwd+bwd seconds of each strategy on all devices: median and min-max over ``repeats``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    from jax_impl.flash_attention import flash_attention

    n = jax.device_count()
    rows = []
    rng = np.random.default_rng(0)
    for layout, strategy, mesh_shape, names, spec, shape in _layouts(n, 1, length, heads, head_dim):
        if not layout.startswith("sequence ") and layout != "heads":
            continue
        if layout == "heads":
            shape = (1, length, heads, head_dim)
        mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), names)
        args = [jax.device_put(rng.standard_normal(shape).astype(np.float32), NamedSharding(mesh, spec))
                for _ in range(3)]
        loss = lambda q, k, v, s=strategy: jnp.sum(flash_attention(
            q, k, v, is_causal=True, implementation=implementation, context_parallel_strategy=s))
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        jax.block_until_ready(step(*args))  # compile
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(*args))
            seconds.append(time.perf_counter() - start)
        rows.append(dict(sharding=layout, devices=n, length=length, median_s=float(np.median(seconds)),
                         min_s=min(seconds), max_s=max(seconds), repeats=repeats))
    return rows


def markdown(rows: list[dict], env: dict | None = None) -> str:
    lines = []
    if env:
        lines += ["# Sharded suite: per-device memory and collectives vs devices", ""]
        lines += [f"- {k}: {v}" for k, v in env.items() if k != "timed"] + [""]
    lines += ["| sharding | program | devices | shape | strategy run | est. MiB sent per device (fwd+bwd) "
              "| args+temps per device (MiB) | vs 1 device | collectives (static count in the HLO) |",
              "|---|---|---|---|---|---|---|---|---|"]
    one = {(r["sharding"].split()[0], r["program"]): r["per_device_mib"] for r in rows if r["devices"] == 1}
    for r in rows:
        coll = ", ".join(f"{k} {v}" for k, v in r["collectives"].items() if v) or "none"
        base = one.get((r["sharding"].split()[0], r["program"]))
        ratio = f"{r['per_device_mib'] / base:.2f}x" if base else "n/a"
        sent = "" if r.get("estimated_mib_sent") is None else f"{r['estimated_mib_sent']:.1f}"
        lines.append(f"| {r['sharding']} | {r['program']} | {r['devices']} | {r['shape']} | "
                     f"{r.get('strategy') or ''} | {sent} | {r['per_device_mib']:.1f} | {ratio} | {coll} |")
    timed = (env or {}).get("timed")
    if timed:
        lines += ["", f"fwd+bwd seconds on {timed[0]['devices']} virtual CPU devices (shared host cores), "
                  f"L={timed[0]['length']}, median (min-max) of {timed[0]['repeats']} runs:", "",
                  "| sharding | median s | min-max s |", "|---|---|---|"]
        lines += [f"| {t['sharding']} | {t['median_s']:.3f} | {t['min_s']:.3f}-{t['max_s']:.3f} |"
                  for t in timed]
    return "\n".join(lines) + "\n"


def write(out: pathlib.Path, rows: list[dict], env: dict) -> list[pathlib.Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{NAME}.json", out / f"{NAME}.md"]
    paths[0].write_text(json.dumps(dict(environment=env, rows=rows), indent=1))
    paths[1].write_text(markdown(rows, env))
    return paths


def _measure_and_write(out: pathlib.Path, length: int, implementation: str | None,
                       time_length: int = 0, repeats: int = 3,
                       devices: tuple[int, ...] | None = None) -> list[pathlib.Path]:
    import jax
    start = time.perf_counter()
    rows = measure(length=length, implementation=implementation, devices=devices or DEVICE_COUNTS,
                   strict=devices is not None)
    timed = time_strategies(time_length, repeats, implementation=implementation) if time_length else []
    env = dict(command="python -m benchmarks --suite sharded", jax=jax.__version__,
               devices=f"{jax.device_count()} x {jax.devices()[0].device_kind}",
               implementation=implementation or "default (pallas_triton on a GPU)",
               seconds=round(time.perf_counter() - start, 1),
               note="compiled, never run: memory_analysis() arguments + temporaries per device; "
                    "step time vs devices needs several GPUs and is not measured")
    if timed:
        env["timed"] = timed
    paths = write(out, rows, env)
    print(markdown(rows, dict(timed=timed) if timed else None))
    return paths


def run_suite(out_dir, device: str, length: int = 32768,
              devices: tuple[int, ...] | None = None) -> list[pathlib.Path]:
    """``python -m benchmarks --suite sharded``: writes bench_sharded.json and .md to out_dir;
    on a CPU host it also times each strategy's fwd+bwd at min(L, 2048). ``devices``: the
    device counts (default 1, 2, 4, 8, those visible)."""
    out_dir = pathlib.Path(out_dir)
    time_length = min(length, 2048)
    if device != "cpu":
        return _measure_and_write(out_dir, length, None, devices=devices)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={CPU_DEVICES}").strip()
    root = pathlib.Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = [sys.executable, "-m", "benchmarks.sharded", "--out", str(out_dir),
               "--length", str(length), "--time-length", str(time_length)]
    if devices:
        command += ["--devices", ",".join(map(str, devices))]
    subprocess.run(command, env=env, check=True)
    return [out_dir / f"{NAME}.json", out_dir / f"{NAME}.md"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--time-length", type=int, default=0,
                        help="also time fwd+bwd of each strategy at this L (0: no timing)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--devices", default=None,
                        help="comma-separated device counts, powers of two (default 1,2,4,8)")
    args = parser.parse_args(argv)
    devices = None
    if args.devices is not None:
        try:
            counts = [int(x) for x in args.devices.split(",")]
        except ValueError:
            parser.error(f"--devices {args.devices!r} must be comma-separated device counts, e.g. 1,8")
        try:
            devices = check_devices(counts, "cpu")
        except ValueError as e:
            parser.error(str(e))
    _measure_and_write(args.out, args.length, "xla", args.time_length, args.repeats, devices)


if __name__ == "__main__":
    main()
