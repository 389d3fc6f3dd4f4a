"""What the Mosaic GPU kernels (jax_impl/mosaic_gpu: the forward, dK/dV and dQ) compile to for an H100/H200 (sm_90a),
measured without a GPU.

    python -m tools.mosaic_compile_report [--out benchmarks/results/mosaic_compile_report_sm90]
        [--only defaults|all|segments|bias_mask|bias_with_mask|fused_dq|packed|d256|edges|mods]
        [--kernels all|forward|backward] [--seq-len 4096] [--head-dims 128] [--dtypes bfloat16]
        [--labels LABEL,...] [--merge]

Needs jax >= 0.11 with its CUDA plugin (``pip install 'jax[cuda13]==0.11.2'``, Python >= 3.12;
ptxas comes with the plugin's nvcc package): XLA compiles for the compile-only CUDA device of
``jax.experimental.topologies.get_topology_desc`` built from ``gpu_targets/h100_sxm.txtpb`` (public
H100 SXM numbers), with ``JAX_PLATFORMS=cpu``, and Mosaic GPU writes each kernel's PTX and ptxas
report to ``MOSAIC_GPU_DUMP_TO``. For each configuration: ptxas's registers (the launch
allocation; ``setmaxnreg`` then moves them between the warpgroup roles: its values are the
consumers' and the producer's budgets), spill bytes, the kernel's shared memory (Mosaic's
scratch, beside ``Config.shared_memory_bytes``), and PTX facts that show the design: wgmma
instructions, TMA loads and stores (``cp.async.bulk.tensor``), mbarrier waits, setmaxnreg.
This module sets the environment it needs before importing jax: run it as its own process.
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

TARGET = Path(__file__).resolve().parent / "gpu_targets" / "h100_sxm.txtpb"
SEQ_LEN = 4096
BATCH, HEADS, KV_HEADS = 1, 8, 8
REGENERATE = "python -m tools.mosaic_compile_report --out benchmarks/results/mosaic_compile_report_sm90"
CANDIDATES = "python -m tools.mosaic_compile_report --out benchmarks/results/mosaic_forward_tiles_sm90"


@dataclasses.dataclass
class Facts:
    label: str               # what is special about the call ("" for the plain ones)
    dtype: str
    head_dim: int
    causal: bool
    block_q: int
    block_kv: int
    num_stages: int
    persistent: bool
    seq_len: int
    shared_estimate: int      # Config.shared_memory_bytes
    ok: bool = False
    error: str = ""
    compile_s: float = 0.0
    registers: int | None = None        # ptxas: the launch allocation per thread
    spill_stores: int | None = None     # bytes
    spill_loads: int | None = None
    stack_frame: int | None = None
    shared: int | None = None           # Mosaic's SMEM scratch, bytes
    setmaxnreg: list = dataclasses.field(default_factory=list)  # "inc 240", "dec 24"
    wgmma: int = 0
    tma_loads: int = 0                  # cp.async.bulk.tensor global -> shared
    tma_stores: int = 0                 # cp.async.bulk(.tensor) shared -> global (1-D: the row stats)
    tma_reduces: int = 0                # cp.reduce.async.bulk: the fused dQ's reduce-add
    mbarrier_waits: int = 0
    partial_waits: int = 0              # wgmma.wait_group N > 0: a GEMM left running (pipelining)
    serialized: list = dataclasses.field(default_factory=list)  # ptxas C75xx: wgmma serialised
    kernel: str = "forward"             # forward, dK/dV or dQ
    packed: bool = False                # the forward packed the query group into its rows


def _environment(dump: str):
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    os.environ.update(MOSAIC_GPU_DUMP_TO=dump, MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1")


# The forward's tile sweep (``--only candidates``; docs/design.md, "Forward tiles"), the same
# candidates that run_gpu.sh times (benchmarks/mosaic_tiles.py). Those over the shared-memory
# budget are listed, not compiled.
from benchmarks.mosaic_tiles import TILE_CANDIDATES  # noqa: E402  (imports no jax)


DROPOUT_LABEL = "dropout 0.1"
FUSED_DQ_LABEL = "fused dQ"  # BackwardConfig(dq="fused"): dK/dV alone, dQ by TMA reduce-add
# The masks beside the plain rows, at D=128 causal (the most registers and shared memory).
FUSED_DQ_MASKS = (("segment ids", dict(segments=True)), ("dropout 0.1", dict(dropout=0.1)),
                  ("GQA 8:2, lengths, bottom-right, window, soft cap",
                   dict(kv_heads=2, lengths=True, bottom_right=True, window=(512, 0),
                        soft_cap=30.0)))


# Dropout beside a tile streamed with Q and dO in dK/dV (a bias, a mask, segment ids): the most
# registers of the backward's tile bodies (docs/limitations.md names their spills).
DROPOUT_STREAMED = (("bias float32 [1, H] + dropout 0.1", dict(bias="float32", dropout=0.1)),
                    ("mask bool [B, 1] + dropout 0.1", dict(mask=True, dropout=0.1)),
                    ("segment ids + dropout 0.1", dict(segments=True, dropout=0.1)))
# Every per-pair feature at once (the most registers in the masked tiles), causal.
DBIAS_LABEL = "bias bfloat16 [B, H] + mask, dbias"  # the one bias row that is differentiated
COMBINED_LABEL = "bias bfloat16 [B, H] + mask + dropout 0.1 + segment ids"
COMBINED = dict(bias="bfloat16", bias_batch=True, mask=True, dropout=0.1, segments=True)
# A few query rows of 8 query heads against one kv head (MQA; a prefill chunk or a speculative
# step): the forward packs the group into its rows (config.packs_query_group), with the per-row
# rules and per-head sinks. Forward only: the backward does not pack. With segment ids too at
# D=128 causal.
PACKED_Q_LEN = 96
PACKED_LABEL = f"GQA 8:1 packed, Lq={PACKED_Q_LEN}, lengths, bottom-right, sinks"
PACKED = dict(kv_heads=1, q_seq_len=PACKED_Q_LEN, lengths=True, bottom_right=True, sinks=True)
# One side's last tile padded alone, not causal: the mask is then the key lengths alone (no
# rule reads the rows) or the query lengths alone. Keys padded alone failed Mosaic's layout
# inference at D=128 until 2026-12-02 (an unused row iota).
EDGE_ROWS = (("keys padded alone: Lq=4096, Lk=4000", dict(seq_len=4000, q_seq_len=4096), (64, 128, 256)),
             ("queries padded alone: Lq=4000, Lk=4096", dict(q_seq_len=4000), (64, 128)))
# head_dim 256: the forward alone (its backward is pallas_triton's), on config.D256's tiles.
D256_FEATURES = (("", {}), ("lengths, bottom-right, window, soft cap, sinks",
                            dict(lengths=True, bottom_right=True, window=(512, 0), soft_cap=30.0,
                                 sinks=True)), ("segment ids", dict(segments=True)))


# The mods: ALiBi as a score_mod (its slopes in mod_aux, read by the query head) and a sliding
# window as a mask_mod with its block_mask (128 x 128 tiles): the kernels walk the block_mask's
# tile lists, evaluate the mask_mod on its partial tiles and take score_mod's derivative.
MODS_LABEL = "score_mod ALiBi (mod_aux) + mask_mod window 1024 + block_mask"
MODS_WINDOW = 1024


def _window(b, h, q_idx, kv_idx, slopes):
    return (q_idx - kv_idx < MODS_WINDOW) & (kv_idx - q_idx < MODS_WINDOW)


def _alibi(score, b, h, q_idx, kv_idx, slopes):
    return score + slopes[h] * (kv_idx - q_idx).astype(score.dtype)


def _mods(options, length: int):
    """(block_mask, mod_aux) of a row: those of ``MODS_LABEL``'s calls, or (None, ())."""
    if not options.get("mods"):
        return None, ()
    import jax.numpy as jnp

    from jax_impl import create_block_mask
    mod_aux = (2.0 ** -jnp.arange(1, HEADS + 1, dtype=jnp.float32),)
    return create_block_mask(_window, None, None, length, length, mod_aux=mod_aux), mod_aux


