"""Tile tuning sweep of the Pallas kernels on a GPU: time a few candidate BlockSizes per
(head dim, dtype, causal), write the winners to the table the heuristics read.

    python -m tools.tune_blocks [--out jax_impl/pallas_triton/tuned_blocks.json]
        [--report tuning.md] [--seq-len 8192] [--dry-run]
    python -m tools.tune_blocks --from-rows tuning.json --report tuning.md   # add compiled facts

Each candidate is forward + backward of ``flash_attention(implementation="pallas_triton",
block_sizes=...)`` at B=1, H=8, L=8192, bf16 (at L=4096 the 256 query tiles underfill an H200's 132
SMs and launch time blurs the ranking: a D=128 causal winner there lost by 17% at L=8192), measured by ``benchmarks.measure.measure`` (checked
against the float64 oracle first: a WRONG candidate cannot win; median of the timed repeats).
The winner per (head dim, dtype, causal) is the fastest correct candidate; the rule's own tiles
are always a candidate, so a table entry is never slower than the rule at the tuned length.
The report puts each candidate's TFLOP/s beside its compiled facts (registers, spills, shared
memory, wgmma: ``tools.compile_report``, when pip triton is installed); a GPU
machine without it writes every row to ``<report>.json``, and ``--from-rows`` renders the report
from that file where triton is installed.

``--dry-run`` runs the same steps on a CPU with the Pallas interpreter at a tiny length, so that
the table -> heuristics round trip is testable without a GPU (its timings mean nothing).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

from jax_impl.config import BlockSizes
from jax_impl.pallas_triton import heuristics

HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16",)
CAUSAL = (False, True)
# Alternatives to the rule, per head-dim class: each compiles for sm_90a with no spills and
# wgmma dots (compile report) and fits the shared-memory budget. Few: the sweep has ~80 s.
ALTERNATIVES = {
    64: (BlockSizes(128, 64, 64, 64, 64, 64, num_warps=4, num_warps_bwd=4, num_stages=3),
         BlockSizes(128, 128, 64, 64, 128, 64, num_warps=8, num_warps_bwd=8, num_stages=4),
         # the rule's forward (fastest forward on the H200) with the 4-warp backward that won there
         BlockSizes(128, 128, 64, 64, 64, 64, num_warps=8, num_warps_bwd=4, num_stages=3)),
    128: (BlockSizes(128, 64, 64, 64, 128, 64, num_warps=8, num_warps_bwd=8, num_stages=2),
          BlockSizes(128, 128, 64, 64, 128, 64, num_warps=8, num_warps_bwd=8, num_stages=2)),
}
DRY_RUN_SEQ_LEN = 64


def candidates(head_dim: int, dtype: str) -> list[BlockSizes]:
    """The rule's tiles first, then the alternatives that fit shared memory."""
    rule = heuristics.rule_block_sizes(head_dim, dtype)
    fits = lambda b: all(heuristics.shared_memory_estimate(k, head_dim, dtype, b) <= heuristics.SHARED_MEMORY_BUDGET
                         for k in heuristics.kernels(head_dim, b))
    return [rule] + [b for b in ALTERNATIVES.get(head_dim, ()) if b != rule and fits(b)]


def _adapter(blocks: BlockSizes, device: str, interpret: bool):
    from conformance.adapters.base import JaxFunctionAdapter
    from jax_impl.flash_attention import flash_attention
    fixed = (("implementation", "pallas_triton"), ("block_sizes", blocks)) + ((("interpret", True),) if interpret else ())
    return JaxFunctionAdapter(f"pallas_triton[{tiles(blocks)}]", "jax", device, ("jax",), fn=flash_attention,
                              fixed_kwargs=fixed, description="flash_attention with these block_sizes")


def tiles(b: BlockSizes) -> str:
    return ",".join(map(str, dataclasses.astuple(b)[:6])) + f"/w{b.num_warps},{b.num_warps_bwd}/s{b.num_stages}"


