#!/usr/bin/env bash
# One device call for the low-bit kernels: their GPU tests, then (optionally) tuning into the package's
# table, then the low-bit benchmark. Usage:
#   benchmarks/gpu_lowbit.sh [gemv|aligned|both|none] [bench presets...]
# e.g. benchmarks/gpu_lowbit.sh both gpt-oss-120b qwen3-30b-a3b     (about 8 minutes)
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD/src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
modes=${1:-none}; shift || true
T0=$(date +%s)
since() { echo "$1 done at $(( $(date +%s) - T0 )) s"; }
timeout "${PYTEST_LIMIT:-120}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernel_formats.py \
  tests/test_experts.py -k "four_bit or gemv or tile or decoder" 2>&1 | tee "$OUT/pytest.log" | tail -3
since pytest
for fmt_preset in mxfp4:gpt-oss-120b nvfp4:qwen3-30b-a3b; do
  fmt=${fmt_preset%%:*}; preset=${fmt_preset##*:}
  if [ "$modes" = gemv ] || [ "$modes" = both ]; then
    timeout "${TUNE_LIMIT:-120}" python3 -m moekit.tools.tune --format "$fmt" --preset "$preset" --tokens 1 4 16 \
      --modes gemv --merge --out "$OUT/tune_gemv_$fmt.json" > "$OUT/tune_gemv_$fmt.log" 2>&1
    since "tune gemv $fmt"; grep "whole call" "$OUT/tune_gemv_$fmt.log" | cut -c1-90
  fi
  if [ "$modes" = aligned ] || [ "$modes" = both ]; then
    timeout "${TUNE_LIMIT:-120}" python3 -m moekit.tools.tune --format "$fmt" --preset "$preset" --tokens 64 256 1024 4096 \
      --modes aligned --merge --out "$OUT/tune_aligned_$fmt.json" > "$OUT/tune_aligned_$fmt.log" 2>&1
    since "tune aligned $fmt"; grep "BLOCK_M" "$OUT/tune_aligned_$fmt.log" | cut -c1-90
  fi
done
cp src/moekit/experts/tuned_configs.json "$OUT/tuned_configs.json"
if [ $# -gt 0 ]; then
  timeout "${BENCH_LIMIT:-240}" python3 benchmarks/bench_lowbit.py --preset "$@" --out "$OUT" --name lowbit > "$OUT/bench.log" 2>&1
  since bench; grep "^| [a-z]" "$OUT/lowbit.md" | cut -d'|' -f2-10
fi
