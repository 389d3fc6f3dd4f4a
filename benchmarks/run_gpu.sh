#!/usr/bin/env bash
# Run from the repository root on a GPU machine:
#   1. correctness on the GPU first (python -m conformance on the Pallas Triton and Mosaic GPU
#      kernels and the cudnn route, then the
#      test suite's gpu lane: pytest -m gpu, the same tests as on the CPU with the kernels
#      compiled, bit-identity of repeated calls included; test_mosaic_gpu.py first, then the
#      other files: the lane rarely finishes within GPU_TESTS_TIMEOUT),
#   2. (off unless SKIP_TUNING=0: it ran on 2026-11-30) the Triton tile sweep (python -m tools.tune_blocks: a few candidate BlockSizes per head dim
#      64/128 x causal, bf16, L=8192, fwd+bwd); its winners replace
#      jax_impl/pallas_triton/tuned_blocks.json while step 3 runs (the tracked file is restored
#      on exit; the winners stay in $OUT/tuned_blocks.json),
#   3. the gpu benchmark suite (B=1, H=8; its GPU implementations, each result also checked
#      against the float64 oracle before it is timed), with what is left of TOTAL_BUDGET;
#      its tables are $OUT/bench_summary.md and $OUT/bench_gpu.json,
#   3a. the larger shape (python -m benchmarks --suite gpu_large: bf16, B=4, H=16, L=8192,
#      D=64/128, causal and not, forward and forward+backward; the Mosaic GPU and Triton kernels,
#      jax.nn's and torch's cuDNN, torch's flash; one input set, 3-5 repeats), LARGE_BUDGET s
#      (default 150; 0 skips it), taken out of step 3's budget; its tables are
#      $OUT/bench_gpu_large.md and $OUT/bench_gpu_large.json (each has a table of every
#      implementation's time over torch cuDNN's, as step 3's has),
#   3e. (run right after 3a) programmable block-sparse attention (python -m benchmarks --suite
#      masks: packed documents through segment ids and through mask_mod + block_mask beside torch's
#      FlexAttention compiled and SDPA with the dense mask, prefix-LM, sliding window + global
#      tokens, ALiBi and T5 bias through score_mod; bf16, L=8192/4096, fwd and fwd+bwd, the packed
#      documents first), MASKS_BUDGET s (default 45; 0 skips it), taken out of step 3's budget and
#      keeping step 5's share; no new workload starts after it, so one running (flex compiles
#      for tens of seconds) may overrun it by the step's 60 s of slack; its table is
#      $OUT/bench_masks.md (3b-3d get what is left after it),
#   3b. the Mosaic GPU forward's tile candidates (python -m benchmarks --suite mosaic_tiles:
#      benchmarks/mosaic_tiles.py, each beside the default tiles and torch's cuDNN, L=8192
#      forward), TILES_BUDGET s (default 45; 0 skips it), taken out of step 3's budget; its
#      table is $OUT/bench_mosaic_tiles.md (choose jax_impl/mosaic_gpu/config.py's defaults from it);
#      it keeps step 5's share: when time is short it is cut first,
#   3c. the Mosaic GPU backward's dQ strategies (python -m benchmarks --suite mosaic_dq: a dQ
#      kernel of its own, or dS K added in the dK/dV kernel by TMA reduce-add,
#      BackwardConfig(dq="fused"); L=8192 causal fwd+bwd, D=128 and 64), DQ_BUDGET s (default
#      20; 0 skips it), taken out of step 3's budget, after 3b and cut like it; its table is
#      $OUT/bench_mosaic_dq.md,
#   3d. the Mosaic GPU forward's packed query group beside the same call unpacked (python -m
#      benchmarks --suite mosaic_pack: GQA 32:8 at Lq=64 and 64:8 at Lq=96 against Lk=8192,
#      D=128, B=4, bf16, forward; the Triton kernel and torch's cuDNN beside), PACK_BUDGET s
#      (default 20; 0 skips it), taken out of step 3's budget, after 3c and cut like it; its
#      table is $OUT/bench_mosaic_pack.md,
#   4. (off unless PEER_BUDGET > 0: measured on 2026-11-30) JAX's Hopper kernel (jax.pallas.mgpu, Mosaic GPU) at L=4096/8192, in a process of its
#      own so that a crash there cannot cost step 3's results (skipped when time is short),
#   5. the decode suite (python -m benchmarks --suite decode: a few query rows against a long dense
#      or paged KV cache beside torch SDPA, cuDNN and flash_attn_with_kvcache), DECODE_BUDGET s
#      (default 0, skipped: measured; 60 runs it, under 40 s left skips it); its table is $OUT/bench_decode.md,
# and pack everything under $OUT (default ./out) into few files:
#   $OUT/gpu_results.tar.gz   every log, table, CSV, JSON and plot
#   $OUT/bench_summary.md     the benchmark's Markdown report (also in the archive; bench_gpu.json beside it)
#   $OUT/run_gpu.log          this script's log (exit codes, timings, tails of the logs)
#   $OUT/tuned_blocks.json    the sweep's winners (commit it as jax_impl/pallas_triton/tuned_blocks.json)
#   $OUT/tuning.md            every candidate's TFLOP/s beside its compiled facts
# Knobs (environment): BENCH_DEVICE (cuda), BENCH_SUITE (gpu), BENCH_ARGS (extra arguments,
# e.g. "--time-budget 300"), BENCH_TIMEOUT (its --time-budget + 40 s), CONF_SUITE (quick), CONF_IMPLS
# ("jax_impl.pallas_triton jax_impl.mosaic_gpu jax_impl.cudnn"; the xla path is checked on CPU),
# CONF_TIMEOUT (150), SKIP_CONFORMANCE (0), PYTHON (python3), GPU_TESTS_TIMEOUT (0, skipped: 60 s ran 6 tests; N > 0 runs the
# gpu lane), SKIP_TUNING (1), TUNE_TIMEOUT (110), TUNE_ARGS (extra arguments of
# tools.tune_blocks), PEER_BUDGET (0 s for step 4: skipped), TILES_BUDGET (45), DQ_BUDGET (20),
# PACK_BUDGET (20), MASKS_BUDGET (45), DECODE_BUDGET (0), LARGE_BUDGET (150), TOTAL_BUDGET (420 s for
# steps 1-3e and 5: the benchmark's --time-budget is what is left after steps 1-2 and the 3a-3e and 5 shares,
# at least 45),
# DEADLINE (465 s: a step that starts late gets the time left before it, less its start-up and
# report and the shares of the steps it must leave time for, and is skipped when under 20 s
# (decode: 40) is left; no step's timeout runs past DEADLINE + 15 s; each step's tables are
# copied to $OUT as it ends). The defaults put the unmeasured first: conformance (it logs each
# finished run, so a timeout shows how far it got), step 3 at its 45 s floor (B=1, H=8 is
# measured), the larger shape (3a, about 165 s), then the masks step (3e) with what is left;
# 3b-3d and the decode step find under 20 s and are skipped unless earlier steps end sooner.
# A slow run ends by DEADLINE + 15 s + packing: the device tool's 8 minutes, with the
# machine's start-up on top.
set -u
OUT=${OUT:-./out}
PYTHON=${PYTHON:-python3}
DEVICE=${BENCH_DEVICE:-cuda}
SUITE=${BENCH_SUITE:-gpu}
CONF_SUITE=${CONF_SUITE:-quick}
CONF_IMPLS=${CONF_IMPLS:-"jax_impl.pallas_triton jax_impl.mosaic_gpu jax_impl.cudnn"}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
LOG="$OUT/run_gpu.log"
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.45}
export CONFORMANCE_NO_PROGRESS=1 BENCH_NO_PROGRESS=1 PYTHONUNBUFFERED=1
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
DEADLINE=${DEADLINE:-465}
# fit WANTED OVERHEAD: WANTED seconds, or what DEADLINE leaves after OVERHEAD s (a step's start-up,
# last measurement and report, as typically measured, plus what later steps keep); 0 when under
# 20 s would be left (the step is skipped).
fit() {
  local left=$(( DEADLINE - SECONDS - $2 ))
  [ "$left" -lt 20 ] && { echo 0; return; }
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}
# cap LIMIT: a step's timeout, never past DEADLINE + 15 s (the script then still packs $OUT
# within the device tool's 8 minutes; each step's tables are in $OUT as soon as it ends).
cap() {
  local left=$(( DEADLINE + 15 - SECONDS ))
  [ "$1" -lt "$left" ] && echo "$1" || echo "$(( left > 1 ? left : 1 ))"
}