def configurations(only: str = "defaults", seq_len: int = SEQ_LEN):
    """(label, dtype, head_dim, causal, Config or None, extra call options): the shipped
    defaults (16-bit, D=64/128, causal and not); ``all`` adds masked edges, the mask features,
    other tiles and head_dim 256 (not offered: it shows why); ``segments`` only the calls with
    segment ids (bf16, D=64/128, causal and not); ``bias_mask`` only the calls with a bias
    (float32 [1, H] and bfloat16 [B, H]) or a bool mask [B, 1] or both (the backward's rows: a
    constant bias, but ``DBIAS_LABEL``'s, whose dQ kernel writes dS); ``bias_with_mask`` only
    those with both (every bias dtype and shape and the mask at once: what the CUDA compile lane
    compiles); ``fused_dq`` only the backward with
    ``BackwardConfig(dq="fused")`` (bf16, D=64/128, causal and not; ``all`` has them too);
    ``packed`` only the forward of a packed query group (``PACKED_LABEL``, bf16, D=64/128,
    causal and not, and with segment ids at D=128 causal; ``all`` has them too); ``d256``
    only the forward at head_dim 256 (bf16, causal and not, plain, with the band's features,
    with segment ids; ``all`` has them too); ``edges`` only the forward with one side's last
    tile padded alone (``EDGE_ROWS``; ``all`` has them too); ``mods`` only the calls with
    ``MODS_LABEL``'s mods (bf16, D=64/128, causal and not; ``all`` has them too)."""
    from jax_impl.mosaic_gpu.config import Config
    found = [("", dtype, d, causal, None, {}) for dtype in ("bfloat16", "float16")
             for d in (64, 128) for causal in (False, True)]
    found += [(DROPOUT_LABEL, "bfloat16", d, causal, None, dict(dropout=0.1))
              for d in (64, 128) for causal in (False, True)]
    if only == "candidates":
        return [(f"candidate {c.block_q}/{c.block_kv}/{c.num_stages}", "bfloat16", d, causal, c, {})
                for d in (64, 128) for causal in (False, True)
                for c in (Config(q, kv, stages) for q, kv, stages in TILE_CANDIDATES)]
    segment_rows = [("segment ids", "bfloat16", d, causal, None, dict(segments=True))
                    for d in (64, 128) for causal in (False, True)]
    if only == "segments":
        return segment_rows
    bias_mask_rows = [(label, "bfloat16", d, causal, None, options) for label, options in (
        ("bias float32 [1, H]", dict(bias="float32")), ("bias bfloat16 [B, H]", dict(bias="bfloat16", bias_batch=True)),
        ("mask bool [B, 1]", dict(mask=True)), ("bias float32 [1, H] + mask", dict(bias="float32", mask=True)),
        (DBIAS_LABEL, dict(bias="bfloat16", bias_batch=True, mask=True, dbias=True)))
        for d in (64, 128) for causal in (False, True)]
    if only == "bias_mask":
        return bias_mask_rows
    if only == "bias_with_mask":
        return [row for row in bias_mask_rows if "bias" in row[5] and "mask" in row[5]]
    fused_rows = [(FUSED_DQ_LABEL, "bfloat16", d, causal, None, dict(dq="fused"))
                  for d in (64, 128) for causal in (False, True)]
    fused_rows += [(f"{FUSED_DQ_LABEL}, {label}", "bfloat16", 128, True, None,
                    dict(options, dq="fused")) for label, options in FUSED_DQ_MASKS]
    if only == "fused_dq":
        return fused_rows
    packed_rows = [(PACKED_LABEL, "bfloat16", d, causal, None, PACKED)
                   for d in (64, 128) for causal in (False, True)]
    packed_rows.append((f"{PACKED_LABEL}, segment ids", "bfloat16", 128, True, None,
                        dict(PACKED, segments=True)))
    if only == "packed":
        return packed_rows
    d256_rows = [(f"D=256{', ' * bool(label)}{label}", "bfloat16", 256, causal, None, options)
                 for label, options in D256_FEATURES for causal in (False, True)]
    if only == "d256":
        return d256_rows
    edge_rows = [(label, "bfloat16", d, False, None, options) for label, options, dims in EDGE_ROWS
                 for d in dims]
    if only == "edges":
        return edge_rows
    mods_rows = [(MODS_LABEL, "bfloat16", d, causal, None, dict(mods=True))
                 for d in (64, 128) for causal in (False, True)]
    if only == "mods":
        return mods_rows
    if only == "all":
        found += [
            ("edges: L=4001 (padded to 4008)", "bfloat16", 128, True, None, dict(seq_len=seq_len - 95)),
            *edge_rows,
            ("lengths, bottom-right, window, soft cap, sinks", "bfloat16", 128, True, None,
             dict(lengths=True, bottom_right=True, window=(512, 0), soft_cap=30.0, sinks=True)),
            ("GQA 8:2", "bfloat16", 128, True, None, dict(kv_heads=2)),
            *packed_rows,
            *segment_rows,
            *bias_mask_rows,
            ("3 stages", "bfloat16", 64, True, Config(64, 128, 3), {}),
            ("block_kv=64", "bfloat16", 128, True, Config(64, 64, 2), {}),
            ("not persistent", "bfloat16", 128, True, Config(persistent=False), {}),
            ("block_q=128", "bfloat16", 64, False, Config(128, 64, 2), {}),
            *d256_rows,
            ("dropout 0.1 on 64 x 128 tiles (not the default)", "bfloat16", 128, True,
             Config(64, 128, 2), dict(dropout=0.1)),
            *((label, "bfloat16", d, causal, None, options) for label, options in DROPOUT_STREAMED
              for d in (64, 128) for causal in (False, True)),
            *((COMBINED_LABEL, "bfloat16", d, True, None, COMBINED) for d in (64, 128)),
            *fused_rows,
            *mods_rows,
        ]
    return found


