"""The host's matrix features and its measured arithmetic peak per unit, for ``--suite cpu``.

``features()`` reads /proc/cpuinfo's flags: which of the units the C++ kernel can use are there
(FMA, AVX-512, AVX512-BF16, AVX512-FP16, AMX). ``peaks()`` measures each unit's peak on this
host instead of computing it from a clock and a port count (a VM's reported clock is not what
the cores run at, and vector width is not throughput: a 2 x 256-bit FMA core runs one 512-bit
FMA a cycle): a loop of 12 independent chains of fused multiply-adds (float32 FMA: 2 FLOPs per
lane) or bfloat16 dot products (vdpbf16ps: 4 FLOPs per float32 lane), one per thread on every
thread at once, built with the kernel's compiler for this machine. The best of three runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

WATCHED = ("fma", "avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")

_SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
// FLOP/s of one thread running `step` (one instruction on an accumulator: `flops` per call) on
// 12 independent accumulators, so that latency does not bound it.
template <typename Step>
static double rate(long steps, double flops, Step step) {
#define DECLARE(i) __m512 a##i = _mm512_set1_ps(i * 1e-3f);
  CHAINS(DECLARE)
  auto start = std::chrono::steady_clock::now();
  for (long s = 0; s < steps; ++s) {
#define STEP(i) a##i = step(a##i);
    CHAINS(STEP)
    asm volatile("" : "+v"(a0));
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  float sink = 0;
#define SINK(i) sink += a##i[0];
  CHAINS(SINK)
  if (sink == 1234.5f) std::puts("");
  return steps * 12.0 * flops / seconds;
}
static double fma_rate(long steps) {
  const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-4f);
  return rate(steps, 16 * 2, [&](__m512 a) { return _mm512_fmadd_ps(a, x, y); });
}
#if defined(__AVX512BF16__)
static double bf16_rate(long steps) {
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x38003800);
  return rate(steps, 16 * 4, [&](__m512 a) { return _mm512_dpbf16_ps(a, x, y); });
}
#endif
template <typename F>
static double all_threads(int threads, F rate) {
  std::vector<double> each(threads);
  std::vector<std::thread> running;
  for (int t = 0; t < threads; ++t) running.emplace_back([&, t] { each[t] = rate(50000000); });
  for (auto& t : running) t.join();
  double total = 0;
  for (double r : each) total += r;
  return total;
}
int main(int argc, char** argv) {
  const int threads = std::atoi(argv[1]);
  std::printf("{\"float32_fma\": %.4g", all_threads(threads, fma_rate));
#if defined(__AVX512BF16__)
  std::printf(", \"bfloat16_dot\": %.4g", all_threads(threads, bf16_rate));
#endif
  std::printf("}\n");
}
"""


def features() -> dict:
    """flag -> present, for the flags of WATCHED (all False where /proc/cpuinfo is unreadable)."""
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
        flags = set(line.split(":", 1)[1].split())
    except (OSError, StopIteration):
        flags = set()
    return {name: name in flags for name in WATCHED}


def peaks(threads: int | None = None) -> dict:
    """unit -> measured FLOP/s over ``threads`` threads (default: every CPU), best of three:
    "float32_fma", and "bfloat16_dot" where the CPU has AVX512-BF16. {} without AVX-512 or a
    compiler (the suite then prints no fraction of the peak)."""
    from jax_impl.cpu_kernel import build

    compiler = build._compiler()
    if compiler is None or not features()["avx512f"]:
        return {}
    threads = threads or os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "peak.cc", Path(tmp) / "peak"
        source.write_text(_SOURCE)
        subprocess.run([compiler, "-O2", "-march=native", "-std=c++17", str(source), "-o", str(binary),
                        "-lpthread"], check=True, capture_output=True)
        runs = [json.loads(subprocess.run([str(binary), str(threads)], check=True, capture_output=True,
                                          text=True).stdout) for _ in range(3)]
    return {unit: max(run[unit] for run in runs) for unit in runs[0]}