# A budgeted suite: its own log (tail into $LOG) and bench_<suite>.{md,json} copied to $OUT as it
# ends, so a run cut short still brings back what finished. Sets suite_rc.
timed_suite() {
  local suite=$1 budget=$2 slack=$3 label=$4 start=$SECONDS dir="$WORK/benchmarks_$1"
  timeout "$(cap $((budget + slack)))" "$PYTHON" -m benchmarks --suite "$suite" --device "$DEVICE" \
    --time-budget "$budget" --out "$dir" > "$dir.log" 2>&1
  suite_rc=$?
  log "$label exit $suite_rc in $((SECONDS - start)) s (budget $budget s)"
  tail -n 30 "$dir.log" >> "$LOG"
  for ext in md json; do
    [ -f "$dir/bench_$suite.$ext" ] && cp "$dir/bench_$suite.$ext" "$OUT/"
  done
}

log "device=$DEVICE suite=$SUITE conformance=$CONF_SUITE ($CONF_IMPLS) out=$OUT"
{ nvidia-smi || true; "$PYTHON" -c "import sys, jax; print(sys.version); print(jax.__version__, jax.devices())" || true
  "$PYTHON" -c "import torch; print(torch.__version__, torch.cuda.is_available())" || true; } > "$WORK/environment.txt" 2>&1

