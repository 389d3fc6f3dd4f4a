"""The fused CPU kernel under AddressSanitizer + UndefinedBehaviorSanitizer, fuzzed against the
float64 oracle: every family of cpu_fuzz.py, in three processes (one test per group of
families, ``GROUPS``: the import and start-up under the sanitizers, about 12 s, paid three
times instead of eighteen).

``CPU_FUZZ_SAMPLE`` picks the draws (cpu_fuzz.calls_in): "ci" (the default) the first third of
each family's configurations and every call of the regressions and huge_logits, 320 of the
754 calls, every case of ``REQUIRED_COVERAGE`` among them; "full" all of them, the run before any change to the C++
kernel lands:

    CPU_FUZZ_SAMPLE=full python3 -m pytest -n 2 tests/jax_impl/test_cpu_kernel_sanitized.py

The kernel is built with ``JAX_FLASH_ATTENTION_CPU_SANITIZE=1`` (build.py: ASan + UBSan, UBSan
not recoverable) into the usual cache (``$JAX_FLASH_ATTENTION_CACHE`` or
``~/.cache/jax_flash_attention``; the flags are part of the cache key); such a library loads
only into a process started with ``LD_PRELOAD=build.sanitizer_preload()``, so each family runs
in a subprocess with it. A test fails on a crash or a nonzero exit, on any ASan/UBSan report in
stderr, on a judged failure (a result off the oracle, or a NaN pattern other than the
oracle's), and on a refusal (the FEATURE families, cpu_fuzz.FEATURE_FAMILIES: bias, dense mask,
soft cap, dropout, sinks, any head_dim, score_mod and mask_mod, must run on the kernel). The message gives the last
input the family printed (the one that crashed), the sanitizer's report and the command that
reruns that call alone.

Cost on the slower 2-core machine (AVX2), a cold build of the sanitized library ~33 s (on the
AVX512-BF16 machine, with the bfloat16 kernels' instances too, ~11 min at load average ~10), then the
"full" sample 355-465 test-seconds (1-32 s per family: a few compilations, 2-80 calls), the
"ci" sample 159 test-seconds run alone (2026-12-02).

``CPU_FUZZ_SEED`` draws another sample (default 0). Skipped only where the sanitizers cannot
run: not Linux, no C++ compiler, or a compiler without the ASan/UBSan runtimes.
"""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import cpu_fuzz
import pytest

ROOT = Path(__file__).resolve().parents[2]
FUZZ = Path(__file__).resolve().with_name("cpu_fuzz.py")
SEED = int(os.environ.get("CPU_FUZZ_SEED", "0"))
SAMPLE = os.environ.get("CPU_FUZZ_SAMPLE", "ci")
if SAMPLE not in cpu_fuzz.SAMPLES:
    raise ValueError(f"CPU_FUZZ_SAMPLE must be one of {cpu_fuzz.SAMPLES}, got {SAMPLE!r}")
TIMEOUT_S = 300  # per family (a corrupted heap can hang the process instead of crashing it)
# A report ends the process at once: halt_on_error (ASan's default; UBSan is built with
# -fno-sanitize-recover), the exit status says so, and no leak check (Python and jaxlib leak by
# design at exit).
ASAN_OPTIONS = "detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86:handle_segv=1:handle_abort=1"
UBSAN_OPTIONS = "halt_on_error=1:print_stacktrace=1:exitcode=87"
REPORT = re.compile(r"ERROR: AddressSanitizer|runtime error:|ERROR: UndefinedBehaviorSanitizer|"
                    r"AddressSanitizer:DEADLYSIGNAL")


def _sanitizer_env() -> dict:
    if platform.system() != "Linux":
        pytest.skip(f"the sanitized kernel build is tested on Linux only (this is {platform.system()})")
    from jax_impl.cpu_kernel import build

    compiler = build._compiler()
    if compiler is None:
        pytest.skip("no C++ compiler (g++, c++, clang++ or $CXX) to build the sanitized kernel")
    try:
        preload = build.sanitizer_preload(compiler)
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"{compiler} cannot name its sanitizer runtimes: {error}")
    missing = [p for p in preload.split(":") if not (os.path.isabs(p) and os.path.exists(p))]
    if missing:
        pytest.skip(f"{compiler} has no sanitizer runtime {missing} (ASan/UBSan not installed)")
    env = dict(os.environ)
    env.pop("JAX_FLASH_ATTENTION_NO_CPU_KERNEL", None)  # this test is about the kernel
    env.update(JAX_FLASH_ATTENTION_CPU_SANITIZE="1", LD_PRELOAD=preload, ASAN_OPTIONS=ASAN_OPTIONS,
               UBSAN_OPTIONS=UBSAN_OPTIONS, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return env


@pytest.fixture(scope="module")
def sanitized_env():
    """The subprocess environment, once the sanitized library is built (~40 s cold, cached)
    and loads: a build failure fails here, with the compiler's message, not in every family."""
    env = _sanitizer_env()
    script = ("import sys\nfrom jax_impl.cpu_kernel.build import unavailable\n"
              "reason = unavailable()\nprint(reason)\nsys.exit(reason is not None)\n")
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=900, check=False)
    if proc.returncode != 0:
        pytest.fail(f"the sanitized CPU kernel did not build or load (exit {proc.returncode}): "
                    f"{proc.stdout.strip()}\n{proc.stderr[-3000:]}", pytrace=False)
    return env


def _last_input(stdout: str) -> str:
    calls = [line for line in stdout.splitlines() if line.startswith('{"call"')]
    return calls[-1] if calls else "(no call started)"


