#!/usr/bin/env bash
# The low-bit GPU tests (MXFP4, NVFP4, FP8 W8A8, W4A8) and the GPU bad-input table under compute-sanitizer's
# memcheck: any read or write out of bounds is an error. Usage: benchmarks/gpu_sanitize.sh [extra pytest args]
# Writes $OUT/memcheck.log (the sanitizer's report) and $OUT/memcheck_pytest.log.
set -u -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
# Without the caching allocator every tensor is its own cudaMalloc, so memcheck sees each tensor's bounds
# (a sub-allocated block would hide a read past one tensor into its neighbour). CUDA graphs cannot be
# captured then (cudaMalloc is refused during a capture): the graph tests run without the sanitizer.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
compute-sanitizer --version | tail -1 | tee "$OUT/memcheck.log"
timeout "${SANITIZE_LIMIT:-560}" compute-sanitizer --tool memcheck --leak-check no --print-limit 200 \
    --error-exitcode 99 --log-file "$OUT/memcheck_tool.log" \
    python3 -m pytest -m gpu -n 0 -q -p no:cacheprovider tests/test_experts.py tests/test_kernel_formats.py \
    tests/test_bad_input.py -k "(four_bit or fp8 or w4a8 or mxfp4 or nvfp4 or bad_input or scale_decoders) and not graph" \
    "$@" \
    2>&1 | tee "$OUT/memcheck_pytest.log" | tail -25
status=$?
cat "$OUT/memcheck_tool.log" >> "$OUT/memcheck.log"
echo "exit status $status (99: memcheck found errors)" | tee -a "$OUT/memcheck.log"
tail -5 "$OUT/memcheck.log"