conf_rc=skipped
if [ "${SKIP_CONFORMANCE:-0}" != "1" ]; then
  impl_args=""
  for i in $CONF_IMPLS; do impl_args="$impl_args --impl $i"; done
  start=$SECONDS
  timeout "${CONF_TIMEOUT:-150}" "$PYTHON" -m conformance --suite "$CONF_SUITE" --device "$DEVICE" $impl_args \
    --out "$WORK/conformance" > "$WORK/conformance.log" 2>&1
  conf_rc=$?
  log "conformance exit $conf_rc in $((SECONDS - start)) s (124 = timed out; 1 = a jax_impl failure)"
  tail -n 40 "$WORK/conformance.log" >> "$LOG"
fi

tests_rc=skipped
if [ "${GPU_TESTS_TIMEOUT:-0}" -gt 0 ]; then
  start=$SECONDS
  # shellcheck disable=SC2016
  timeout "${GPU_TESTS_TIMEOUT:-0}" bash -c '"$0" -m pytest -m gpu -q -p no:cacheprovider tests/jax_impl/test_mosaic_gpu.py
    first=$?
    "$0" -m pytest -m gpu -q -p no:cacheprovider tests/jax_impl --ignore=tests/jax_impl/test_mosaic_gpu.py
    rest=$?
    [ "$first" = 0 ] || [ "$first" = 5 ] && exit "$rest"; exit "$first"' "$PYTHON" \
    > "$WORK/gpu_tests.log" 2>&1
  tests_rc=$?
  log "gpu test lane exit $tests_rc in $((SECONDS - start)) s (124 = timed out; 5 = no gpu test collected)"
  tail -n 30 "$WORK/gpu_tests.log" >> "$LOG"
fi

