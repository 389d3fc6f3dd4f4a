"""Benchmark suites: which configurations, which implementations, how many repeats.

A configuration is a ``conformance.cases.Shape`` (the named benchmark points of the shared
case list) plus causal masking and a mode ("fwd" or "fwd+bwd"); ``Config.case(seed)`` turns it
into a ``conformance.cases.Case`` so that inputs come from ``conformance.cases.make_inputs``.
"""
from __future__ import annotations

import dataclasses

from conformance.cases import Case, Shape

MODES = ("fwd", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class Config:
    shape: Shape
    causal: str | None = None       # None | "top_left" | "bottom_right"
    mode: str = "fwd"               # "fwd" | "fwd+bwd"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"{self.mode=} must be one of {MODES}")

    def case(self, seed: int = 0) -> Case:
        features = {"causal": self.causal} if self.causal else {}
        return self.shape.case(seed=seed, **features)

    @property
    def group(self) -> tuple:
        """Everything but the sequence length: one line in a plot, one OOM frontier."""
        s = self.shape
        return (self.mode, s.dtype, s.head_dim, self.causal or "none", s.batch, s.heads)

    @property
    def key(self) -> tuple:
        return self.group + (self.shape.seq_len, self.shape.kv_len or self.shape.seq_len)


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    description: str
    configs: tuple
    impls: dict = dataclasses.field(default_factory=dict)  # device -> tuple of names; absent: all available
    max_repeats: int = 7
    min_repeats: int = 3
    measure_budget_s: float = 2.0   # timed repeats per measurement: about this long, within [min, max]
    input_sets: int = 3             # input draws per configuration, cycled between repeats
    time_budget_s: float | None = None  # after this, remaining measurements are recorded as skipped
    # A module with ``run_suite(out_dir, device) -> list[Path]`` that replaces the timing run
    # (a suite that measures something other than the registry's implementations).
    runner: str | None = None


def grid(seq_lens, *, batch=1, heads=8, head_dims=(64,), dtypes=("float32",), causal=(None,),
         modes=MODES) -> list[Config]:
    """Groups in order (mode, dtype, D, causal), sequence lengths ascending inside each group
    (so an out-of-memory at one length stands for the longer ones)."""
    return [Config(Shape(batch, heads, n, d, dt), c, m)
            for m in modes for dt in dtypes for d in head_dims for c in causal for n in seq_lens]


QUICK_CPU_IMPLS = ("jax_impl.cpu", "jax_impl.xla", "jax.dense", "jax.nn.xla", "torch.manual", "torch.sdpa.auto")


def _quick() -> Suite:
    return Suite(
        "quick",
        "jax_impl's default CPU path against dense JAX, jax.nn, torch manual and torch SDPA: "
        "fp32, B=1, H=2, D=64, L=512..8192, forward and forward+backward (H=2 keeps it under "
        "10 minutes on 2 CPU cores; on a GPU every available implementation runs)",
        tuple(grid((512, 1024, 2048, 4096, 8192), heads=2)),
        impls={"cpu": QUICK_CPU_IMPLS},
        max_repeats=7, min_repeats=3, measure_budget_s=2.0, input_sets=3, time_budget_s=None)


def _course() -> Suite:
    return Suite(
        "course",
        "dense against fused attention until memory runs out: fp16, B=1, H=8, D=64, L=128..32768 (until memory ends), "
        "manual attention against fused kernels, forward and forward+backward",
        tuple(grid((128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768), heads=8,
                   dtypes=("float16",))),
        max_repeats=20, min_repeats=3, measure_budget_s=1.0)


def _sweep() -> Suite:
    return Suite(
        "sweep",
        "everything: fp32/fp16/bf16, causal and not, D=64/128, L=128..32768 (until memory ends), "
        "forward and forward+backward (a GPU, or a patient CPU)",
        tuple(grid((128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768), heads=8, head_dims=(64, 128),
                   dtypes=("float32", "float16", "bfloat16"), causal=(None, "top_left"))),
        max_repeats=20, min_repeats=3, measure_budget_s=1.0)


# The first pass (L=4096 and 8192, D=64/128, causal and not, both modes) is what the GPU table of
# docs/results.md quotes; a time budget cuts the rest (other lengths, fp16) first.
GPU_FIRST = tuple(Config(Shape(1, 8, n, d, "bfloat16"), c, m)
                  for c in (None, "top_left") for d in (64, 128) for n in (4096, 8192) for m in MODES)
# The xla path is left out: 100-275 ms per call at L=8192 on an H200 (1-3.5 TFLOP/s, measured
# once, benchmarks/results/nvidia-h200/) would spend a fifth of the budget.
GPU_IMPLS = ("jax_impl.mosaic_gpu", "jax_impl.pallas_triton", "jax.nn.cudnn", "jax.pallas.mha", "tokamax", "flash_attn",
             "torch.sdpa.flash", "torch.sdpa.cudnn", "torch.manual")


def _gpu() -> Suite:
    lens = (512, 1024, 2048, 4096, 8192, 16384)
    groups = [("bfloat16", 64, None), ("bfloat16", 128, None), ("bfloat16", 64, "top_left"),
              ("bfloat16", 128, "top_left"), ("float16", 64, None)]
    rest = [Config(Shape(1, 8, n, d, dt), c, m) for dt, d, c in groups for n in lens for m in MODES]
    return Suite(
        "gpu",
        "one GPU: bf16 (and fp16 at D=64), B=1, H=8, L=512..16384, D=64/128, causal and not, forward "
        "and forward+backward; jax_impl's kernel beside cuDNN (jax.nn and torch), JAX's Pallas mha, "
        "FlashAttention (torch SDPA's flash, and flash_attn/tokamax where installed) and torch "
        "manual; L=4096 and 8192 first; a time budget keeps it under 8 minutes (what it "
        "cuts is recorded as skipped)",
        GPU_FIRST + tuple(c for c in rest if c not in GPU_FIRST),
        impls={"cuda": GPU_IMPLS},
        max_repeats=30, min_repeats=5, measure_budget_s=0.25, input_sets=3, time_budget_s=360.0)


# The larger shape of issue 24 (B=4, H=16: 8x the work of B=1, H=8 at L=8192). Mode innermost:
# both modes of a configuration time the same inputs, drawn once (measure.draw_inputs). D=128
# first (the largest gap to cuDNN at B=1): a budget cut falls on D=64, causal last. Each
# configuration pays a draw and a float64 oracle slice on the host (12 and 19 s, once, on 2
# loaded cores at D=128), besides the timed calls.
GPU_LARGE = tuple(Config(Shape(4, 16, 8192, d, "bfloat16"), c, m)
                  for d in (128, 64) for c in (None, "top_left") for m in MODES)
GPU_LARGE_IMPLS = ("jax_impl.mosaic_gpu", "jax_impl.pallas_triton", "jax.nn.cudnn", "torch.sdpa.cudnn",
                   "torch.sdpa.flash")


def _gpu_large() -> Suite:
    return Suite(
        "gpu_large",
        "one GPU, the larger shape: bf16, B=4, H=16, L=8192, D=64/128, causal and not, forward and "
        "forward+backward; jax_impl's Mosaic GPU and Triton kernels beside cuDNN (jax.nn and torch) "
        "and torch SDPA's flash (FlashAttention-2); one input set (512 MiB of q, k, v and dO at "
        "D=128: no cache holds it) and 3-5 repeats, within 75 s (run_gpu.sh's step 3a, LARGE_BUDGET)",
        GPU_LARGE, impls={"cuda": GPU_LARGE_IMPLS},
        max_repeats=5, min_repeats=3, measure_budget_s=0.1, input_sets=1, time_budget_s=75.0)


def _mosaic_tiles() -> Suite:
    from benchmarks.mosaic_tiles import PLUGINS
    return Suite(
        "mosaic_tiles",
        "the Mosaic GPU forward's tile candidates (benchmarks/mosaic_tiles.py) beside its default "
        "tiles and torch's cuDNN: bf16, B=1, H=8, L=8192, D=64/128, causal and not, forward "
        "only; a time budget of 120 s (run_gpu.sh's step 3b, TILES_BUDGET)",
        tuple(Config(Shape(1, 8, 8192, d, "bfloat16"), c, "fwd") for d in (64, 128)
              for c in (None, "top_left")),
        impls={"cuda": ("jax_impl.mosaic_gpu", *PLUGINS, "torch.sdpa.cudnn")},
        max_repeats=30, min_repeats=5, measure_budget_s=0.25, input_sets=2, time_budget_s=120.0)


def _mosaic_dq() -> Suite:
    from benchmarks.mosaic_tiles import DQ_PLUGINS
    return Suite(
        "mosaic_dq",
        "the Mosaic GPU backward's dQ strategies (benchmarks/mosaic_tiles.py: a dQ kernel of its "
        "own, or dS K added in the dK/dV kernel by TMA reduce-add) side by side: bf16, B=1, H=8, "
        "L=8192, D=128 and 64, causal, forward+backward; a time budget of 20 s (run_gpu.sh's "
        "step 3c, DQ_BUDGET)",
        tuple(Config(Shape(1, 8, 8192, d, "bfloat16"), "top_left", "fwd+bwd") for d in (128, 64)),
        impls={"cuda": DQ_PLUGINS},
        max_repeats=10, min_repeats=3, measure_budget_s=0.25, input_sets=1, time_budget_s=20.0)


# A prefill chunk of few query rows against a long cache, GQA 32:8 (Lq=64: half an item per
# query head) and 64:8 (Lq=96), D=128, not causal: where the forward packs the query group.
PACKED_GQA = tuple(Config(Shape(4, heads, lq, 128, "bfloat16", kv_heads=8, kv_len=8192), None, "fwd")
                   for heads, lq in ((32, 64), (64, 96)))


def _mosaic_pack() -> Suite:
    from benchmarks.mosaic_tiles import PACK_PLUGINS
    return Suite(
        "mosaic_pack",
        "the Mosaic GPU forward with its query group packed into the rows (the default there) "
        "beside the same call unpacked (benchmarks/mosaic_tiles.py), the Triton kernel and torch's "
        "cuDNN: bf16, B=4, GQA 32:8 at Lq=64 and 64:8 at Lq=96, Lk=8192, D=128, forward; a time "
        "budget of 20 s (run_gpu.sh's step 3d, PACK_BUDGET)",
        PACKED_GQA, impls={"cuda": ("jax_impl.mosaic_gpu", *PACK_PLUGINS, "jax_impl.pallas_triton",
                                    "torch.sdpa.cudnn")},
        max_repeats=10, min_repeats=3, measure_budget_s=0.25, input_sets=1, time_budget_s=20.0)


def _sharded() -> Suite:
    return Suite(
        "sharded",
        "many devices: per-device memory (arguments + temporaries) and collectives of the "
        "compiled forward and forward+backward under plain jit vs device count (1, 2, 4, 8) at "
        "L=32768, H=8, D=64 fp32 causal, sequence sharded (the cost model's choice, and ring, "
        "all-to-all and hybrid side by side, with their estimated bytes sent) and heads sharded "
        "(local); compiled, never run (on a CPU host: 8 virtual devices in a subprocess, which "
        "also times each strategy's fwd+bwd at min(L, 2048))",
        (), runner="benchmarks.sharded")


def _dropout() -> Suite:
    return Suite(
        "dropout",
        "attention dropout 0.1 (shared pattern, and per batch row and head) beside 0.0 on the "
        "default path, forward and forward+backward, B=1 H=8 L=2048 D=64 fp32: median of "
        "interleaved per-repeat ratios with quartiles",
        (), runner="benchmarks.dropout_cost")


def _cpu() -> Suite:
    return Suite(
        "cpu",
        "the default CPU path (xla) against torch SDPA in the same dtype: fp32 and bf16, causal "
        "and not, L=2048 and 8192, B=1 H=8 D=64, forward and forward+backward: median of "
        "interleaved per-pair ratios with quartiles",
        (), runner="benchmarks.cpu_speed")


def _decode() -> Suite:
    return Suite(
        "decode",
        "decoding against a long KV cache: B x cached length, 1 and 4 query rows, GQA 32/8, D=128, "
        "fp32 and bf16, dense and paged (page size 16; 64 at the largest point), beside torch SDPA "
        "(and on a GPU jax.nn cuDNN, flash_attn_with_kvcache) and a streaming read of the cache: "
        "median times, per-repeat ratios with quartiles, GB/s and its fraction of the stream",
        (), runner="benchmarks.decode")


def _masks() -> Suite:
    return Suite(
        "masks",
        "programmable block-sparse attention (mask_mod + block_mask, score_mod, segment ids) beside "
        "torch's FlexAttention compiled, torch SDPA with the dense mask or bias and the plain "
        "calls: packed documents, prefix-LM, sliding window + global tokens at L=8192, ALiBi and "
        "T5 relative bias at L=4096, B=1 H=8 D=64, forward and forward+backward: median of "
        "interleaved per-repeat ratios with quartiles",
        (), runner="benchmarks.masks")


SUITES = {s.name: s for s in (_quick(), _course(), _sweep(), _gpu(), _gpu_large(), _mosaic_tiles(), _mosaic_dq(),
                              _mosaic_pack(), _sharded(),
                              _dropout(), _cpu(), _decode(), _masks())}


def get_suite(name: str) -> Suite:
    if name not in SUITES:
        raise ValueError(f"suite {name!r} must be one of {tuple(SUITES)}")
    return SUITES[name]