def _report_excerpt(stderr: str, lines: int = 10, width: int = 240) -> str:
    """The sanitizer's report: its first lines (what, where, the top frames; each cut to
    ``width``: XLA's FFI frames are kilobytes of template arguments) and its SUMMARY; without a
    report, the end of stderr."""
    text = stderr.splitlines()
    start = next((i for i, line in enumerate(text) if REPORT.search(line)), None)
    if start is None:
        excerpt, summary = text[-lines:], []
    else:
        excerpt = text[start:start + lines]
        summary = [line for line in text[start + lines:] if line.startswith("SUMMARY:")][:1]
    cut = lambda line: line if len(line) <= width else line[:width] + " ..."
    return "\n".join(cut(line) for line in excerpt + summary)


# Each group's families run one after the other in one process; the groups take about the same
# time (measured per family on the 2-core machine), so that pytest's two workers share them.
GROUPS = {
    "lengths": ("shapes", "lengths", "traced_lengths", "regressions", "decode", "huge_logits"),
    "bands": ("windows", "segments", "position_offset", "blocks", "packed_tiles", "decode_paged"),
    "values_and_features": ("nonfinite", "bias", "mask", "soft_cap", "dropout", "sinks",
                            "head_dim", "mods"),
}


def _summaries(stdout: str) -> dict:
    lines = (json.loads(line)["summary"] for line in stdout.splitlines()
             if line.startswith('{"summary"'))
    return {summary["family"]: summary for summary in lines}


@pytest.mark.parametrize("group", list(GROUPS))
def test_families_under_sanitizers(group, sanitized_env):
    families = GROUPS[group]
    command = [sys.executable, str(FUZZ), *families, "--seed", str(SEED), "--sample", SAMPLE]
    try:
        proc = subprocess.run(command, env=sanitized_env, cwd=ROOT, capture_output=True, text=True,
                              timeout=TIMEOUT_S * len(families), check=False)
    except subprocess.TimeoutExpired as error:
        out = error.stdout.decode() if isinstance(error.stdout, bytes) else (error.stdout or "")
        err = error.stderr.decode() if isinstance(error.stderr, bytes) else (error.stderr or "")
        pytest.fail(f"{group}: no result within {TIMEOUT_S * len(families)} s (a hang?). Last "
                    f"input:\n{_last_input(out)}\n{_report_excerpt(err)}", pytrace=False)
    report = REPORT.search(proc.stderr)
    summaries = _summaries(proc.stdout)
    missing = [f for f in families if f not in summaries]
    if report or missing:
        what = ("sanitizer report" if report
                else f"no summary of {missing} (exit status {proc.returncode})")
        pytest.fail(f"{group}: {what}. Last input:\n{_last_input(proc.stdout)}\n\n"
                    f"{_report_excerpt(proc.stderr)}", pytrace=False)
    problems = []
    for family in families:
        summary = summaries[family]
        if summary["refused"]:
            problems.append(f"FEATURE family {family!r}: the CPU kernel does not take it yet "
                            f"({summary['refused']}). It fails until the kernel does "
                            "(cpu_fuzz.FEATURE_FAMILIES).")
        elif summary["failed"]:
            problems.append(f"{family}: {summary['failed']} of {summary['calls']} calls failed; "
                            "the first:")
            for failure in summary["failures"]:
                problems += [json.dumps(failure["input"]),
                             *("    " + p for p in failure["problems"])]
        elif summary["passed"] != summary["calls"] or \
                summary["calls"] != cpu_fuzz.calls_in(family, SAMPLE):
            problems.append(f"{family}: {summary['passed']} of {summary['calls']} calls passed, "
                            f"{cpu_fuzz.calls_in(family, SAMPLE)} drawn")
    if problems or proc.returncode != 0:
        pytest.fail("\n".join(problems or [f"{group}: exit status {proc.returncode}"]),
                    pytrace=False)


# What the draws must reach together (cpu_fuzz.coverage counts it without running anything).
REQUIRED_COVERAGE = (
    "Lq != Lk", "odd Lq or Lk > 1", "Lq = 1 (decode)", "Lk = 1",
    "dtype float32", "dtype bfloat16", "dtype float16",
    "Hq/Hkv = 1", "Hq/Hkv = 2", "Hq/Hkv = 4", "MQA (Hkv = 1, Hq > 1)",
    "causal top_left", "causal bottom_right",
    "window left only", "window right only", "window both sides",
    "length 0 concrete", "length partial concrete", "length L concrete",
    "length 0 traced", "length partial traced", "length L traced", "length > L traced",
    "segment ids", "block sizes", "position offset",
    "non-finite at excluded positions", "non-finite at allowed positions",
    "FEATURE bias_shape", "FEATURE mask_shape", "FEATURE soft_cap", "FEATURE dropout",
    "FEATURE sinks", "FEATURE mods", "head_dim % 16 != 0",
    *(f"logits at the {dtype} limit, {path}" for dtype in cpu_fuzz.DTYPES
      for path in cpu_fuzz.HUGE_LOGIT_PATHS))


@pytest.mark.parametrize("sample", cpu_fuzz.SAMPLES)
def test_the_draws_cover_every_case_and_the_full_sample_500_calls_besides_the_features(sample):
    counts = cpu_fuzz.coverage(SEED, sample=sample)
    missing = [name for name in REQUIRED_COVERAGE if not counts.get(name)]
    assert not missing, f"no drawn call of the {sample!r} sample has: {missing}"
    core = sum(counts[f"family {name}"] for name, f in cpu_fuzz.FAMILIES.items() if not f.feature)
    assert core >= (500 if sample == "full" else 200), core
    assert set(cpu_fuzz.FEATURE_FAMILIES) == {n for n, f in cpu_fuzz.FAMILIES.items() if f.feature}
    grouped = [family for families in GROUPS.values() for family in families]
    assert sorted(grouped) == sorted(cpu_fuzz.FAMILIES), "every family in exactly one group"