tune_rc=skipped
if [ "${SKIP_TUNING:-1}" != "1" ]; then
  start=$SECONDS
  mkdir -p "$WORK/tuning"
  # shellcheck disable=SC2086
  # compiled facts come from the compile report here (pip triton) after the run: tuning.json keeps every row
  timeout "${TUNE_TIMEOUT:-110}" "$PYTHON" -m tools.tune_blocks --out "$WORK/tuning/tuned_blocks.json" \
    --report "$WORK/tuning/tuning.md" --time-budget 70 --no-compile-facts ${TUNE_ARGS:-} > "$WORK/tuning.log" 2>&1
  tune_rc=$?
  log "tile sweep exit $tune_rc in $((SECONDS - start)) s (124 = timed out)"
  tail -n 30 "$WORK/tuning.log" >> "$LOG"
  if [ "$tune_rc" = "0" ]; then
    # The benchmark step runs the tuned tiles; the tracked table is put back when the script
    # exits (commit $OUT/tuned_blocks.json by hand to keep the winners).
    tuned=jax_impl/pallas_triton/tuned_blocks.json
    cp "$tuned" "$OUT/.tuned_blocks.committed.json"
    trap 'mv "$OUT/.tuned_blocks.committed.json" "$tuned"' EXIT
    cp "$WORK/tuning/tuned_blocks.json" "$tuned"
    cp "$WORK/tuning/tuned_blocks.json" "$WORK/tuning/tuning.md" "$WORK/tuning/tuning.json" "$OUT/"
  fi
fi

start=$SECONDS
# steps 3a's, 3b's, 3c's, 3d's, 3e's and 5's shares come out of step 3's
budget=$(( ${TOTAL_BUDGET:-420} - SECONDS - ${DECODE_BUDGET:-0} - ${TILES_BUDGET:-45} - ${LARGE_BUDGET:-150} - ${DQ_BUDGET:-20} - ${PACK_BUDGET:-20} - ${MASKS_BUDGET:-45} ))
[ "$budget" -lt 45 ] && budget=45
budget=$(fit "$budget" 20)
[ "$budget" -lt 20 ] && budget=20  # step 3 always runs: the script's exit code is its
budget_arg=""
[ "$SUITE" = "gpu" ] && budget_arg="--time-budget $budget"  # runner suites (sharded, dropout) take none
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-$(cap $((budget + 40)))}" "$PYTHON" -m benchmarks --suite "$SUITE" --device "$DEVICE" \
  --out "$WORK/benchmarks" $budget_arg ${BENCH_ARGS:-} > "$WORK/benchmarks.log" 2>&1
bench_rc=$?
log "benchmarks exit $bench_rc in $((SECONDS - start)) s (124 = timed out)"
tail -n 60 "$WORK/benchmarks.log" >> "$LOG"
[ -f "$WORK/benchmarks/bench_$SUITE.md" ] && cp "$WORK/benchmarks/bench_$SUITE.md" "$OUT/bench_summary.md"
[ -f "$WORK/benchmarks/bench_$SUITE.json" ] && cp "$WORK/benchmarks/bench_$SUITE.json" "$OUT/bench_$SUITE.json"

large_rc=skipped
large_budget=$(fit "${LARGE_BUDGET:-150}" 25)
if [ "$SUITE" = "gpu" ] && [ "$large_budget" -gt 0 ]; then
  timed_suite gpu_large "$large_budget" 50 "larger shape (B=4, H=16, L=8192)"
  large_rc=$suite_rc
fi

masks_rc=skipped
masks_budget=$(fit "${MASKS_BUDGET:-45}" $(( 20 + ${DECODE_BUDGET:-0} )))  # step 5's share kept
if [ "$SUITE" = "gpu" ] && [ "$masks_budget" -gt 0 ]; then
  timed_suite masks "$masks_budget" 60 "block-sparse masks and score mods"
  masks_rc=$suite_rc
fi