def sweep(seq_len: int, heads: int, device: str, interpret: bool, repeats: int,
          head_dims=HEAD_DIMS, causal_values=CAUSAL, time_budget_s: float | None = None) -> list[dict]:
    """One row per (head dim, dtype, causal, candidate): the measured Row as a dict. Past
    ``time_budget_s`` the remaining candidates are recorded as skipped (their class keeps
    what was measured, or the rule)."""
    from benchmarks import measure
    from benchmarks.__main__ import _enable_compile_cache
    from benchmarks.suites import Config
    from conformance.cases import Shape
    _enable_compile_cache()  # the 2nd input set's compile is a load
    opts = measure.Options(max_repeats=repeats, min_repeats=repeats, measure_budget_s=0.0,
                           input_sets=1 if interpret else 2,
                           allow_interpret=interpret)
    refs = measure.ReferenceCache()
    rows, start = [], time.perf_counter()
    for head_dim in head_dims:
        for dtype in DTYPES:
            for causal in causal_values:
                config = Config(Shape(1, heads, seq_len, head_dim, dtype), "top_left" if causal else None, "fwd+bwd")
                for blocks in candidates(head_dim, dtype):
                    row = measure.new_row(_adapter(blocks, device, interpret), config)
                    if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
                        row.status, row.reason = measure.SKIPPED, f"time budget of {time_budget_s:.0f} s spent"
                    else:
                        row = measure.measure(_adapter(blocks, device, interpret), config, refs, opts)
                    rows.append(dict(head_dim=head_dim, dtype=dtype, causal=causal, block_sizes=dataclasses.asdict(blocks),
                                     status=row.status, reason=row.reason, median_ms=row.median_ms,
                                     q1_ms=row.q1_ms, q3_ms=row.q3_ms, repeats=row.repeats,
                                     tflops=None if row.flop_per_s is None else row.flop_per_s / 1e12))
                    print(f"D={head_dim} {dtype} causal={causal} {tiles(blocks)}: {row.status} "
                          f"{row.median_ms} ms {row.reason[:120]}", flush=True)
    return rows


def winners(rows: list[dict]) -> list[dict]:
    """The fastest correct candidate per (head dim, dtype, causal)."""
    best = {}
    for r in rows:
        key = (r["head_dim"], r["dtype"], r["causal"])
        if r["status"] == "ok" and r["median_ms"] is not None and (
                key not in best or r["median_ms"] < best[key]["median_ms"]):
            best[key] = r
    return list(best.values())


def write_table(path, rows: list[dict], seq_len: int, heads: int, device_name: str) -> None:
    entries = [dict(head_dim=r["head_dim"], dtype=r["dtype"], causal=r["causal"], block_sizes=r["block_sizes"],
                    median_ms=r["median_ms"], q1_ms=r["q1_ms"], q3_ms=r["q3_ms"], tflops=r["tflops"],
                    candidates=sum((o["head_dim"], o["dtype"], o["causal"]) == (r["head_dim"], r["dtype"], r["causal"])
                                   for o in rows))
               for r in winners(rows)]
    table = dict(about=f"Tile sizes timed by tools/tune_blocks.py (forward+backward, B=1, H={heads}, L={seq_len}) "
                       f"on {device_name}, {datetime.date.today()}; jax_impl.pallas_triton.heuristics reads an "
                       "entry per (head_dim class, dtype, causal) and falls back to its rule for the rest.",
                 entries=entries)
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")


def compile_facts(rows: list[dict]) -> dict:
    """tiles -> {kernel: KernelFacts} from the compile report, or {} without triton."""
    try:
        from tools import compile_report
        compile_report._triton()
    except ImportError as e:
        print(f"no compiled facts: {e}", file=sys.stderr)
        return {}
    configs = {(r["head_dim"], r["dtype"], r["causal"], BlockSizes(**r["block_sizes"])) for r in rows}
    facts = {}
    for f in compile_report.report(sorted(configs, key=str)):
        key = (f.head_dim, f.dtype, f.causal, f.block_sizes)
        facts.setdefault(key, {})[f.kernel] = f
    return facts


