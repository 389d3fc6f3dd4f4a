"""What flash_attention's TPU configurations compile to on single TPU chips (v4, v5e, v5p, v6e),
measured without a TPU, beside JAX's own Pallas TPU flash attention.

    python -m tools.tpu_compile_report [--implementation mosaic_tpu] [--out OUT]
        [--chips v4,v5e,v5p,v6e] [--only LABEL,...] [--llo-cycles]

Needs ``jax[tpu]`` (libtpu): XLA compiles for the compile-only chip of
``jax.experimental.topologies.get_topology_desc`` with ``JAX_PLATFORMS=cpu`` (``ENVIRONMENT``,
set here before jax is imported: run it as its own process). For every configuration
(``configurations``: bf16, head_dim 64/128/256, causal or not, GQA, segment ids, dropout, bias),
forward and forward+backward (``jax.grad``): compiled or the error, compile seconds,
``memory_analysis()`` bytes (arguments, outputs, HBM temp, generated code; VMEM scratch is not
in them) and, with ``--llo-cycles`` (slow: minutes a compile), libtpu's static LLO cycle
estimate summed over the program's ops (trust it for static control flow only). Without
``--out`` the table is printed and nothing is written; ``--out benchmarks/results/tpu/compile_report``
writes OUT.md and OUT.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ENVIRONMENT = dict(JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1", TPU_WORKER_HOSTNAMES="localhost",
                   ALLOW_MULTIPLE_LIBTPU_LOAD="1")
# One chip of each generation: (topology, chips_per_host_bounds).
CHIPS = {"v4": ("v4:1x1x1", [1, 1, 1]), "v5e": ("v5e:1x1", [1, 1, 1]),
         "v5p": ("v5p:1x1x1", [1, 1, 1]), "v6e": ("v6e:1x1", [1, 1, 1])}
BATCH, HEADS, SEQ_LEN = 1, 8, 2048
PASSES = ("fwd", "fwd+bwd")
JAX_FLASH = "jax_flash"  # jax.experimental.pallas.ops.tpu.flash_attention, blocks of 512
LLO_FLAGS = "--xla_jf_dump_static_llo_profile_to={} --xla_vf_vmem_memory_space_assignment=false"
REGENERATE = "python -m tools.tpu_compile_report --out benchmarks/results/tpu/compile_report"


@dataclasses.dataclass(frozen=True)
class Case:
    label: str          # "" for the plain ones, else the feature: gqa, segment_ids, dropout, bias
    head_dim: int
    causal: bool
    kv_heads: int = HEADS

    @property
    def name(self) -> str:
        return f"{self.label or 'plain'} d{self.head_dim}{' causal' if self.causal else ''}"


def configurations() -> list[Case]:
    plain = [Case("", d, c) for d in (64, 128, 256) for c in (False, True)]
    return plain + [Case("gqa", 128, True, kv_heads=2), Case("segment_ids", 128, True),
                    Case("dropout", 128, True), Case("bias", 128, False)]


def jax_flash_unsupported(case: Case) -> str | None:
    """What JAX's flash attention (MHA, no dropout) does not take."""
    return {"gqa": "JAX's flash attention is MHA only", "dropout": "JAX's flash attention has no dropout"}.get(case.label)


@dataclasses.dataclass
class Row:
    chip: str
    program: str        # the implementation's name, or JAX_FLASH
    case: str           # Case.name
    pass_: str          # "fwd" or "fwd+bwd"
    ok: bool = False
    error: str = ""
    compile_s: float = 0.0
    argument_bytes: int | None = None
    output_bytes: int | None = None
    temp_bytes: int | None = None
    code_bytes: int | None = None
    llo_cycles: int | None = None


def chip_device(chip: str):
    """The compile-only device of one chip (``CHIPS``)."""
    from jax.experimental import topologies
    topology, bounds = CHIPS[chip]
    return topologies.get_topology_desc(topology_name=topology, platform="tpu",
                                        chips_per_host_bounds=bounds).devices[0]


