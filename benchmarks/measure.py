"""One measurement: an implementation (a ``conformance.registry`` adapter) on one configuration.

Method, in order:
1. ``adapter.unsupported(case)``: a static reason makes the row "n.s.".
2. ``adapter.prepare`` on input set 0 (JAX: jit lower + compile), timed as ``prepare_s``; for
   JAX the compiled program's temporary bytes come from ``Prepared.memory_analysis()``. On a CPU
   a program whose temp + output bytes exceed 80% of the available memory is not run (status
   "oom", reason says "predicted"): a CPU out-of-memory kills the process instead of raising.
3. The first ``run()`` (warm-up, excluded from the statistics) is timed as ``first_call_ms``;
   the memory is measured during it (CUDA: torch's peak additional allocation, JAX's device
   peak; CPU: the process's peak resident-set growth, /proc clear_refs + VmHWM).
4. Its results are judged against the float64 oracle (``conformance.oracle.references`` and
   ``conformance.harness.judge_results``, the tolerance policy of ``conformance.tolerance``) on
   one (batch, kv-head group) slice: heads are independent, so the slice's oracle is exact and
   costs 1/(B*Hkv) of the full one. A failing verdict marks the row "WRONG": still timed, flagged
   in every table, never given a speedup.
5. Further input sets are prepared (JAX: the compilation cache makes this a load) and the
   timed repeats cycle through them (set 1, 2, ..., 0, 1, ...); each repeat is one
   ``Prepared.run()``, which blocks until the device is done. Median, quartiles, min and max.
Exceptions are results: an out-of-memory (torch.OutOfMemoryError, XLA RESOURCE_EXHAUSTED,
MemoryError, "can't allocate") is "oom", anything else "error" with its message.
"""
from __future__ import annotations

import dataclasses
import gc
import re
import time
import traceback

import numpy as np

from benchmarks import flops as flops_mod
from benchmarks.suites import Config
from conformance import harness
from conformance.cases import Inputs, make_inputs
from conformance.oracle import References, references
from conformance.adapters.base import Adapter
from conformance.runs import NotSupported

OK, WRONG, NS, OOM, ERROR, SKIPPED = "ok", "WRONG", "n.s.", "oom", "error", "skipped"
INTERPRET_REASON = ("Pallas interpret mode on CPU is a correctness tool, not a benchmark "
                    "(pass --impl jax_impl.pallas_triton to time it anyway)")
_OOM_PATTERNS = re.compile(r"out of memory|RESOURCE_EXHAUSTED|OutOfMemory|can't allocate memory|"
                           r"Cannot allocate memory|failed to allocate|Allocator .* ran out", re.I)


@dataclasses.dataclass
class Row:
    impl: str
    framework: str
    device: str
    mode: str
    dtype: str
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    causal: str
    status: str = OK
    reason: str = ""
    flops: float = 0.0
    median_ms: float | None = None
    q1_ms: float | None = None
    q3_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    repeats: int = 0
    input_sets: int = 0
    first_call_ms: float | None = None
    prepare_s: float | None = None
    flop_per_s: float | None = None
    speedup_vs_manual: float | None = None
    check_worst_ratio: float | None = None   # error / tolerance of the worst output or gradient (< 1 passes)
    check_detail: str = ""
    score_tensor_bytes: int = 0              # theory: one [B, H, Lq, Lk] tensor in the dtype
    jax_temp_bytes: int | None = None        # compiled program's temporaries (XLA memory_analysis)
    jax_output_bytes: int | None = None
    jax_peak_extra_bytes: int | None = None  # CUDA: device peak during the call minus in-use before
    torch_peak_extra_bytes: int | None = None  # CUDA: max_memory_allocated - allocated before
    rss_peak_extra_bytes: int | None = None  # CPU: process peak RSS growth during the call
    sdpa_backend: str = ""

    @property
    def config_key(self) -> tuple:
        return (self.mode, self.dtype, self.head_dim, self.causal, self.batch, self.heads, self.q_len, self.kv_len)

    @property
    def group(self) -> tuple:
        return self.config_key[:6]

    @property
    def timed(self) -> bool:
        return self.status in (OK, WRONG) and self.median_ms is not None


