#!/usr/bin/env bash
# Run from the repository root on a TPU host (jax[tpu] installed):
#   1. conformance, quick suite, on the Mosaic TPU kernel and the xla path (python -m conformance
#      --suite quick --impl jax_impl.mosaic_tpu --impl jax_impl.xla), CONF_TIMEOUT s (150),
#   2. forward timings (python -m benchmarks.tpu_timing: mosaic_tpu beside the xla path and
#      splash attention, bf16 B=1 H=8 L=4096 D=128, causal and not, device-synchronised medians
#      and quartiles), with what TOTAL_BUDGET (420 s) leaves, at least 30 s,
# everything under $OUT (default ./out): run_tpu.log (exit codes, timings, log tails),
# conformance/ and conformance.log, tpu_timing.md/.json and tpu_timing.log, environment.txt.
# Knobs: PYTHON (python3), CONF_SUITE (quick), CONF_IMPLS ("jax_impl.mosaic_tpu jax_impl.xla"),
# CONF_TIMEOUT (150), SKIP_CONFORMANCE (0), TIMING_ARGS (extra arguments, e.g. "--repeats 50"),
# TOTAL_BUDGET (420).
set -u
OUT=${OUT:-./out}
PYTHON=${PYTHON:-python3}
CONF_SUITE=${CONF_SUITE:-quick}
CONF_IMPLS=${CONF_IMPLS:-"jax_impl.mosaic_tpu jax_impl.xla"}
TOTAL_BUDGET=${TOTAL_BUDGET:-420}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/run_tpu.log"
export CONFORMANCE_NO_PROGRESS=1 PYTHONUNBUFFERED=1
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

log "conformance=$CONF_SUITE ($CONF_IMPLS) budget=${TOTAL_BUDGET}s out=$OUT"
"$PYTHON" -c "import sys, jax; print(sys.version); print(jax.__version__, jax.devices())" \
  > "$OUT/environment.txt" 2>&1 || true

conf_rc=skipped
if [ "${SKIP_CONFORMANCE:-0}" != "1" ]; then
  impl_args=""
  for i in $CONF_IMPLS; do impl_args="$impl_args --impl $i"; done
  start=$SECONDS
  timeout "${CONF_TIMEOUT:-150}" "$PYTHON" -m conformance --suite "$CONF_SUITE" $impl_args \
    --out "$OUT/conformance" > "$OUT/conformance.log" 2>&1
  conf_rc=$?
  log "conformance exit $conf_rc in $((SECONDS - start)) s (124 = timed out; 1 = a jax_impl failure)"
  tail -n 40 "$OUT/conformance.log" >> "$LOG"
fi

left=$(( TOTAL_BUDGET - SECONDS ))
[ "$left" -lt 30 ] && left=30
start=$SECONDS
timeout "$left" "$PYTHON" -m benchmarks.tpu_timing --out "$OUT" ${TIMING_ARGS:-} \
  > "$OUT/tpu_timing.log" 2>&1
timing_rc=$?
log "timing exit $timing_rc in $((SECONDS - start)) s (limit $left s)"
tail -n 30 "$OUT/tpu_timing.log" >> "$LOG"
log "done: conformance $conf_rc, timing $timing_rc"
[ "$conf_rc" = "skipped" ] || [ "$conf_rc" = 0 ] || exit 1
[ "$timing_rc" = 0 ]