tiles_rc=skipped
tiles_budget=$(fit "${TILES_BUDGET:-45}" $(( 20 + ${DECODE_BUDGET:-0} )))  # step 5's share kept: decode first
if [ "$SUITE" = "gpu" ] && [ "$tiles_budget" -gt 0 ]; then
  timed_suite mosaic_tiles "$tiles_budget" 40 "Mosaic forward tiles"
  tiles_rc=$suite_rc
fi

dq_rc=skipped
dq_budget=$(fit "${DQ_BUDGET:-20}" $(( 20 + ${DECODE_BUDGET:-0} )))  # step 5's share kept
if [ "$SUITE" = "gpu" ] && [ "$dq_budget" -gt 0 ]; then
  timed_suite mosaic_dq "$dq_budget" 40 "Mosaic backward dQ strategies"
  dq_rc=$suite_rc
fi

pack_rc=skipped
pack_budget=$(fit "${PACK_BUDGET:-20}" $(( 20 + ${DECODE_BUDGET:-0} )))  # step 5's share kept
if [ "$SUITE" = "gpu" ] && [ "$pack_budget" -gt 0 ]; then
  timed_suite mosaic_pack "$pack_budget" 40 "Mosaic GPU packed query group"
  pack_rc=$suite_rc
fi

peer_rc=skipped
peer_budget=${PEER_BUDGET:-0}
[ "$peer_budget" -gt 0 ] && peer_budget=$(fit "$peer_budget" $(( 30 + ${DECODE_BUDGET:-0} )))
if [ "$SUITE" = "gpu" ] && [ "$peer_budget" -gt 0 ]; then
  start=$SECONDS
  timeout "$(cap $((peer_budget + 60)))" "$PYTHON" -m benchmarks --suite gpu --device "$DEVICE" --impl jax.pallas.mgpu \
    --seq-lens 4096,8192 --time-budget "$peer_budget" --out "$WORK/benchmarks_mgpu" > "$WORK/benchmarks_mgpu.log" 2>&1
  peer_rc=$?
  log "Mosaic GPU peer exit $peer_rc in $((SECONDS - start)) s"
  tail -n 30 "$WORK/benchmarks_mgpu.log" >> "$LOG"
  [ -f "$WORK/benchmarks_mgpu/bench_gpu.json" ] && cp "$WORK/benchmarks_mgpu/bench_gpu.json" "$OUT/bench_mgpu.json"
fi

decode_rc=skipped
decode_budget=$(fit "${DECODE_BUDGET:-0}" 0)
if [ "$decode_budget" -ge 40 ]; then  # 30 s of it start the process and write the tables
  start=$SECONDS
  DECODE_BUDGET_S=$((decode_budget - 30)) timeout "$(cap $((decode_budget + 40)))" "$PYTHON" -m benchmarks --suite decode \
    --device "$DEVICE" --out "$WORK/benchmarks_decode" > "$WORK/benchmarks_decode.log" 2>&1
  decode_rc=$?
  log "decode suite exit $decode_rc in $((SECONDS - start)) s"
  tail -n 30 "$WORK/benchmarks_decode.log" >> "$LOG"
  [ -f "$WORK/benchmarks_decode/bench_decode.md" ] && cp "$WORK/benchmarks_decode/bench_decode.md" "$OUT/bench_decode.md"
fi

echo "conformance=$conf_rc gpu_tests=$tests_rc tuning=$tune_rc benchmarks=$bench_rc tiles=$tiles_rc dq=$dq_rc pack=$pack_rc large=$large_rc masks=$masks_rc mgpu=$peer_rc decode=$decode_rc" > "$WORK/exit_codes.txt"
log "$(cat "$WORK/exit_codes.txt") after $SECONDS s"
cp "$LOG" "$WORK/run_gpu.log"
tar -czf "$OUT/gpu_results.tar.gz" -C "$WORK" .
log "wrote $(ls "$OUT" | tr '\n' ' ')"
rm -rf "$WORK"
[ "$bench_rc" = "0" ]