def new_row(adapter: Adapter, config: Config) -> Row:
    c = config.case()
    return Row(adapter.name, adapter.framework, adapter.device, config.mode, c.dtype, c.batch, c.q_heads,
               c.kv_heads, c.q_len, c.kv_len, c.head_dim, c.causal or "none",
               flops=flops_mod.case_flops(c, config.mode),
               score_tensor_bytes=flops_mod.score_tensor_bytes(c.batch, c.q_heads, c.q_len, c.kv_len, c.dtype))


def is_oom(e: BaseException) -> bool:
    if isinstance(e, MemoryError):
        return True
    name = type(e).__name__
    return "OutOfMemory" in name or bool(_OOM_PATTERNS.search(str(e)))


# --- correctness on one slice ------------------------------------------------------------------

def check_slice(inputs: Inputs) -> Inputs:
    """Batch 0 and kv head 0 with its query heads: an exact sub-problem of ``inputs``."""
    c = inputs.case
    g = c.q_heads // c.kv_heads
    sub = dataclasses.replace(c, name=c.name + "[b0,kvh0]", batch=1, q_heads=g, kv_heads=1)
    cut = lambda x, h: None if x is None else x[:1, :, :h]
    heads_dim1 = lambda x, h: None if x is None else x[:1, :h] if x.shape[1] > 1 else x[:1]
    first = lambda x: None if x is None else x[:1]
    return Inputs(sub, cut(inputs.q, g), cut(inputs.k, 1), cut(inputs.v, 1), cut(inputs.cotangent, g),
                  heads_dim1(inputs.bias, g), heads_dim1(inputs.mask, g), first(inputs.q_lengths),
                  first(inputs.kv_lengths), first(inputs.q_segment_ids), first(inputs.kv_segment_ids))


def slice_values(values: dict, case) -> dict:
    g = case.q_heads // case.kv_heads
    out = {}
    for name, x in values.items():
        if name in ("out", "dq"):
            out[name] = x[:1, :, :g]
        elif name in ("dk", "dv"):
            out[name] = x[:1, :, :1]
        elif name == "dbias":
            out[name] = x[:1, :g] if x.shape[1] > 1 else x[:1]
    return out


class ReferenceCache:
    """float64 oracle + same-dtype baseline per configuration slice (shared by every
    implementation and by both modes: forward uses the outputs only). An entry is O(L * D)."""

    def __init__(self):
        self._cache: dict = {}
        self.seconds = 0.0

    def get(self, config: Config, inputs: Inputs, backward: bool) -> References:
        key = (config.key[1:], config.case().seed)
        if key not in self._cache:
            start = time.perf_counter()
            self._cache[key] = references(check_slice(inputs))
            self.seconds += time.perf_counter() - start
        refs = self._cache[key]
        if backward:
            return refs
        return References({"out": refs.oracle["out"]}, {"out": refs.baseline["out"]})


def judge(values: dict, inputs: Inputs, refs: References) -> tuple[bool, float, str]:
    verdicts = harness.judge_results(slice_values(values, inputs.case), refs, inputs.case.dtype)
    worst = max(verdicts, key=lambda v: v.ratio)
    detail = "; ".join(f"{v.name} err {v.error:.2e} tol {v.tolerance:.2e}" for v in verdicts if not v.passed) \
        or f"worst {worst.name} err {worst.error:.2e} <= tol {worst.tolerance:.2e}"
    return all(v.passed for v in verdicts), float(worst.ratio), detail


# --- memory -------------------------------------------------------------------------------------

def available_cpu_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(field + r":\s+(\d+)\s+kB", f.read())
        return int(m.group(1)) * 1024 if m else None
    except OSError:
        return None


class MemoryProbe:
    """Context for one call: what the device and framework can say about its peak."""

    def __init__(self, adapter: Adapter):
        self.adapter = adapter
        self.result: dict = {}

    def __enter__(self):
        a = self.adapter
        self._rss = None
        if a.device == "cpu":
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets VmHWM to the current RSS
                self._rss = _status_kib("VmRSS")
            except OSError:
                self._rss = None
        elif a.framework == "torch":
            import torch
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._torch_base = torch.cuda.memory_allocated()
        else:
            import jax
            self._dev = jax.devices("gpu")[0]
            stats = self._dev.memory_stats() or {}
            self._jax_before = (stats.get("bytes_in_use"), stats.get("peak_bytes_in_use"))
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            return False
        a = self.adapter
        if a.device == "cpu":
            peak = _status_kib("VmHWM")
            if self._rss is not None and peak is not None:
                self.result["rss_peak_extra_bytes"] = max(0, peak - self._rss)
        elif a.framework == "torch":
            import torch
            self.result["torch_peak_extra_bytes"] = torch.cuda.max_memory_allocated() - self._torch_base
        else:
            stats = self._dev.memory_stats() or {}
            in_use, peak_before = self._jax_before
            peak = stats.get("peak_bytes_in_use")
            # the process-wide peak only moves up: a call that stays below an earlier peak is not observable
            if None not in (in_use, peak_before, peak) and peak > peak_before:
                self.result["jax_peak_extra_bytes"] = peak - in_use
        return False


