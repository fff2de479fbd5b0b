#!/usr/bin/env bash
# One device call for the experts work: GPU tests, then the experts benchmark, then (optionally) tuning.
# Usage: benchmarks/gpu_experts.sh "<pytest args>" "<bench args>" "<tune args>"   (empty string = skip)
# Carries: .whl (liger-kernel wheel), .tcache/triton_cache.tgz (compiled kernels from the last call).
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton_cache PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
[ -f .tcache/triton_cache.tgz ] && tar xzf .tcache/triton_cache.tgz
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
if [ -n "${1:-}" ]; then
  timeout "${PYTEST_LIMIT:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider $1 2>&1 | tee "$OUT/pytest.log" | tail -25
fi
if [ -n "${2:-}" ]; then
  timeout "${BENCH_LIMIT:-300}" python3 benchmarks/bench_experts.py --out "$OUT" $2 2>&1 | tee "$OUT/bench.log" | grep -v "^|" | tail -80
fi
if [ -n "${3:-}" ]; then
  timeout "${TUNE_LIMIT:-300}" python3 -m moekit.tools.tune --out "$OUT/experts_tuned.json" $3 2>&1 | tee "$OUT/tune.log" | grep -v skip | tail -60
fi
tar czf "$OUT/triton_cache.tgz" .triton_cache 2>/dev/null
ls -la "$OUT"
