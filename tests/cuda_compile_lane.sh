#!/usr/bin/env bash
# The CUDA compile lane: tests that compile for compile-only H100s under jax 0.11.2 with its
# CUDA 13 plugin (Python >= 3.12), no GPU: the Mosaic GPU kernels' sm_90a compile report
# (tests/tools/test_mosaic_compile_report.py: 0 spills, shared memory, TMA, wgmma,
# setmaxnreg; the machine's ptxas, CUDA 13, assembles) and the ring's send/compute overlap in
# XLA:GPU's schedule on 8 devices (tests/sharding/test_ring_overlap.py), and the kernels' outputs
# and gradients typed as varying inside shard_map (tests/jax_impl/test_mosaic_gpu_shard_map.py);
# then the Mosaic GPU kernels' numbers in its interpreter against the float64 oracle
# (tests/jax_impl/test_mosaic_gpu.py), the oracle run by the suite's Python (it has torch).
# The lane's environment is a venv of its own (about 1.1 GB: jax, jaxlib, the plugin without
# NVIDIA's library wheels, pytest, pytest-xdist), made on first use in the user's cache, outside
# the checkout: ${XDG_CACHE_HOME:-~/.cache}/jax-flash-attention-ref/cuda-compile-lane, or
# CUDA_COMPILE_LANE_VENV=DIR. Temporary files go to a folder of the run's own, removed on exit,
# as are the /tmp/mosaic-gpu-* folders the plugin leaves (clean_temporaries).
# The lane is skipped, saying why, where there is no Python >= 3.12 or no ptxas; any other
# failure fails it. Arguments go to pytest (e.g. --durations=20).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${CUDA_COMPILE_LANE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/jax-flash-attention-ref/cuda-compile-lane}
JAX_VERSION=0.11.2

# The plugin's Mosaic GPU compiler leaves a folder per kernel it assembles, at a fixed path
# (/tmp/mosaic-gpu-XXXXXX: TMPDIR does not move it). On exit the lane removes those made since it
# started, once 10 s unchanged: a folder that another process is writing into is younger.
LANE_STARTED=$(mktemp)
LANE_TMP=$(mktemp -d)
clean_temporaries() {
  local made_since=(/tmp -maxdepth 1 -type d -name 'mosaic-gpu-*' -newer "$LANE_STARTED")
  if [ -n "$(find "${made_since[@]}" -newermt '10 seconds ago' -print -quit)" ]; then sleep 10; fi
  find "${made_since[@]}" ! -newermt '10 seconds ago' -exec rm -rf {} +
  rm -rf "$LANE_STARTED" "$LANE_TMP"
}
trap clean_temporaries EXIT
export TMPDIR=$LANE_TMP

find_python() {
  local v
  for v in python3.12 python3.13; do
    if "$v" -c "" 2>/dev/null; then echo "$v"; return; fi
  done
  if command -v pyenv >/dev/null; then  # pyenv's shims need the version named
    v=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-3]\.[0-9]+$' | head -n1 || true)
    if [ -n "$v" ]; then echo "env PYENV_VERSION=$v python${v%.*}"; return; fi
  fi
}

if [ ! -x "$VENV/bin/python" ]; then
  PY=$(find_python)
  if [ -z "$PY" ]; then echo "cuda compile lane skipped: no Python >= 3.12 (jax $JAX_VERSION's CUDA plugin needs it)"; exit 0; fi
  echo "cuda compile lane: making the venv $VENV with $PY (about 1.1 GB: jax and jaxlib $JAX_VERSION," \
       "jax-cuda13-plugin and -pjrt without NVIDIA's library wheels, pytest, pytest-xdist);" \
       "CUDA_COMPILE_LANE_VENV=DIR puts it elsewhere"
  mkdir -p "$(dirname "$VENV")"
  $PY -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" "pytest>=8"
  "$VENV/bin/python" -m pip install -q --no-deps "jax-cuda13-plugin==$JAX_VERSION" "jax-cuda13-pjrt==$JAX_VERSION"
fi
echo "cuda compile lane: jax $JAX_VERSION from the venv $VENV"
# two workers, as worksteal shares them (an idle worker takes queued tests from the other): the
# compiles are single-threaded (a venv made before xdist 3.2, which has worksteal, gets it here)
"$VENV/bin/python" -c "import sys, xdist; sys.exit(tuple(map(int, xdist.__version__.split('.')[:2])) < (3, 2))" \
  2>/dev/null || "$VENV/bin/python" -m pip install -q "pytest-xdist>=3.2"
if ! command -v ptxas >/dev/null; then echo "cuda compile lane skipped: no ptxas on PATH (CUDA 13)"; exit 0; fi
CUDA_COMPILE_LANE=1 PYTHONPATH=$PWD "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist worksteal "$@" \
  tests/tools/test_mosaic_compile_report.py tests/sharding/test_ring_overlap.py \
  tests/jax_impl/test_mosaic_gpu_shard_map.py -k "compile or mosaic_gpu_shard_map"
# The Mosaic GPU kernels' numbers in the Mosaic GPU interpreter (tests/jax_impl/test_mosaic_gpu.py:
# jax 0.11, no GPU), judged by the float64 oracle (torch_ref) in the Python that has torch:
# $ORACLE_PYTHON, default python3, the suite's (conformance/oracle.py runs it there; this venv
# has no torch: none is built for the CPU on Python 3.12 here).
ORACLE=${ORACLE_PYTHON:-python3}
if ! PYTHONPATH=$PWD $ORACLE -c "import torch_ref" 2>/dev/null; then
  echo "Mosaic GPU interpreter tests skipped: $ORACLE cannot import torch_ref (torch), the oracle"; exit 0
fi
ORACLE_PYTHON=$ORACLE PYTHONPATH=$PWD "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist worksteal "$@" \
  tests/jax_impl/test_mosaic_gpu.py