# --- the measurement ----------------------------------------------------------------------------

@dataclasses.dataclass
class Options:
    max_repeats: int = 7
    min_repeats: int = 3
    measure_budget_s: float = 2.0
    input_sets: int = 3
    check: bool = True
    allow_interpret: bool = False    # time jax_impl.pallas_triton in interpret mode on CPU
    memory_guard: float = 0.8        # CPU: fraction of available memory a JAX program may need


def _release(device: str):
    gc.collect()
    if device == "cuda":
        try:
            import torch
            torch.cuda.empty_cache()
        except Exception:
            pass


_last_draw: tuple = ((), [])  # (cases, their Inputs): the previous measurement's


def draw_inputs(config: Config, input_sets: int) -> list[Inputs]:
    """The input sets of ``config``, drawn once for the measurements in a row that need the same
    cases (every implementation of a configuration, and both modes): a set of B=4, H=16,
    L=8192, D=128 takes seconds of numpy, more than the timed calls. Adapters copy them."""
    global _last_draw
    cases = tuple(config.case(seed=s) for s in range(max(1, input_sets)))
    if _last_draw[0] != cases:
        _last_draw = ((), [])  # the previous draw is freed before the next is made
        _last_draw = (cases, [make_inputs(c) for c in cases])
    return _last_draw[1]


def measure(adapter: Adapter, config: Config, refs: ReferenceCache | None, opts: Options) -> Row:
    row = new_row(adapter, config)
    case0 = config.case(seed=0)
    if adapter.name == "jax_impl.pallas_triton" and adapter.device == "cpu" and not opts.allow_interpret:
        row.status, row.reason = SKIPPED, INTERPRET_REASON
        return row
    reason = adapter.unsupported(case0)
    if reason:
        row.status, row.reason = NS, reason
        return row
    backward = config.mode == "fwd+bwd"
    prepared = []
    try:
        inputs = draw_inputs(config, opts.input_sets)
        start = time.perf_counter()
        first = adapter.prepare(inputs[0], backward=backward)
        row.prepare_s = time.perf_counter() - start
        prepared.append(first)
        row.sdpa_backend = str(first.info.get("sdpa_backend") or "")
        mem = first.memory_analysis()
        if mem:
            row.jax_temp_bytes = mem.get("temp_size_in_bytes")
            row.jax_output_bytes = mem.get("output_size_in_bytes")
            if adapter.device == "cpu":
                need = (row.jax_temp_bytes or 0) + (row.jax_output_bytes or 0)
                avail = available_cpu_bytes()
                if avail is not None and need > opts.memory_guard * avail:
                    row.status = OOM
                    row.reason = (f"predicted: the compiled program needs {flops_mod.binary_size(need)}, "
                                  f"{flops_mod.binary_size(avail)} available (not run: a CPU OOM kills the process)")
                    return row
        with MemoryProbe(adapter) as probe:
            start = time.perf_counter()
            first.run()
            row.first_call_ms = (time.perf_counter() - start) * 1e3
        for name, value in probe.result.items():
            setattr(row, name, value)
        if refs is not None and opts.check:
            ok, ratio, detail = judge(first.results(), inputs[0], refs.get(config, inputs[0], backward))
            row.check_worst_ratio, row.check_detail = ratio, detail
            if not ok:
                row.status = WRONG
                row.reason = "fails the float64-oracle check: " + detail
        else:
            row.check_detail = "not checked"
        for inp in inputs[1:]:
            prepared.append(adapter.prepare(inp, backward=backward))
        first_s = row.first_call_ms / 1e3
        n = int(np.clip(round(opts.measure_budget_s / max(first_s, 1e-6)), opts.min_repeats, opts.max_repeats))
        order = [prepared[(i + 1) % len(prepared)] for i in range(n)]
        times = []
        for p in order:
            start = time.perf_counter()
            p.run()
            times.append(time.perf_counter() - start)
        t = np.array(times) * 1e3
        row.median_ms = float(np.median(t))
        row.q1_ms, row.q3_ms = (float(x) for x in np.percentile(t, [25, 75]))
        row.min_ms, row.max_ms = float(t.min()), float(t.max())
        row.repeats, row.input_sets = n, len(prepared)
        row.flop_per_s = row.flops / (row.median_ms / 1e3)
    except NotSupported as e:
        row.status, row.reason = (OOM if is_oom(e) else NS), str(e)[:500]
    except Exception as e:  # a crash or an out-of-memory is a result
        row.status = OOM if is_oom(e) else ERROR
        row.reason = f"{type(e).__name__}: {str(e)[:400]}"
        if row.status == ERROR:
            row.reason += " | " + traceback.format_exc(limit=2)[-300:].replace("\n", " ")
    finally:
        del prepared
        _release(adapter.device)
    return row


