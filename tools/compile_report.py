"""What the Pallas kernels compile to on an H100/H200 (sm_90a), measured without a GPU.

    python -m tools.compile_report [--out DIR] [--head-dim 64 ...]
        [--dtype bfloat16 ...] [--block-sizes 128,64,64,128,128,64[,warps,warps_bwd,stages]]
        [--causal both|yes|no] [--seq-len 4096] [--no-mods | --mods-only] [--decode-only]

For each configuration: lower forward + backward of ``flash_attention`` for CUDA, take each
Triton kernel's TTIR out of its XLA custom call, compile it with pip ``triton`` (an optional
dependency, in the ``test`` extra) to PTX and an sm_90a cubin, and read ``ptxas -v``: registers,
spill bytes, shared memory (beside ``heuristics.shared_memory_estimate``), and which MMA
instruction the dots became (Hopper's ``wgmma`` or the older ``mma.sync``). A ``--seq-len`` or
head dim that is not a whole number of tiles compiles the masked edges (layout.py).
The split-K decode kernel (dense and paged caches, ``DECODE_SHAPE``) gets the same facts and its
grid; ``--decode-only`` recompiles only those rows and keeps the others of ``--out``'s JSON.
The calls with a score_mod (``MODS``: ALiBi, T5's table, beside a window mask_mod and its
block_mask) at ``MODS_CONFIGS``; ``--mods-only`` recompiles only those rows likewise.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

from jax_impl.config import BlockSizes
from jax_impl.flash_attention import flash_attention
from jax_impl.pallas_triton import heuristics
from jax_impl.pallas_triton.export import cuda_target, jit_for_cuda

# The pallas_call names (forward.py, backward.py) of heuristics.KERNELS, and back.
SHORT_NAMES = {f"flash_attention_{'' if k == 'forward' else 'backward_'}{k}": k for k in heuristics.KERNELS}
KERNELS = tuple(SHORT_NAMES)
SEQ_LEN = 4096  # long enough that no default tile is clipped; the benchmarks' length
MISSING_TRITON = ("the compile report needs pip `triton` (its NVIDIA backend compiles the kernels "
                  "without a GPU): pip install 'triton==3.8.0' or the package's `test` extra")
REGENERATE = "python -m tools.compile_report --out benchmarks/results/compile_report_sm90"


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    name: str        # one of KERNELS
    ttir: str        # Triton IR, as text
    num_warps: int
    num_stages: int


@dataclasses.dataclass
class KernelFacts:
    head_dim: int
    dtype: str
    causal: bool
    block_sizes: tuple       # BlockSizes fields, in order
    kernel: str              # heuristics.KERNELS: forward, dkdv (or dv and dk), dq
    num_warps: int
    num_stages: int
    dots: list               # [M, N, K, operand dtype] of each tt.dot in the TTIR
    shared_estimate: int     # bytes, heuristics.shared_memory_estimate
    ptxas_ok: bool = False
    error: str = ""
    registers: int | None = None
    spill_stores: int | None = None   # bytes
    spill_loads: int | None = None
    shared: int | None = None         # bytes, Triton's allocation (the kernel's static smem)
    wgmma: int = 0                    # wgmma.mma_async instructions in the PTX
    mma_sync: int = 0                 # mma.sync instructions
    seq_len: int = SEQ_LEN            # Lq = Lk of the lowered call
    mods: str = ""                    # a key of MODS, or "" (no score_mod or mask_mod)


# --- TTIR extraction ------------------------------------------------------------------------

# The calls with mods: a score_mod reading mod_aux by the query head (ALiBi: slopes [H]; T5: a
# table [17, H] read at the distance clipped to +-8) beside a sliding window as a mask_mod with
# its block_mask (128 x 128 tiles: the kernels walk its tile lists and evaluate the mask_mod on
# the partial tiles). Block sizes None: the heuristic for a call with a score_mod.
HEADS = 2
MODS_WINDOW = 1024
T5_DISTANCE = 8


def _window(b, h, q_idx, kv_idx, aux):
    return (q_idx - kv_idx < MODS_WINDOW) & (kv_idx - q_idx < MODS_WINDOW)


def _alibi(score, b, h, q_idx, kv_idx, slopes):
    return score + slopes[h] * (kv_idx - q_idx)


def _t5(score, b, h, q_idx, kv_idx, table):
    return score + table[jnp.clip(kv_idx - q_idx, -T5_DISTANCE, T5_DISTANCE) + T5_DISTANCE, h]


MODS = {"alibi + window block_mask": (_alibi, (HEADS,)),
        "t5 + window block_mask": (_t5, (2 * T5_DISTANCE + 1, HEADS))}
MODS_CONFIGS = tuple((head_dim, "bfloat16", causal, None, mods) for mods in MODS for head_dim in (64, 128)
                     for causal in (False, True))


def triton_kernels(head_dim: int, dtype, block_sizes: BlockSizes | None, causal: bool,
                   seq_len: int = SEQ_LEN, mods: str = "") -> list[TritonKernel]:
    """The three kernels of forward + backward at [1, seq_len, HEADS, head_dim], lowered for
    CUDA; ``mods``: with those of ``MODS[mods]``."""
    score_mod, aux_shape = MODS[mods] if mods else (None, None)
    aux = () if not mods else (jax.ShapeDtypeStruct(aux_shape, jnp.float32),)
    block_mask = None
    if mods:
        from jax_impl import create_block_mask
        block_mask = create_block_mask(_window, None, None, seq_len, seq_len,
                                       mod_aux=(jnp.zeros(aux_shape, jnp.float32),))

    def loss(q, k, v, *mod_aux):
        out = flash_attention(q, k, v, is_causal=causal, implementation="pallas_triton",
                              block_sizes=block_sizes, score_mod=score_mod,
                              mask_mod=_window if mods else None, mod_aux=mod_aux,
                              block_mask=block_mask)
        return jnp.sum(out.astype(jnp.float32))

    shape = jax.ShapeDtypeStruct((1, seq_len, HEADS, head_dim), jnp.dtype(dtype))
    with cuda_target():
        lowered = jit_for_cuda(jax.grad(loss, argnums=(0, 1, 2))).trace(shape, shape, shape, *aux).lower(
            lowering_platforms=("cuda",))
    found = {kernel.name: kernel for kernel, _ in _triton_calls(lowered)}
    return [found[name] for name in KERNELS if name in found]  # dkdv, or dv and dk (split_dkdv)


def _triton_calls(lowered) -> list:
    """Every Triton custom call of a lowered program, in program order: (TritonKernel, grid)."""
    from jax.interpreters.mlir import ir
    found = []

    def visit(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    child = child.operation
                    if child.name == "stablehlo.custom_call" and "triton" in ir.StringAttr(
                            child.attributes["call_target_name"]).value:
                        config = child.attributes["mhlo.backend_config"]
                        found.append((TritonKernel(
                            ir.StringAttr(config["name"]).value,
                            _ttir_text(ir.StringAttr(config["ir"]).value_bytes),
                            ir.IntegerAttr(config["num_warps"]).value,
                            ir.IntegerAttr(config["num_stages"]).value),
                            tuple(ir.IntegerAttr(config[f"grid_{a}"]).value for a in "xyz")))
                    visit(child)

    visit(lowered.compiler_ir().operation)
    return found


def decode_kernel(*, batch: int = 1, q_len: int = 1, q_heads: int = 32, kv_heads: int = 8,
                  kv_len: int = 65536, head_dim: int = 128, dtype="bfloat16",
                  page_size: int | None = None) -> tuple:
    """The split-K decode kernel (pallas_triton/decoding.py) lowered for CUDA: (its TTIR, its grid).
    ``page_size``: the paged kernel, reading pages [batch * kv_len / page_size, page_size, ...]
    through a page table [batch, kv_len / page_size]."""
    from jax_impl import masking
    from jax_impl.config import AttentionConfig
    from jax_impl.pallas_triton import decoding as decode_module

    cfg = AttentionConfig(scale=head_dim ** -0.5, mask=masking.MaskSpec(
        is_causal=True, bottom_right=True, has_kv_lengths=True))

    def call(q, k, v, kv_len, table=None):
        masks = masking.MaskInputs(jnp.full((batch,), q_len, jnp.int32), kv_len, None, None, None)
        return decode_module.decode(cfg, q, k, v, masks, None, table)

    dt = jnp.dtype(dtype)
    cache = ((batch, kv_len, kv_heads, head_dim) if page_size is None
             else (batch * kv_len // page_size, page_size, kv_heads, head_dim))
    args = (jax.ShapeDtypeStruct((batch, q_len, q_heads, head_dim), dt),
            jax.ShapeDtypeStruct(cache, dt), jax.ShapeDtypeStruct(cache, dt),
            jax.ShapeDtypeStruct((batch,), jnp.int32))
    if page_size is not None:
        args += (jax.ShapeDtypeStruct((batch, kv_len // page_size), jnp.int32),)
    with cuda_target():
        lowered = jit_for_cuda(call).trace(*args).lower(lowering_platforms=("cuda",))
    (kernel_and_grid,) = _triton_calls(lowered)
    return kernel_and_grid


# The decode rows: issue 25's point (B=1, Hkv=8, one query row, 65,536 bf16 keys, D=128; Hq=32),
# a dense cache and pages of 16 and 64 keys.
DECODE_SHAPE = dict(batch=1, q_len=1, q_heads=32, kv_heads=8, kv_len=65536, head_dim=128, dtype="bfloat16")
DECODE_PAGE_SIZES = (None, 16, 64)


@dataclasses.dataclass
class DecodeFacts:
    batch: int
    q_len: int
    q_heads: int
    kv_heads: int
    kv_len: int
    head_dim: int
    dtype: str
    page_size: int | None    # None: a dense cache
    grid: tuple              # (key runs, batch, kv heads)
    num_warps: int
    num_stages: int
    dots: list
    ptxas_ok: bool = False
    error: str = ""
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    shared: int | None = None
    wgmma: int = 0
    mma_sync: int = 0

    @property
    def programs(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


def decode_report(page_sizes=DECODE_PAGE_SIZES, workers: int | None = None) -> list[DecodeFacts]:
    """The decode kernel at ``DECODE_SHAPE`` for each page size, lowered here and compiled."""
    rows, jobs = [], []
    for page_size in page_sizes:
        kernel, grid = decode_kernel(page_size=page_size, **DECODE_SHAPE)
        rows.append(DecodeFacts(**DECODE_SHAPE, page_size=page_size, grid=tuple(grid),
                                num_warps=kernel.num_warps, num_stages=kernel.num_stages,
                                dots=dot_shapes(kernel.ttir)))
        jobs.append(kernel)
    _compile_all(rows, jobs, workers)
    return rows


def _compile_all(rows, jobs, workers):
    _triton()
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    # spawn: the workers need only triton, not a forked copy of JAX's threads
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for row, measured in zip(rows, pool.map(compile_kernel, jobs)):
            for field, value in measured.items():
                setattr(row, field, value)


def _triton():
    try:
        import triton
    except ImportError as e:
        raise ImportError(MISSING_TRITON) from e
    return triton


def _target():
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", 90, 32)  # sm_90a: H100 / H200


# pip triton whose dialect reads the TTIR of each jaxlib (measured: 0.10.2 and 0.11.2 parse in
# 3.8, not 3.9; 0.12.0.1 in 3.9, not 3.8).
TRITON_FOR_JAXLIB = {"0.10": "3.8", "0.11": "3.8", "0.12": "3.9"}


def _ttir_text(bytecode: bytes) -> str:
    """Pallas stores the TTIR as MLIR bytecode; triton.compile reads it as text."""
    _triton()
    from triton._C.libtriton import ir as tir  # no public parser of bytecode
    from triton.compiler import make_backend
    context = tir.context()
    tir.load_dialects(context)
    make_backend(_target()).load_dialects(context)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.mlirbc")
        with open(path, "wb") as f:
            f.write(bytecode)
        try:
            return str(tir.parse_mlir_module(path, context))
        except RuntimeError as e:  # the Triton dialect moves between releases
            import jaxlib
            import triton
            raise RuntimeError(
                f"the Triton IR that jaxlib {jaxlib.__version__} emits does not parse in pip triton "
                f"{triton.__version__}; pairs that parse: {TRITON_FOR_JAXLIB} (jaxlib minor -> triton; "
                "the `test` extra picks by Python version)") from e


_DOT = re.compile(r"tt\.dot .*?: tensor<(\d+)x(\d+)x(\w+)> \* tensor<\d+x(\d+)x\w+> -> tensor<")


def dot_shapes(ttir: str) -> list[list]:
    """[M, N, K, operand dtype] of every tt.dot (M x K times K x N)."""
    return [[int(m), int(n), int(k), t] for m, k, t, n in _DOT.findall(ttir)]


# --- compile and ptxas ----------------------------------------------------------------------

def compile_kernel(kernel: TritonKernel) -> dict:
    """Triton to PTX for sm_90a, then ptxas -v: the measured facts, or the error."""
    triton = _triton()
    facts = dict(ptxas_ok=False, error="")
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, f"{kernel.name}.ttir")
        with open(source, "w") as f:
            f.write(kernel.ttir)
        try:
            compiled = triton.compile(source, target=_target(), options=dict(
                num_warps=kernel.num_warps, num_stages=kernel.num_stages))
        except Exception as e:  # a compile failure is a result of the report
            facts["error"] = f"triton: {type(e).__name__}: {str(e).strip()[-300:]}"
            return facts
        ptx = compiled.asm["ptx"]
        facts.update(shared=int(compiled.metadata.shared),
                     wgmma=len(re.findall(r"\bwgmma\.mma_async\.", ptx)),
                     mma_sync=len(re.findall(r"\bmma\.sync\.", ptx)))
        ptx_path = os.path.join(tmp, "kernel.ptx")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        # -v prints the resource use; --regAllocOptLevel=2 as Triton 3.8 itself passes it
        run = subprocess.run([_ptxas(), "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a",
                              ptx_path, "-o", ptx_path + ".cubin"], capture_output=True, text=True)
    facts.update(parse_ptxas(run.stderr + run.stdout))
    facts["ptxas_ok"] = run.returncode == 0 and facts.get("registers") is not None
    if not facts["ptxas_ok"]:
        facts["error"] = f"ptxas exit {run.returncode}: {run.stderr.strip()[-300:]}"
    return facts


def _ptxas() -> str:
    """The ptxas that Triton itself runs for sm_90 (3.9 bundles two, and its PTX for sm_90
    needs the newer one); every triton that reads jaxlib's IR (TRITON_FOR_JAXLIB) has it."""
    from triton.backends.nvidia.compiler import get_ptxas
    return get_ptxas(90).path


