"""libtpu's static cycle estimate of whole forward programs on compile-only TPU chips (v5e,
v6e), no TPU: flash_attention(implementation="mosaic_tpu") beside JAX's own Pallas TPU flash
attention (at its best of a few block sizes) and splash attention.

    python -m tools.tpu_estimate [--out benchmarks/results/tpu/estimate] [--chips v5e,v6e]
        [--programs ...] [--blocks 512,1024] [--append]

One chip and one block size a process keeps libtpu's memory within a 24 GB machine (the whole
v6e program at 1024 tiles peaks at 15 GB that way, at 23 GB with every block size in one
process); ``--append`` keeps the other rows of OUT.json.

Needs ``jax[tpu]`` (libtpu); run as its own process (the environment is set before jax is
imported, ``tpu_compile_report.ENVIRONMENT``). Each program is ``jax.jit(f).lower(...).compile()``
with libtpu's static LLO profile dumped (``tpu_compile_report.LLO_FLAGS``): the cycles of every
HLO op of the compiled program are summed (layout copies and the non-finite check
included); ``mosaic_tpu heads-first`` is the call on data in JAX's layout (the caller's
transposes cancel the API's), ``mosaic_tpu kernel`` the forward kernel alone on that layout,
beside JAX's kernel like for like. The estimate does not read scalar-prefetched data as the
program would (tile counts come out as 0; a constant non-finite flag of 0 or 1 estimates
alike); ours prefetches no tile list on these calls (full rows, a plain causal band: its
forward finds their key tiles by index arithmetic, ``common.IndexSchedule``), and its
non-finite flag, written 1 = finite, is estimated on the finite path, which finite operands
run. Splash attention's key axis reads prefetched block maps: its estimate is affected (shown,
not corrected).

MXU fraction: useful FLOPs (4 * B * H * D * attended pairs: L^2, or L(L+1)/2 causal) over
cycles x the chip's peak bf16 FLOP per cycle (``PEAK_FLOP_PER_CYCLE``). Without ``--out`` the
table is printed and nothing is written; with it OUT.md and OUT.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from tools import tpu_compile_report as report

BATCH, HEADS, SEQ_LEN, HEAD_DIM = 1, 8, 4096, 128
CHIPS = ("v5e", "v6e")
OURS_BLOCKS = (512, 1024)
JAX_FLASH_BLOCKS = (256, 512, 1024)
SPLASH_BLOCKS = (512, 1024)
# bf16 FLOP per cycle of one TensorCore: num_mxus x mxu_column_size^2 x 2 (a MAC is 2 FLOP) from
# jax's own chip table (jax/_src/pallas/mosaic/tpu_info.py, jax 0.10.2): v5e 4 MXUs of 128x128,
# v6e 2 of 256x256.
PEAK_FLOP_PER_CYCLE = {"v5e": 4 * 128 * 128 * 2, "v6e": 2 * 256 * 256 * 2}
OURS = "mosaic_tpu"
OURS_HEADS_FIRST = "mosaic_tpu heads-first"  # the call on JAX's [B, H, L, D] layout (caller transposes)
OURS_KERNEL = "mosaic_tpu kernel"  # the kernel alone, on JAX's layout (``_kernel_alone``)
PROGRAMS = (OURS, OURS_HEADS_FIRST, OURS_KERNEL, "jax_flash", "splash")
REGENERATE = ("for chip in v5e v6e; do for blocks in 256 512 1024; do python -m tools.tpu_estimate "
              "--out benchmarks/results/tpu/estimate --chips $chip --blocks $blocks --append; done; done")


@dataclasses.dataclass
class Row:
    chip: str
    program: str          # OURS, "jax_flash" or "splash"
    causal: bool
    blocks: int           # the block size tried (block_q = block_k)
    ok: bool = False
    error: str = ""
    compile_s: float = 0.0
    cycles: int | None = None
    kernel_cycles: int | None = None    # the Pallas kernel's op alone
    ops: dict = dataclasses.field(default_factory=dict)   # {HLO op: cycles}
    temp_bytes: int | None = None

    @property
    def useful_flops(self) -> int:
        pairs = SEQ_LEN * (SEQ_LEN + 1) // 2 if self.causal else SEQ_LEN * SEQ_LEN
        return 4 * BATCH * HEADS * HEAD_DIM * pairs

    def mxu_fraction(self) -> float | None:
        if not self.cycles:
            return None
        return self.useful_flops / (self.cycles * PEAK_FLOP_PER_CYCLE[self.chip])


def _kernel_alone(cfg, q, k, v):
    """mosaic_tpu's forward kernel on [B, H, L, D] operands: ``forward_call``'s transposes to
    and from the API layout cancel with these, and no non-finite check runs (the operands are
    taken as finite): the kernel as JAX's flash attention is called."""
    import jax.numpy as jnp
    from jax_impl import masking
    from jax_impl.mosaic_tpu.forward import forward_call
    to_api = lambda x: x.transpose(0, 2, 1, 3)
    full = jnp.full((q.shape[0],), q.shape[2], jnp.int32)
    out, _, _ = forward_call(cfg, to_api(q), to_api(k), to_api(v),
                             masking.MaskInputs(full, full, None, None, None))
    return to_api(out)


