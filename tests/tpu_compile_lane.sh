#!/usr/bin/env bash
# The TPU compile lane: tests/tpu/ compiled for compile-only TPU chips (libtpu from jax[tpu], no
# TPU): flash_attention sharded over a 4-chip v5e mesh (batch, heads, a ring over the sequence)
# under plain jit, and a configuration of tools/tpu_compile_report.py with the committed
# report's rows checked against the code's configurations.
# The lane's environment is a venv of its own (about 1.3 GB: jax[tpu] at the suite's jax
# version, pytest), made on first use in the user's cache, outside the checkout:
# ${XDG_CACHE_HOME:-~/.cache}/jax-flash-attention-ref/tpu-compile-lane, or TPU_COMPILE_LANE_VENV=DIR.
# Temporary files and libtpu's logs go to a folder of the run's own, removed on exit.
# It is skipped, saying why, where the venv cannot be made (no venv module, or no jax[tpu] for
# this Python or machine); any other failure fails it. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TPU_COMPILE_LANE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/jax-flash-attention-ref/tpu-compile-lane}
PY=${PYTHON:-python3}
LANE_TMP=$(mktemp -d)
trap 'rm -rf "$LANE_TMP"' EXIT
if ! JAX_VERSION=$($PY -c "import jax; print(jax.__version__)" 2>/dev/null); then
  echo "tpu compile lane skipped: $PY cannot import jax (the lane installs the suite's jax version)"; exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "tpu compile lane: making the venv $VENV with $PY (about 1.3 GB: jax[tpu]==$JAX_VERSION with" \
       "libtpu, pytest); TPU_COMPILE_LANE_VENV=DIR puts it elsewhere"
  mkdir -p "$(dirname "$VENV")"
  if ! $PY -m venv "$VENV" || ! "$VENV/bin/python" -m pip install -q "jax[tpu]==$JAX_VERSION" "pytest>=8"; then
    rm -rf "$VENV"
    echo "tpu compile lane skipped: could not make $VENV (jax[tpu]==$JAX_VERSION for $($PY --version))"; exit 0
  fi
fi
LANE_JAX=$("$VENV/bin/python" -c "import jax; print(jax.__version__)")
if [ "$LANE_JAX" != "$JAX_VERSION" ]; then
  echo "tpu compile lane: $VENV has jax $LANE_JAX, the suite $JAX_VERSION: updating it"
  "$VENV/bin/python" -m pip install -q "jax[tpu]==$JAX_VERSION"
fi
echo "tpu compile lane: jax $JAX_VERSION with libtpu from the venv $VENV"
# Compile-only TPU devices on a CPU host (a second libtpu process is allowed: pytest may overlap).
TMPDIR=$LANE_TMP TPU_LOG_DIR=$LANE_TMP/tpu_logs \
  JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 TPU_WORKER_HOSTNAMES=localhost ALLOW_MULTIPLE_LIBTPU_LOAD=1 \
  TPU_COMPILE_LANE=1 PYTHONPATH=$PWD "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" tests/tpu