def _programs(implementation: str, case: Case):
    """{program: (fn(q, k, v, bias, q_seg, kv_seg, key_data) -> out [B, L, H, D])} for the case."""
    import jax
    import jax.numpy as jnp
    from jax_impl.flash_attention import flash_attention
    ours = lambda q, k, v, bias, q_seg, kv_seg, key: flash_attention(
        q, k, v, bias, is_causal=case.causal, implementation=implementation,
        q_segment_ids=q_seg, kv_segment_ids=kv_seg,
        **(dict(dropout_rate=0.1, dropout_rng=jax.random.wrap_key_data(key))
           if case.label == "dropout" else {}))
    programs = {implementation: ours}
    if jax_flash_unsupported(case) is None:
        from jax.experimental.pallas.ops.tpu import flash_attention as fa
        block = min(512, SEQ_LEN)
        sizes = fa.BlockSizes(**{n: block for n in (
            "block_q block_k_major block_k block_q_major_dkv block_k_major_dkv block_k_dkv "
            "block_q_dkv block_k_major_dq block_k_dq block_q_dq").split()}, block_b=1)
        heads_first = lambda x: jnp.swapaxes(x, 1, 2)
        programs[JAX_FLASH] = lambda q, k, v, bias, q_seg, kv_seg, key: heads_first(fa.flash_attention(
            heads_first(q), heads_first(k), heads_first(v), ab=bias,
            segment_ids=None if q_seg is None else fa.SegmentIds(q_seg, kv_seg),
            causal=case.causal, sm_scale=case.head_dim ** -0.5, block_sizes=sizes))
    return programs


def _operands(case: Case, device):
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding
    spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(
        shape, dtype, sharding=SingleDeviceSharding(device))
    q = spec((BATCH, SEQ_LEN, HEADS, case.head_dim))
    kv = spec((BATCH, SEQ_LEN, case.kv_heads, case.head_dim))
    bias = spec((BATCH, HEADS, SEQ_LEN, SEQ_LEN)) if case.label == "bias" else None
    seg = spec((BATCH, SEQ_LEN), jnp.int32) if case.label == "segment_ids" else None
    key = spec((2,), jnp.uint32) if case.label == "dropout" else None
    return q, kv, kv, bias, seg, seg, key


def llo_estimates(dump: Path) -> dict[str, int]:
    """{HLO op: estimated cycles} of the static LLO estimates dumped since the last call; the
    files removed."""
    ops = {}
    for f in sorted(dump.glob("*static_llo_profile*.textproto")):
        for name, cycles in re.findall(r'hlo_op_estimate\s*\{\s*hlo_op_name:\s*"([^"]*)".*?'
                                       r"estimated_cycles:\s*(\d+)", f.read_text(), re.S):
            ops[name] = ops.get(name, 0) + int(cycles)
        f.unlink()
    return ops


def _llo_cycles(dump: Path) -> int | None:
    """The static LLO cycle estimates dumped since the last call, summed; the files removed."""
    ops = llo_estimates(dump)
    return sum(ops.values()) if ops else None


def compile_row(chip: str, program: str, fn, case: Case, pass_: str, device,
                dump: Path | None = None) -> Row:
    import jax
    import jax.numpy as jnp
    row = Row(chip, program, case.name, pass_)
    if pass_ == "fwd+bwd":
        forward = fn
        fn = jax.grad(lambda q, k, v, *rest: forward(q, k, v, *rest).astype(jnp.float32).sum(),
                      argnums=(0, 1, 2))
    start = time.perf_counter()
    try:
        compiled = jax.jit(fn).lower(*_operands(case, device)).compile()
    except Exception as error:  # a refusal or a compiler error is the row's result
        row.error = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        if dump is not None:
            _llo_cycles(dump)
        return row
    row.compile_s = round(time.perf_counter() - start, 2)
    row.ok = True
    memory = compiled.memory_analysis()
    if memory is not None:
        row.argument_bytes = memory.argument_size_in_bytes
        row.output_bytes = memory.output_size_in_bytes
        row.temp_bytes = memory.temp_size_in_bytes
        row.code_bytes = memory.generated_code_size_in_bytes
    if dump is not None:
        row.llo_cycles = _llo_cycles(dump)
    return row


