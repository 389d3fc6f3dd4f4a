#!/usr/bin/env bash
# Run from the repository root on a GPU machine:
#   1. correctness on the GPU first (python -m conformance, jax_impl's implementations),
#   2. the gpu benchmark suite (every GPU implementation, each result also checked against
#      the float64 oracle before it is timed),
# and pack everything under $OUT (default ./out) into few files:
#   $OUT/gpu_results.tar.gz   every log, table, CSV, JSON and plot
#   $OUT/bench_summary.md     the benchmark's Markdown report (also in the archive)
#   $OUT/run_gpu.log          this script's log (exit codes, timings, tails of the logs)
# Knobs (environment): BENCH_DEVICE (cuda), BENCH_SUITE (gpu), BENCH_ARGS (extra arguments,
# e.g. "--time-budget 300"), BENCH_TIMEOUT (seconds, 450), CONF_SUITE (quick), CONF_IMPLS
# ("jax_impl.pallas_triton jax_impl.xla"), CONF_TIMEOUT (150), SKIP_CONFORMANCE (0), PYTHON (python3).
set -u
OUT=${OUT:-./out}
PYTHON=${PYTHON:-python3}
DEVICE=${BENCH_DEVICE:-cuda}
SUITE=${BENCH_SUITE:-gpu}
CONF_SUITE=${CONF_SUITE:-quick}
CONF_IMPLS=${CONF_IMPLS:-"jax_impl.pallas_triton jax_impl.xla"}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
LOG="$OUT/run_gpu.log"
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.45}
export CONFORMANCE_NO_PROGRESS=1 BENCH_NO_PROGRESS=1 PYTHONUNBUFFERED=1
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

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

start=$SECONDS
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-450}" "$PYTHON" -m benchmarks --suite "$SUITE" --device "$DEVICE" --out "$WORK/benchmarks" \
  ${BENCH_ARGS:-} > "$WORK/benchmarks.log" 2>&1
bench_rc=$?
log "benchmarks exit $bench_rc in $((SECONDS - start)) s (124 = timed out)"
tail -n 60 "$WORK/benchmarks.log" >> "$LOG"

echo "conformance=$conf_rc benchmarks=$bench_rc" > "$WORK/exit_codes.txt"
cp "$LOG" "$WORK/run_gpu.log"
[ -f "$WORK/benchmarks/bench_$SUITE.md" ] && cp "$WORK/benchmarks/bench_$SUITE.md" "$OUT/bench_summary.md"
tar -czf "$OUT/gpu_results.tar.gz" -C "$WORK" .
log "wrote $(ls "$OUT" | tr '\n' ' ')"
rm -rf "$WORK"
[ "$bench_rc" = "0" ]