def markdown(rows: list[dict], facts: dict, seq_len: int, heads: int, device_name: str) -> str:
    lines = [f"# Tile sweep on {device_name}: forward+backward, B=1, H={heads}, L={seq_len}", "",
             "Median of the timed repeats (quartiles). Compiled facts per kernel (forward / dK,dV / dQ): "
             "registers, spill bytes, shared KiB, wgmma or mma.sync.", "",
             "| D | dtype | causal | tiles | status | ms (q1-q3) | TFLOP/s | regs | spills | smem KiB | MMA | winner |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    won = {id(r) for r in winners(rows)}
    for r in rows:
        blocks = BlockSizes(**r["block_sizes"])
        kernels = facts.get((r["head_dim"], r["dtype"], r["causal"], dataclasses.astuple(blocks)), {})
        per = lambda fn: " / ".join(fn(kernels[k]) for k in heuristics.KERNELS if k in kernels)
        ms = "" if r["median_ms"] is None else f"{r['median_ms']:.3g} ({r['q1_ms']:.3g}-{r['q3_ms']:.3g})"
        tflops = "" if r["tflops"] is None else f"{r['tflops']:.1f}"
        lines.append(
            f"| {r['head_dim']} | {r['dtype']} | {'yes' if r['causal'] else 'no'} | {tiles(blocks)} | {r['status']} | "
            f"{ms} | {tflops} | "
            f"{per(lambda f: str(f.registers))} | {per(lambda f: str(f.spill_stores))} | "
            f"{per(lambda f: str((f.shared or 0) // 1024))} | "
            f"{per(lambda f: 'wgmma' if f.wgmma and not f.mma_sync else 'mma.sync' if f.mma_sync else 'fma')} | "
            f"{'**yes**' if id(r) in won else ''} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.tune_blocks", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(heuristics.TUNED_BLOCKS_FILE), help="the table the heuristics read")
    p.add_argument("--report", help="Markdown table of every candidate")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--time-budget", type=float, default=80.0,
                   help="seconds of measuring; later candidates are skipped (default 80)")
    p.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)), help="comma-separated")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--dry-run", action="store_true",
                   help=f"CPU, Pallas interpreter, L={DRY_RUN_SEQ_LEN}, 2 heads: tests the plumbing, times nothing real")
    p.add_argument("--no-compile-facts", action="store_true")
    p.add_argument("--from-rows", help="a <report>.json of an earlier sweep: render --report from it, time nothing")
    args = p.parse_args(argv)
    if args.from_rows:
        with open(args.from_rows) as f:
            saved = json.load(f)
        table = markdown(saved["rows"], compile_facts(saved["rows"]), saved["seq_len"], saved["heads"], saved["device"])
        print(table)
        if args.report:
            Path(args.report).write_text(table)
        return 0
    if args.dry_run:
        device, seq_len, heads, interpret = "cpu", args.seq_len or DRY_RUN_SEQ_LEN, 2, True
        device_name = "CPU (dry run: Pallas interpreter)"
    else:
        import jax
        if jax.default_backend() != "gpu":
            print("error: the tile sweep times the Pallas kernels on a CUDA GPU; use --dry-run here", file=sys.stderr)
            return 2
        device, seq_len, heads, interpret = "cuda", args.seq_len or 8192, args.heads, False
        device_name = jax.devices()[0].device_kind
    head_dims = tuple(int(d) for d in args.head_dims.split(","))
    causal_values = {"both": CAUSAL, "yes": (True,), "no": (False,)}[args.causal]
    rows = sweep(seq_len, heads, device, interpret, args.repeats, head_dims, causal_values, args.time_budget)
    if not winners(rows):
        print("error: no candidate ran correctly; the table is not written", file=sys.stderr)
        return 1
    write_table(args.out, rows, seq_len, heads, device_name)
    facts = {} if args.no_compile_facts else compile_facts(rows)
    table = markdown(rows, facts, seq_len, heads, device_name)
    print(table)
    if args.report:
        with open(args.report, "w") as f:
            f.write(table)
        with open(Path(args.report).with_suffix(".json"), "w") as f:  # every candidate, for re-rendering
            json.dump(dict(seq_len=seq_len, heads=heads, device=device_name, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