def _attention_config(head_dim, causal, options):
    """The call's AttentionConfig from a report row's options (window, bottom_right, lengths,
    soft_cap, dropout)."""
    from jax_impl import masking
    from jax_impl.config import AttentionConfig
    window = options.get("window")
    mods = bool(options.get("mods"))
    spec = masking.MaskSpec(is_causal=causal, bottom_right=options.get("bottom_right", False),
                            window_left=None if window is None else window[0],
                            window_right=None if window is None else window[1],
                            has_q_lengths=options.get("lengths", False),
                            has_kv_lengths=options.get("lengths", False), has_block_mask=mods)
    return AttentionConfig(scale=head_dim ** -0.5, mask=spec, logits_soft_cap=options.get("soft_cap"),
                           dropout_rate=options.get("dropout", 0.0),
                           bias_gradient=bool(options.get("dbias")),
                           score_mod=_alibi if mods else None, mask_mod=_window if mods else None)


def _pairwise(options):
    """(bias dtype or None, whether a mask is given, shared-memory bytes per pair) of a row."""
    import jax.numpy as jnp
    bias_dtype = None if options.get("bias") is None else jnp.dtype(options["bias"])
    has_mask = bool(options.get("mask"))
    return bias_dtype, has_mask, (0 if bias_dtype is None else bias_dtype.itemsize) + has_mask