def report(implementation: str, chips, cases, passes=PASSES, dump: Path | None = None) -> list[Row]:
    rows = []
    for chip in chips:
        device = chip_device(chip)
        for case in cases:
            for program, fn in _programs(implementation, case).items():
                for pass_ in passes:
                    rows.append(compile_row(chip, program, fn, case, pass_, device, dump))
                    print(f"{chip} {program} {case.name} {pass_}: "
                          f"{'ok' if rows[-1].ok else rows[-1].error}", file=sys.stderr)
    return rows


def markdown(rows: list[Row], implementation: str) -> str:
    mb = lambda n: "" if n is None else f"{n / 2**20:.1f}"
    configured = {c.name for c in configurations()}
    partial = ("" if {r.case for r in rows} == configured and {r.chip for r in rows} == set(CHIPS) else
               " Partial: only the chips and configurations listed; the regeneration command "
               "writes them all.")
    lines = [f"# TPU compile report: implementation={implementation!r} beside {JAX_FLASH}",
             "", f"bf16, B={BATCH} H={HEADS} L={SEQ_LEN}, one compile-only chip each; "
             f"regenerate: `{REGENERATE}`. Memory in MiB (HBM; VMEM scratch is not counted).{partial}", "",
             "| chip | program | configuration | pass | compiled | compile s | args | out | temp | code | LLO cycles |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        status = "ok" if r.ok else r.error.replace("|", "/")
        lines.append(f"| {r.chip} | {r.program} | {r.case} | {r.pass_} | {status} | "
                     f"{r.compile_s if r.ok else ''} | {mb(r.argument_bytes)} | {mb(r.output_bytes)} | "
                     f"{mb(r.temp_bytes)} | {mb(r.code_bytes)} | {'' if r.llo_cycles is None else r.llo_cycles} |")
    return "\n".join(lines) + "\n"


def structure(implementation: str, chips=tuple(CHIPS), names=None) -> list[tuple]:
    """(chip, program, configuration, pass) of every row a report of these chips and
    configurations (``Case.name``; None: all) has: what the committed one must still list."""
    cases = [c for c in configurations() if names is None or c.name in names]
    return [(chip, program, case.name, pass_) for chip in chips for case in cases
            for program in (implementation,) + (() if jax_flash_unsupported(case) else (JAX_FLASH,))
            for pass_ in PASSES]


def add_chips_argument(parser, known=tuple(CHIPS)) -> None:
    """``--chips v4,v5e,...`` (default: every one of ``known``); an unknown name is a usage error."""
    def chips(text):
        names = [c for c in text.split(",") if c]
        unknown = set(names) - set(known)
        if unknown:
            raise argparse.ArgumentTypeError(f"{sorted(unknown)} are not among {list(known)}")
        return names
    parser.add_argument("--chips", default=",".join(known), type=chips)


def use_compile_only_chips(llo_dump: Path | None = None) -> None:
    """The environment of compile-only TPU chips (ENVIRONMENT, before jax is imported) and,
    with ``llo_dump``, libtpu's static LLO profile written there."""
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    if llo_dump is not None:
        os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") + " "
                                          + LLO_FLAGS.format(llo_dump)).strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--implementation", default="mosaic_tpu")
    parser.add_argument("--out", help="write OUT.md and OUT.json (else print the table)")
    add_chips_argument(parser)
    parser.add_argument("--only", type=lambda text: set(text.split(",")),
                        help="configurations by name (e.g. 'plain d128 causal,bias d128')")
    parser.add_argument("--llo-cycles", action="store_true",
                        help="libtpu's static LLO cycle estimates (slow: minutes per compile)")
    args = parser.parse_args(argv)
    cases = [c for c in configurations() if args.only is None or c.name in args.only]
    if not cases:
        parser.error(f"--only: none of {sorted(args.only)} is a configuration "
                     f"({[c.name for c in configurations()]})")
    dump = Path(tempfile.mkdtemp(prefix="llo_")) if args.llo_cycles else None
    use_compile_only_chips(dump)
    rows = report(args.implementation, args.chips, cases, dump=dump)
    table = markdown(rows, args.implementation)
    if args.out is None:
        print(table)
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table)
    out.with_suffix(".json").write_text(json.dumps(dict(
        implementation=args.implementation, chips=args.chips, configurations=[c.name for c in cases],
        batch=BATCH, heads=HEADS, seq_len=SEQ_LEN,
        rows=[dataclasses.asdict(r) for r in rows]), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
