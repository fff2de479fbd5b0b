#!/usr/bin/env bash
# One device call for the grouped Gluon MXFP4 experts (gluon_moe.py beside it): its GPU tests (the single-GEMM ones
# too), then its check-and-time run. Both under timeouts: a barrier phase bug hangs the GPU rather than failing.
#   [PROFILE=1] benchmarks/experiments/gpu_gluon_moe.sh [tokens...]   e.g. with 1024 4096 16384  (about 6 minutes;
#   PROFILE=1 adds the device time per kernel)
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tc}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "${PYTEST_LIMIT:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/test_gluon_moe.py \
  tests/test_gluon_w4.py 2>&1 | tee "$OUT/gluon_moe_tests.txt" | tail -5
timeout "${BENCH_LIMIT:-300}" python3 benchmarks/experiments/gluon_moe.py --out "$OUT" --budget-s "${BUDGET_S:-240}" \
  ${PROFILE:+--profile} \
  ${1:+--tokens "$@"} 2>&1 | tee "$OUT/gluon_moe.log" | grep -v "^\[" | tail -30