def _backward_pairwise_bytes(options) -> int:
    """The backward's bytes per pair of its bias and mask rings: a differentiated bias is read
    as float32 (dQ stages dS in its tile)."""
    bias_dtype, has_mask, pairwise_bytes = _pairwise(options)
    return 4 + has_mask if options.get("dbias") and bias_dtype is not None else pairwise_bytes


def _forward_config(head_dim, dtype, config, options):
    """The row's tiles: its own, or the defaults for its call."""
    from jax_impl.mosaic_gpu.config import default_config
    return config or default_config(head_dim, dtype, dropout=bool(options.get("dropout")),
                                    pairwise_bytes=_pairwise(options)[2])


def _compile(label, dtype, head_dim, causal, config, options, seq_len, device):
    """Lower and compile the forward for ``device``: (Facts without the dump's numbers)."""
    import jax
    import jax.numpy as jnp

    from jax_impl.mosaic_gpu.config import packs_query_group
    from jax_impl.mosaic_gpu.forward import Geometry, forward_call

    config = _forward_config(head_dim, dtype, config, options)
    length = options.get("seq_len", seq_len)
    q_length = options.get("q_seq_len", length)
    kv_heads = options.get("kv_heads", KV_HEADS)
    cfg = _attention_config(head_dim, causal, options)
    bias_dtype, has_mask, pairwise_bytes = _pairwise(options)
    geometry = Geometry(BATCH, q_length, length, HEADS, kv_heads, head_dim, jnp.dtype(dtype),
                        config, bias_dtype, has_mask)
    packed = packs_query_group(config, q_length, HEADS // kv_heads, per_head_pairs=bool(
        cfg.dropout_rate) or bias_dtype is not None or has_mask or cfg.has_mods)  # as mosaic_gpu.forward decides
    sharding = jax.sharding.SingleDeviceSharding(device)
    struct = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    args = [struct((BATCH, q_length, HEADS, head_dim), dtype),
            struct((BATCH, length, kv_heads, head_dim), dtype),
            struct((BATCH, length, kv_heads, head_dim), dtype),
            struct((BATCH,), jnp.int32), struct((BATCH,), jnp.int32)]
    sinks = struct((1, HEADS), jnp.float32) if options.get("sinks") else None
    segments = ([struct((BATCH, q_length), jnp.int32), struct((BATCH, length), jnp.int32)]
                if options.get("segments") else [None] * 2)
    seeds = struct((BATCH, HEADS), jnp.uint32) if options.get("dropout") else None
    bias = None if bias_dtype is None else struct(
        (BATCH if options.get("bias_batch") else 1, HEADS, length, length), bias_dtype)
    mask = struct((BATCH, 1, length, length), jnp.bool_) if has_mask else None

    block_mask, mod_aux = _mods(options, length)

    def forward(q, k, v, q_len, kv_len, sinks, q_segments, kv_segments, seeds, bias, mask):
        return forward_call(cfg, geometry, q, k, v, q_len, kv_len, None, sinks, q_segments,
                            kv_segments, seeds, None, bias, mask, block_mask=block_mask,
                            mod_aux=mod_aux, pack_query_group=packed)

    facts = Facts(label, str(jnp.dtype(dtype)), head_dim, causal, config.block_q, config.block_kv,
                  config.num_stages, config.persistent, length,
                  config.shared_memory_bytes(head_dim, dtype, pairwise_bytes,
                                             bool(options.get("segments"))), packed=packed)
    from jax_impl.mosaic_gpu.config import SHARED_MEMORY_BUDGET
    if facts.shared_estimate > SHARED_MEMORY_BUDGET:
        raise ValueError(f"over the shared-memory budget: {facts.shared_estimate / 1024:.1f} KiB "
                         f"> {SHARED_MEMORY_BUDGET // 1024} KiB, not compiled")
    start = time.perf_counter()
    jax.jit(forward).lower(*args, sinks, *segments, seeds, bias, mask).compile()
    facts.compile_s = round(time.perf_counter() - start, 2)
    return facts