def _programs(causal: bool):
    """[(program, blocks, fn(q, k, v) -> out, layout)]: ours on the API layout [B, L, H, D],
    JAX's kernels on theirs, [B, H, L, D] (no transposes charged to them)."""
    import jax
    from jax.experimental.pallas.ops.tpu import flash_attention as fa
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash, splash_attention_mask as splash_mask)
    from jax_impl import masking
    from jax_impl.config import AttentionConfig, BlockSizes
    from jax_impl.flash_attention import flash_attention
    scale = HEAD_DIM ** -0.5
    programs = []
    heads_first = lambda x: x.transpose(0, 2, 1, 3)  # [B, H, L, D] <-> [B, L, H, D]
    for block in OURS_BLOCKS:
        sizes = BlockSizes(**dict.fromkeys(("block_q", "block_k", "block_q_dkv", "block_k_dkv",
                                            "block_q_dq", "block_k_dq"), block))
        call = lambda q, k, v, sizes=sizes: flash_attention(
            q, k, v, is_causal=causal, implementation=OURS, block_sizes=sizes)
        programs.append((OURS, block, call, "blhd"))
        # Data on JAX's layout: the caller's transposes cancel the API's under jit.
        programs.append((OURS_HEADS_FIRST, block, lambda q, k, v, call=call: heads_first(
            call(heads_first(q), heads_first(k), heads_first(v))), "bhld"))
    for block in OURS_BLOCKS:  # the same kernel on JAX's layout, without the API's passes
        cfg = AttentionConfig(scale=scale, mask=masking.MaskSpec(is_causal=causal),
                              block_sizes=BlockSizes(block_q=block, block_k=block))
        programs.append((OURS_KERNEL, block, lambda q, k, v, cfg=cfg: _kernel_alone(cfg, q, k, v),
                         "bhld"))
    for block in JAX_FLASH_BLOCKS:
        sizes = fa.BlockSizes(block_q=block, block_k_major=block, block_k=block, block_b=1)
        programs.append(("jax_flash", block, lambda q, k, v, sizes=sizes: fa.flash_attention(
            q, k, v, causal=causal, sm_scale=scale, block_sizes=sizes), "bhld"))
    for block in SPLASH_BLOCKS:
        shape = (SEQ_LEN, SEQ_LEN)
        mask = splash_mask.MultiHeadMask(
            [splash_mask.CausalMask(shape) if causal else splash_mask.FullMask(shape)] * HEADS)
        kernel = splash.make_splash_mha(
            mask, block_sizes=splash.BlockSizes(block_q=block, block_kv=block,
                                                block_kv_compute=block),
            head_shards=1, q_seq_shards=1)
        programs.append(("splash", block, lambda q, k, v, kernel=kernel: jax.vmap(kernel)(
            q * scale, k, v), "bhld"))
    return programs