def parse_ptxas(log: str) -> dict:
    """Registers and spill bytes from ``ptxas -v`` output."""
    facts = {}
    if m := re.search(r"Used (\d+) registers", log):
        facts["registers"] = int(m.group(1))
    if m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log):
        facts["spill_stores"], facts["spill_loads"] = int(m.group(1)), int(m.group(2))
    return facts


# --- the report -----------------------------------------------------------------------------

def default_configs(causal_values=(False, True)) -> list[tuple[int, str, bool, BlockSizes]]:
    """Every shipped default: D=64, 128, 256 in bf16, fp16 and fp32."""
    return [(head_dim, dtype, causal, heuristics.default_block_sizes(head_dim, dtype, causal))
            for dtype in ("bfloat16", "float16", "float32") for head_dim in (64, 128, 256)
            for causal in causal_values]


def report(configs, workers: int | None = None, seq_len: int = SEQ_LEN) -> list[KernelFacts]:
    """Lower every configuration here at ``seq_len``, compile its kernels in a pool of processes.
    A configuration: (head_dim, dtype, causal, BlockSizes), or (head_dim, dtype, causal,
    BlockSizes or None, a key of MODS): that call with its mods (None: the heuristic's tiles for
    a call with a score_mod)."""
    rows, jobs = [], []
    refused = []
    for head_dim, dtype, causal, user_blocks, *rest in configs:
        mods = rest[0] if rest else ""
        blocks = user_blocks or heuristics.default_block_sizes(head_dim, dtype, causal,
                                                               score_mod=bool(mods))
        facts = lambda kernel, **kw: KernelFacts(
            head_dim, str(jnp.dtype(dtype)), causal, dataclasses.astuple(blocks), kernel,
            blocks.num_warps if kernel == "forward" else blocks.num_warps_bwd, blocks.num_stages,
            shared_estimate=heuristics.shared_memory_estimate(kernel, head_dim, dtype, blocks),
            seq_len=seq_len, mods=mods, **kw)
        try:
            kernels = triton_kernels(head_dim, dtype, user_blocks, causal, seq_len, mods)
        except ValueError as e:  # block_sizes over the shared-memory budget: refused before lowering
            refused += [facts(kernel, dots=[], error=f"refused: {e}")
                        for kernel in heuristics.kernels(head_dim, blocks)]
            continue
        for kernel in kernels:
            rows.append(facts(SHORT_NAMES[kernel.name], dots=dot_shapes(kernel.ttir)))
            jobs.append(kernel)
    _compile_all(rows, jobs, workers)
    return rows + refused