BACKWARD_KERNELS = ("dK/dV", "dQ")  # in the order backward_call traces them


def _backward_config(head_dim, dtype, options):
    """The row's BackwardConfig (the default's tiles) and the kernels it compiles: dK/dV alone
    with the fused dQ."""
    from jax_impl.mosaic_gpu.config import default_backward_config
    config = dataclasses.replace(default_backward_config(head_dim, dtype),
                                 dq=options.get("dq", "separate"))
    return config, BACKWARD_KERNELS[:1] if config.dq == "fused" else BACKWARD_KERNELS


def _compile_backward(label, dtype, head_dim, causal, options, seq_len, device):
    """Lower and compile the backward's two kernels for ``device``: one Facts per kernel."""
    import jax
    import jax.numpy as jnp

    from jax_impl import online_softmax
    from jax_impl.mosaic_gpu.backward import backward_call

    config, kernels = _backward_config(head_dim, dtype, options)
    length = options.get("seq_len", seq_len)
    kv_heads = options.get("kv_heads", KV_HEADS)
    cfg = _attention_config(head_dim, causal, options)
    bias_dtype, has_mask, _ = _pairwise(options)
    sharding = jax.sharding.SingleDeviceSharding(device)
    struct = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    queries = struct((BATCH, length, HEADS, head_dim), dtype)
    keys = struct((BATCH, length, kv_heads, head_dim), dtype)
    rows = struct((BATCH, HEADS, length), jnp.float32)
    lengths = struct((BATCH,), jnp.int32)
    segments = ([struct((BATCH, length), jnp.int32)] * 2) if options.get("segments") else []
    seeds = struct((BATCH, HEADS), jnp.uint32) if options.get("dropout") else None
    bias = None if bias_dtype is None else struct(
        (BATCH if options.get("bias_batch") else 1, HEADS, length, length), bias_dtype)
    mask = struct((BATCH, 1, length, length), jnp.bool_) if has_mask else None
    block_mask, mod_aux = _mods(options, length)

    def backward(q, k, v, d_out, row_max, log_sum, delta, q_len, kv_len, seeds, bias, mask,
                 *segments):
        return backward_call(cfg, config, q, k, v, d_out,
                             online_softmax.RowStats(row_max, log_sum), delta, q_len, kv_len,
                             None, *(segments or (None, None)), seeds=seeds, bias=bias,
                             mask=mask, block_mask=block_mask, mod_aux=mod_aux)

    start = time.perf_counter()
    jax.jit(backward).lower(queries, keys, keys, queries, rows, rows, rows, lengths,
                            lengths, seeds, bias, mask, *segments).compile()
    seconds = round(time.perf_counter() - start, 2)
    return [Facts(label, str(jnp.dtype(dtype)), head_dim, causal, config.block_q,
                  config.block_kv, config.num_stages, True, length,
                  config.shared_memory_bytes(head_dim, dtype, bool(options.get("segments")),
                                             _backward_pairwise_bytes(options)),
                  compile_s=seconds, kernel=kernel)
            for kernel in kernels]