def estimate_row(chip: str, device, program: str, blocks, fn, layout: str, causal: bool,
                 dump: Path) -> Row:
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding
    shape = ((BATCH, SEQ_LEN, HEADS, HEAD_DIM) if layout == "blhd"
             else (BATCH, HEADS, SEQ_LEN, HEAD_DIM))
    spec = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=SingleDeviceSharding(device))
    row = Row(chip, program, causal, blocks)
    report.llo_estimates(dump)  # nothing left from before
    start = time.perf_counter()
    try:
        compiled = jax.jit(fn).lower(spec, spec, spec).compile()
    except Exception as error:  # a refusal or a compiler error is the row's result
        row.error = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        report.llo_estimates(dump)
        return row
    row.compile_s = round(time.perf_counter() - start, 2)
    row.ops = report.llo_estimates(dump)
    row.ok = bool(row.ops)
    if not row.ok:
        row.error = "no static LLO profile was dumped"
    row.cycles = sum(row.ops.values()) or None
    kernels = [c for name, c in row.ops.items() if "flash" in name or "splash" in name
               or "attention" in name]
    row.kernel_cycles = sum(kernels) if kernels else None
    memory = compiled.memory_analysis()
    row.temp_bytes = None if memory is None else memory.temp_size_in_bytes
    return row


def best(rows: list[Row], chip: str, program: str, causal: bool) -> Row | None:
    """The row of fewest cycles among a program's block sizes."""
    done = [r for r in rows if (r.chip, r.program, r.causal) == (chip, program, causal) and r.ok]
    return min(done, key=lambda r: r.cycles) if done else None