def add_speedups(rows: list[Row], baseline: str = "torch.manual") -> None:
    """speedup = baseline median / row median, per configuration, for correct timed rows only."""
    base = {r.config_key: r for r in rows if r.impl == baseline and r.status == OK and r.median_ms}
    for r in rows:
        b = base.get(r.config_key)
        r.speedup_vs_manual = (b.median_ms / r.median_ms) if (b and r.status == OK and r.median_ms) else None


# --- interleaved per-pair ratios ----------------------------------------------------------------

SETTLE_S = 0.02  # seconds between interleaved calls (see interleaved_ratios)


def interleaved_ratios(calls: dict, baseline: str, repeats: int, shuffle_seed: int | None = None,
                       settle_s: float | None = None) -> dict:
    """Time each of ``calls`` (name -> a blocking function of no arguments) once per repeat, in
    order, and divide by the ``baseline`` call of the same repeat: load from other work then
    hits both sides of a ratio alike. Call each once beforehand to compile/warm up.
    ``shuffle_seed``: each repeat runs the calls in a fresh random order drawn from it, so that
    no call always follows the same one (a fixed or rotated order does: a call after torch's,
    in the rotated CPU decode runs, the call right after torch's ran the same kernel 1.3x slower
    than it ran elsewhere; in shuffled runs the two measured the same).
    ``settle_s``: a pause before each call, so that threads a previous call left spinning
    (torch's OpenMP pool busy-waits after each parallel region) do not take a core from it: on
    the 2-core machine a CPU decode call right after torch SDPA took 1.2x its time after one of
    ours; with 10 ms between them, the same. None: ``SETTLE_S`` on a CPU backend, 0 on an
    accelerator (no host thread spins between its calls; the pauses would eat a device run).

    -> name -> {median_ms, ratio_median, ratio_q1, ratio_q3} (the quartiles of the per-repeat
    ratios; the baseline's ratios are all 1).
    """
    if settle_s is None:
        import jax
        settle_s = SETTLE_S if jax.default_backend() == "cpu" else 0.0
    names = list(calls)
    seconds = {name: [] for name in names}
    rng = None if shuffle_seed is None else np.random.default_rng(shuffle_seed)
    for _ in range(repeats):
        for index in (range(len(names)) if rng is None else rng.permutation(len(names))):
            name = names[index]
            if settle_s > 0:
                time.sleep(settle_s)
            start = time.perf_counter()
            calls[name]()
            seconds[name].append(time.perf_counter() - start)
    summary = {}
    for name, times in seconds.items():
        summary[name] = dict(median_ms=1e3 * float(np.median(times)), **ratio_quartiles(times, seconds[baseline]),
                             times_ms=[round(1e3 * t, 3) for t in times])
    return summary


def ratio_quartiles(times, baseline_times) -> dict:
    """The per-repeat ratios times[i] / baseline_times[i] of two interleaved calls ->
    {ratio_median, ratio_q1, ratio_q3}."""
    ratios = np.asarray(times, float) / np.asarray(baseline_times, float)
    return dict(ratio_median=float(np.median(ratios)), ratio_q1=float(np.percentile(ratios, 25)),
                ratio_q3=float(np.percentile(ratios, 75)))