def _read_dump(facts: Facts, dump: Path, prefix: str = "") -> None:
    files = lambda suffix: sorted(p for p in dump.glob(f"*{suffix}")
                                  if not prefix or p.name.split(".")[0] == prefix)
    ptxas = "\n".join(p.read_text() for p in files(".ptxas"))
    ptx = "\n".join(p.read_text() for p in files(".ptx"))
    resources = "\n".join(p.read_text() for p in files("resources.txt"))
    number = lambda pattern, text: (int(m.group(1)) if (m := re.search(pattern, text)) else None)
    facts.registers = number(r"Used (\d+) registers", ptxas)
    facts.spill_stores = number(r"(\d+) bytes spill stores", ptxas)
    facts.spill_loads = number(r"(\d+) bytes spill loads", ptxas)
    facts.stack_frame = number(r"(\d+) bytes stack frame", ptxas)
    facts.shared = number(r"smem_scratch_bytes=(\d+)", resources)
    facts.setmaxnreg = [f"{a} {n}" for a, n in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)]
    facts.wgmma = len(re.findall(r"wgmma\.mma_async", ptx))
    facts.tma_loads = len(re.findall(r"cp\.async\.bulk\.tensor\.\w+\.shared::cluster\.global", ptx))
    facts.tma_stores = len(re.findall(r"cp\.async\.bulk(?:\.tensor\.\w+)?\.global\.shared::cta", ptx))
    facts.tma_reduces = len(re.findall(r"cp\.reduce\.async\.bulk", ptx))
    facts.mbarrier_waits = len(re.findall(r"mbarrier\.try_wait", ptx))
    facts.partial_waits = len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+[1-9]", ptx))
    # "Potential Performance Loss: wgmma.mma_async instructions are serialized due to ...":
    # ptxas then waits after every wgmma, and no GEMM overlaps anything.
    facts.serialized = sorted(set(re.findall(r"\((C75\d\d)\) Potential Performance Loss: wgmma", ptxas)))
    facts.ok = facts.registers is not None


def _entries(dump: Path) -> list[str]:
    """The dumped kernels' file prefixes (``entry_0``, ``entry_1``), in compile order."""
    names = {p.name.split(".")[0] for p in dump.glob("*.ptxas")}
    return sorted(names, key=lambda n: int(n.rsplit("_", 1)[-1]))


def _backward_elsewhere(head_dim, causal, options) -> str | None:
    """Why the row's call takes pallas_triton's backward (``mosaic_gpu.backward_unsupported``),
    or None."""
    from jax_impl import mosaic_gpu
    cfg = _attention_config(head_dim, causal, options)
    return mosaic_gpu.backward_unsupported(cfg, has_bias=options.get("bias") is not None,
                                           head_dim=head_dim)


def _compile_only_h100(root: str):
    """The compile-only H100 device (the environment set for a run under ``root``)."""
    _environment(os.path.join(root, "unused"))
    from jax.experimental import topologies
    return topologies.get_topology_desc(platform="cuda", target_config=TARGET.read_text(),
                                        topology="1x1x1").devices[0]