def markdown(rows: list[Row], chips) -> str:
    lines = ["# Static cycle estimate: mosaic_tpu beside JAX's Pallas TPU kernels", "",
             f"bf16 forward, B={BATCH} H={HEADS} L={SEQ_LEN} D={HEAD_DIM}; libtpu's static LLO "
             "estimate of the whole compiled program (every HLO op, layout copies included), "
             f"compile-only chips; regenerate: `{REGENERATE}`. Ours runs its index schedule "
             "(key tiles by index arithmetic, the same results as its scalar-prefetched lists, "
             "which the estimate reads as 0); splash attention's prefetched block maps are read "
             "as 0 too. jax_flash: `jax.experimental.pallas.ops.tpu.flash_attention` at its "
             f"best of blocks {'/'.join(map(str, JAX_FLASH_BLOCKS))}; splash at its best of "
             f"{'/'.join(map(str, SPLASH_BLOCKS))}, ours at its best of "
             f"{'/'.join(map(str, OURS_BLOCKS))} (block_q = block_k); JAX's kernels on their [B, H, L, D] layout, "
             f"{OURS} on the API's [B, L, H, D] (its layout transposes and the non-finite check "
             f"included), `{OURS_HEADS_FIRST}` the same call on data in JAX's layout (the caller's "
             f"transposes cancel the API's: the check remains), `{OURS_KERNEL}` the forward "
             "kernel alone on JAX's layout. MXU fraction: useful FLOPs / (cycles x peak bf16 FLOP per "
             "cycle: " + ", ".join(f"{c} {PEAK_FLOP_PER_CYCLE[c]:,}" for c in chips)
             + ": MXUs x their width² x 2, jax's tpu_info table). A fraction above 1 is below the MXU's bound: the estimate skipped "
             "work there (it does not follow those kernels' data-dependent branches), not "
             "credible. VMEM: not in the estimate nor in memory_analysis."
             + ("" if {r.chip for r in rows} >= set(chips) and len(rows) == len(chips) * 2 * (
                 3 * len(OURS_BLOCKS) + len(JAX_FLASH_BLOCKS) + len(SPLASH_BLOCKS))
                else " Partial: the rows below are those measured so far."), "",
             "| chip | mask | program | blocks | cycles | kernel cycles | vs jax_flash | MXU fraction |",
             "|---|---|---|---|---|---|---|---|"]
    for chip in chips:
        for causal in (False, True):
            reference = best(rows, chip, "jax_flash", causal)
            for program in PROGRAMS:
                r = best(rows, chip, program, causal)
                if r is None:
                    errors = [x.error for x in rows if (x.chip, x.program, x.causal) == (chip, program, causal)]
                    lines.append(f"| {chip} | {'causal' if causal else 'full'} | {program} | | "
                                 f"{(errors or ['not run'])[0].replace('|', '/')} | | | |")
                    continue
                ratio = "" if reference is None else f"{r.cycles / reference.cycles:.2f}x"
                lines.append(f"| {chip} | {'causal' if causal else 'full'} | {program} | "
                             f"{r.blocks} | {r.cycles:,} | "
                             f"{'' if r.kernel_cycles is None else f'{r.kernel_cycles:,}'} | {ratio} | "
                             f"{r.mxu_fraction():.2f} |")
    lines += ["", "Every block size tried (cycles; errors by name):", "",
              "| chip | mask | program | blocks | cycles | compile s |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.chip} | {'causal' if r.causal else 'full'} | {r.program} | "
                     f"{r.blocks} | {f'{r.cycles:,}' if r.ok else r.error.replace('|', '/')} | "
                     f"{r.compile_s if r.ok else ''} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write OUT.md and OUT.json (else print the table)")
    report.add_chips_argument(parser, CHIPS)
    parser.add_argument("--programs", default=None, type=lambda text: set(text.split(",")),
                        help=f"a subset of {','.join(PROGRAMS)}")
    parser.add_argument("--blocks", default=None, type=lambda text: {int(b) for b in text.split(",")},
                        help="only these block sizes (one libtpu compile a process keeps its "
                             "memory below the machine's)")
    parser.add_argument("--append", action="store_true",
                        help="keep OUT.json's rows of the other chips and programs (one chip a process)")
    args = parser.parse_args(argv)
    dump = Path(tempfile.mkdtemp(prefix="llo_estimate_"))
    report.use_compile_only_chips(dump)
    out = None if args.out is None else Path(args.out)

    def write(rows):  # after every row: a run cut short leaves what it measured
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(markdown(rows, chips))
        out.with_suffix(".json").write_text(json.dumps(dict(
            batch=BATCH, heads=HEADS, seq_len=SEQ_LEN, head_dim=HEAD_DIM, dtype="bfloat16",
            peak_flop_per_cycle={c: PEAK_FLOP_PER_CYCLE[c] for c in chips},
            schedule_of_ours="index",
            rows=[dict(dataclasses.asdict(r), useful_flops=r.useful_flops,
                       mxu_fraction=r.mxu_fraction()) for r in rows]), indent=1) + "\n")

    rows, chips = [], list(args.chips)
    if args.append and out is not None and out.with_suffix(".json").exists():
        kept = [r for r in json.loads(out.with_suffix(".json").read_text())["rows"]
                if r["chip"] not in args.chips
                or (args.programs is not None and r["program"] not in args.programs)
                or (args.blocks is not None and r["blocks"] not in args.blocks)]
        fields = {f.name for f in dataclasses.fields(Row)}
        rows = [Row(**{k: v for k, v in r.items() if k in fields}) for r in kept]
        chips = sorted({r.chip for r in rows} | set(args.chips), key=list(CHIPS).index)
    try:
        for chip in args.chips:
            device = report.chip_device(chip)
            for causal in (False, True):
                for program, blocks, fn, layout in _programs(causal):
                    if (args.programs is not None and program not in args.programs) or (
                            args.blocks is not None and blocks not in args.blocks):
                        continue
                    if out is not None:  # what the file says if this process dies in the compile
                        write(rows + [Row(chip, program, causal, blocks, error=(
                            "the process died in this compile (libtpu past the address-space "
                            "cap?); later rows of the chip not run"))])
                    rows.append(estimate_row(chip, device, program, blocks, fn, layout, causal, dump))
                    r = rows[-1]
                    print(f"{chip} {'causal' if causal else 'full'} {program} {blocks}: "
                          f"{r.cycles if r.ok else r.error} {r.ops if r.ok else ''}", file=sys.stderr)
                    if out is not None:
                        write(rows)
        if out is not None:
            write(rows)
    finally:
        for f in dump.glob("*"):
            f.unlink()
        dump.rmdir()
    if out is None:
        print(markdown(rows, args.chips))
    return 0


if __name__ == "__main__":
    sys.exit(main())