def _kib(n):
    return "" if n is None else f"{n / 1024:.0f}"


def markdown(rows: list[KernelFacts], decode_rows: list[DecodeFacts] = ()) -> str:
    lines = [
        "# Compiled Pallas kernels on sm_90a (H100/H200), measured without a GPU",
        "",
        f"Regenerate: `{REGENERATE}` (needs pip `triton`; ~5 minutes on 2 cores).",
        f"Shapes: B=1, L={rows[0].seq_len if rows else SEQ_LEN}, 2 heads, forward + backward of "
        "`flash_attention`. Shared memory "
        f"budget: {heuristics.SHARED_MEMORY_BUDGET} bytes = "
        f"{heuristics.SHARED_MEMORY_BUDGET // 1024} KiB per block (`heuristics.SHARED_MEMORY_BUDGET`).",
        "Tiles: block_q, block_k, block_q_dkv, block_k_dkv, block_q_dq, block_k_dq / warps fwd, bwd / stages.",
        "",
        "| D | dtype | causal | tiles | kernel | dots M | regs | spill st/ld B | smem KiB | est. KiB | wgmma | mma.sync | ptxas |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    plain = [r for r in rows if not r.mods]
    lines += _kernel_lines(plain)
    if len(plain) < len(rows):
        lines += ["", "## Calls with a score_mod", "",
                  f"ALiBi (`score + slopes[h] * (kv_idx - q_idx)`) or T5 (`score + table[clip(kv_idx - q_idx, "
                  f"-{T5_DISTANCE}, {T5_DISTANCE}) + {T5_DISTANCE}, h]`), each in `mod_aux`, beside a window "
                  f"of {MODS_WINDOW} as a mask_mod with its block_mask (128 x 128); the heuristic's tiles "
                  f"(`default_block_sizes(score_mod=True)`: the forward on at least "
                  f"{heuristics.SCORE_MOD_FORWARD_WARPS} warps).", "",
                  "| D | dtype | causal | mods | tiles | kernel | dots M | regs | spill st/ld B | smem KiB | est. KiB | wgmma | mma.sync | ptxas |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += _kernel_lines([r for r in rows if r.mods], mods=True)
    return "\n".join(lines + decode_markdown(decode_rows)) + "\n"


def _kernel_lines(rows: list[KernelFacts], mods: bool = False) -> list[str]:
    lines = []
    for r in rows:
        tiles = ",".join(map(str, r.block_sizes[:6])) + "/" + "%d,%d/%d" % r.block_sizes[6:]
        spills = "" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"
        ms = ",".join(sorted({str(d[0]) for d in r.dots}, key=int))
        lines.append(f"| {r.head_dim} | {r.dtype} | {'yes' if r.causal else 'no'} | "
                     f"{r.mods + ' | ' if mods else ''}{tiles} | {r.kernel} | "
                     f"{ms} | {r.registers or ''} | {spills} | {_kib(r.shared)} | {_kib(r.shared_estimate)} | "
                     f"{r.wgmma} | {r.mma_sync} | {'ok' if r.ptxas_ok else r.error[:80]} |")
    return lines


def decode_markdown(rows: list[DecodeFacts]) -> list[str]:
    if not rows:
        return []
    r0 = rows[0]
    lines = [
        "",
        "## The split-K decode kernel (pallas_triton/decoding.py)",
        "",
        f"B={r0.batch}, {r0.q_len} query row, Hq={r0.q_heads}, Hkv={r0.kv_heads}, {r0.kv_len:,} cached keys, "
        f"D={r0.head_dim}, {r0.dtype}, bottom-right causal with lengths; grid = (key runs, batch, kv heads), "
        "one program each (an H100/H200 has 132 SMs). The packed rows of a kv head's query group "
        "(padded to 16) make dots of M=16: `mma.sync`, not `wgmma` (which needs M >= 64).",
        "",
        "| cache | grid | programs | dots M | warps/stages | regs | spill st/ld B | smem KiB | wgmma | mma.sync | ptxas |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cache = "dense" if r.page_size is None else f"pages of {r.page_size}"
        spills = "" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"
        ms = ",".join(sorted({str(d[0]) for d in r.dots}, key=int))
        lines.append(f"| {cache} | {'x'.join(map(str, r.grid))} | {r.programs} | {ms} | "
                     f"{r.num_warps}/{r.num_stages} | {r.registers or ''} | {spills} | {_kib(r.shared)} | "
                     f"{r.wgmma} | {r.mma_sync} | {'ok' if r.ptxas_ok else r.error[:80]} |")
    return lines


def toolchain() -> dict:
    """What the facts depend on: the TTIR comes from jaxlib, PTX and ptxas from pip triton."""
    import jaxlib
    return {"jaxlib": jaxlib.__version__, "triton": _triton().__version__}


def to_json(rows: list[KernelFacts], decode_rows: list[DecodeFacts]) -> dict:
    return {"toolchain": toolchain(), "kernels": [dataclasses.asdict(r) for r in rows],
            "decode": [dataclasses.asdict(r) for r in decode_rows]}


def load(path: str) -> tuple[list[KernelFacts], list[DecodeFacts], dict]:
    """A report's JSON -> (kernel rows, decode rows, toolchain); a list is the format before the
    decode rows (kernel rows only)."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list):
        data = {"kernels": data}
    as_tuple = lambda d, *names: {**d, **{n: tuple(d[n]) for n in names}}
    return ([KernelFacts(**as_tuple(d, "block_sizes")) for d in data.get("kernels", [])],
            [DecodeFacts(**as_tuple(d, "grid")) for d in data.get("decode", [])],
            data.get("toolchain", {}))


def parse_block_sizes(text: str) -> BlockSizes:
    values = [int(x) for x in text.split(",")]
    if len(values) not in (6, 9):
        raise argparse.ArgumentTypeError(
            "--block-sizes takes 6 tile sizes, optionally followed by num_warps,num_warps_bwd,num_stages")
    return BlockSizes(*values)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.compile_report",
                                     description=__doc__.split("\n\n")[-1])
    parser.add_argument("--head-dim", type=int, action="append", help="adds configurations (with --dtype)")
    parser.add_argument("--dtype", action="append", help="bfloat16, float16 or float32")
    parser.add_argument("--block-sizes", type=parse_block_sizes,
                        help="user tiles for the --head-dim/--dtype configurations (default: the heuristic)")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--no-defaults", action="store_true", help="only the configurations given")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN,
                        help=f"Lq = Lk of the lowered calls (default {SEQ_LEN})")
    parser.add_argument("--out", help="writes DIR.json and DIR.md (a path without extension)")
    parser.add_argument("--workers", type=int)
    parser.add_argument("--no-decode", action="store_true", help="leave out the decode kernel's rows")
    parser.add_argument("--decode-only", action="store_true",
                        help="recompile only the decode rows; the other rows come from --out's JSON")
    parser.add_argument("--no-mods", action="store_true", help="leave out the rows with mods (MODS_CONFIGS)")
    parser.add_argument("--mods-only", action="store_true",
                        help="recompile only the rows with mods; the other rows come from --out's JSON")
    args = parser.parse_args(argv)
    if args.decode_only or args.mods_only:
        flag = "--decode-only" if args.decode_only else "--mods-only"
        if not args.out or not os.path.exists(args.out + ".json"):
            parser.error(f"{flag} keeps the other rows of an existing report: --out DIR with DIR.json")
        rows, decode_rows, _ = load(args.out + ".json")
        try:
            if args.decode_only:
                return _write(args.out, rows, decode_report(workers=args.workers))
            return _write(args.out, [r for r in rows if not r.mods] + report(MODS_CONFIGS, args.workers),
                          decode_rows)
        except ImportError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    causal_values = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    configs = [] if args.no_defaults else default_configs(causal_values)
    for head_dim in args.head_dim or []:
        for dtype in args.dtype or ["bfloat16"]:
            for causal in causal_values:
                configs.append((head_dim, dtype, causal,
                                args.block_sizes or heuristics.default_block_sizes(head_dim, dtype, causal)))
    if not (args.no_defaults or args.no_mods):
        configs += [c for c in MODS_CONFIGS if c[2] in causal_values]
    try:
        rows = report(configs, args.workers, args.seq_len)
        decode_rows = [] if args.no_decode else decode_report(workers=args.workers)
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _write(args.out, rows, decode_rows)


def _write(out: str | None, rows: list[KernelFacts], decode_rows: list[DecodeFacts]) -> int:
    table = markdown(rows, decode_rows)
    print(table)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out + ".md", "w") as f:
            f.write(table)
        with open(out + ".json", "w") as f:
            json.dump(to_json(rows, decode_rows), f, indent=1)
    return 0 if all(r.ptxas_ok for r in [*rows, *decode_rows]) else 1


if __name__ == "__main__":
    sys.exit(main())