def report_backward(configs, seq_len: int = SEQ_LEN) -> list[Facts]:
    """The backward's dK/dV and dQ kernels of each configuration (its Config is the
    forward's and is not used: the backward has its own tiles)."""
    with tempfile.TemporaryDirectory() as root:
        device = _compile_only_h100(root)
        import jax
        rows = []
        for index, (label, dtype, head_dim, causal, config, options) in enumerate(configs):
            if config is not None or head_dim > 128 or "q_seq_len" in options or \
                    _backward_elsewhere(head_dim, causal, options):
                continue  # forward tiles, a head_dim the kernel does not offer, a forward-only
                # row (Lq != Lk: packed, edges), or a call whose backward is pallas_triton's
            dump = Path(root) / f"backward_{index}"
            dump.mkdir()
            os.environ["MOSAIC_GPU_DUMP_TO"] = str(dump)
            jax.clear_caches()
            try:
                found = _compile_backward(label, dtype, head_dim, causal, options, seq_len, device)
                for facts, prefix in zip(found, _entries(dump)):
                    _read_dump(facts, dump, prefix)
                    if not facts.ok:
                        facts.error = "no ptxas report was written"
            except Exception as e:
                config, kernels = _backward_config(head_dim, dtype, options)
                found = [Facts(label, dtype, head_dim, causal, config.block_q, config.block_kv,
                               config.num_stages, True, options.get("seq_len", seq_len),
                               config.shared_memory_bytes(head_dim, dtype,
                                                          bool(options.get("segments")),
                                                          _backward_pairwise_bytes(options)),
                               kernel=kernel,
                               error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                         for kernel in kernels]
            rows.extend(found)
    return rows


def report(configs, seq_len: int = SEQ_LEN) -> list[Facts]:
    """Compile each configuration (one process, one dump folder each) and read its facts."""
    with tempfile.TemporaryDirectory() as root:
        device = _compile_only_h100(root)
        import jax
        rows = []
        for index, (label, dtype, head_dim, causal, config, options) in enumerate(configs):
            if options.get("dq"):
                continue  # a backward choice: the forward of its call is the plain row's
            dump = Path(root) / f"config_{index}"
            dump.mkdir()
            os.environ["MOSAIC_GPU_DUMP_TO"] = str(dump)  # read by Mosaic at each compile
            jax.clear_caches()
            try:
                facts = _compile(label, dtype, head_dim, causal, config, options, seq_len, device)
                _read_dump(facts, dump)
                if not facts.ok:
                    facts.error = "no ptxas report was written"
            except Exception as e:  # a configuration that does not compile is a result
                config = _forward_config(head_dim, dtype, config, options)
                facts = Facts(label, dtype, head_dim, causal, config.block_q, config.block_kv,
                              config.num_stages, config.persistent, options.get("seq_len", seq_len),
                              config.shared_memory_bytes(head_dim, dtype, _pairwise(options)[2],
                                                         bool(options.get("segments"))),
                              error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            rows.append(facts)
    return rows


def markdown(rows: list[Facts], only: str = "all") -> str:
    import jax
    kib = lambda n: "-" if n is None else f"{n / 1024:.1f}"
    lines = [
        "# The Mosaic GPU kernels compiled for sm_90a (H100/H200), without a GPU",
        "",
        f"Regenerate: `{REGENERATE if only != 'candidates' else CANDIDATES} --only {only}` (jax {jax.__version__}, its CUDA plugin's ptxas; "
        f"B={BATCH}, Hq={HEADS}, Hkv={KV_HEADS} unless the label says otherwise). Registers: ptxas's "
        "launch allocation per thread (65536 / 384 threads); `setmaxnreg` then gives the two "
        "consumer warpgroups and takes from the producer (its values below). Shared memory: "
        "Mosaic's scratch beside `Config.shared_memory_bytes` (KiB; the budget is 227). TMA: "
        "`cp.async.bulk.tensor` loads (Q, K, V, and a bias or mask tile) and bulk stores (O by a tensor copy, the row max and log-sum by 1-D bulk copies) in the PTX; "
        "wgmma: `wgmma.mma_async` instructions (each loop body of the kernel holds its own); "
        "partial waits: `wgmma.wait_group` with N > 0 (a GEMM left running while the softmax "
        "runs: the forward's intra-warpgroup pipelining); serialised: ptxas's C75xx warning "
        "that it serialised every wgmma (none is the bar). "
        "The backward rows (dK/dV, dQ) have their own tiles (`BackwardConfig`: q, kv, stages) "
        "and registers (`setmaxnreg` 240 for the two compute warpgroups, 24 for the memory one); "
        "their TMA loads: K, V, Q, dO and the row vectors (and a bias or mask tile). "
        "The rows with a bias are a constant bias's but "
        f"`{DBIAS_LABEL}` (the dQ kernel writes dS, the bias's gradient).",
        "",
        "| kernel | call | dtype | D | causal | tiles (q, kv, stages) | persistent | L | compiled | registers | spills (st/ld B) | smem KiB (estimate) | setmaxnreg | wgmma | partial waits | serialised | TMA ld/st | mbarrier waits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.ok:
            lines.append(f"| {r.kernel} | {r.label or 'plain'} | {r.dtype} | {r.head_dim} | {r.causal} | "
                         f"{r.block_q}, {r.block_kv}, {r.num_stages} | {r.persistent} | {r.seq_len} | "
                         f"no: {r.error} | | | ({kib(r.shared_estimate)}) | | | | | | |")
            continue
        lines.append(
            f"| {r.kernel} | {r.label or 'plain'} | {r.dtype} | {r.head_dim} | {r.causal} | {r.block_q}, {r.block_kv}, "
            f"{r.num_stages} | {r.persistent} | {r.seq_len} | {r.compile_s} s | {r.registers} | "
            f"{r.spill_stores}/{r.spill_loads} | {kib(r.shared)} ({kib(r.shared_estimate)}) | "
            f"{', '.join(sorted(set(r.setmaxnreg)))} | {r.wgmma} | {r.partial_waits} | "
            f"{', '.join(r.serialized) or 'no'} | {r.tma_loads}/{r.tma_stores}"
            f"{f' + {r.tma_reduces} reduce-add' if r.tma_reduces else ''} | "
            f"{r.mbarrier_waits} |")
    return "\n".join(lines) + "\n"


def _head_dims(text: str) -> set[int]:
    try:
        return {int(d) for d in text.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--head-dims takes comma-separated integers such as 64,128, not {text!r}")


def _dtypes(text: str) -> set[str]:
    found = set(text.split(","))
    if not found <= {"bfloat16", "float16"}:
        raise argparse.ArgumentTypeError(
            f"--dtypes takes bfloat16 and/or float16, comma-separated, not {text!r}")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write OUT.md and OUT.json (else print the table)")
    parser.add_argument("--only", choices=("defaults", "all", "candidates", "segments", "bias_mask",
                                           "bias_with_mask", "fused_dq", "packed", "d256",
                                           "edges", "mods"),
                        default="defaults")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--kernels", choices=("all", "forward", "backward"), default="all")
    parser.add_argument("--head-dims", type=_head_dims,
                        help="only the rows of these head_dims, e.g. 128 (default: every row)")
    parser.add_argument("--dtypes", type=_dtypes,
                        help="only the rows of these dtypes, e.g. bfloat16 (default: every row)")
    parser.add_argument("--labels", type=lambda text: set(text.split("|")),
                        help="only the rows of these labels, |-separated (plain: the empty label)")
    parser.add_argument("--merge", action="store_true",
                        help="with --out: the rows compiled replace those of OUT.json of the same "
                             "kernel, call and tiles, the others are kept (a report of --only all)")
    args = parser.parse_args(argv)
    if args.merge and not (args.out and Path(args.out + ".json").exists()):
        parser.error("--merge updates an existing report: --out OUT with OUT.json")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    configs = [c for c in configurations(args.only, args.seq_len)
               if (args.head_dims is None or c[2] in args.head_dims)
               and (args.dtypes is None or c[1] in args.dtypes)
               and (args.labels is None or c[0] in args.labels)]
    rows = report(configs, args.seq_len) if args.kernels != "backward" else []
    if args.kernels != "forward":
        rows += report_backward(configs, args.seq_len)
    ok = all(r.ok for r in rows if not r.label.startswith("candidate"))
    if args.merge:
        rows = merged(load(args.out + ".json"), rows)
    table = markdown(rows, "all" if args.merge else args.only)
    if args.out:
        Path(args.out + ".md").write_text(table)
        Path(args.out + ".json").write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1) + "\n")
    print(table)
    # A candidate that does not fit or compile is a result of the sweep, not a failure.
    return 0 if ok else 1


def _row_key(r: Facts) -> tuple:
    return (r.kernel, r.label, r.dtype, r.head_dim, r.causal, r.block_q, r.block_kv,
            r.num_stages, r.persistent, r.seq_len)


def load(path: str) -> list[Facts]:
    """A report's rows from its JSON."""
    return [Facts(**row) for row in json.loads(Path(path).read_text())]


def merged(old: list[Facts], new: list[Facts]) -> list[Facts]:
    """``old`` with each row that ``new`` compiled again replaced in place; new rows appended."""
    fresh = {_row_key(r): r for r in new}
    rows = [fresh.pop(_row_key(r), r) for r in old]
    return rows + [r for r in new if _row_key(r) in fresh]


if __name__ == "__main__":
    sys.exit(main())
