#!/usr/bin/env bash
# One device call for the experts work: GPU tests, then the experts benchmark, then (optionally) tuning.
# Usage: benchmarks/gpu_experts.sh "<pytest args>" "<bench args>" "<tune args>"   (empty string = skip)
# Carries (ignored paths, named in the device call's carry list): .tcache/triton_cache.tgz (compiled kernels from
# the last call) and .whl/, the peers' wheels that the machine lacks (it has torch 2.11, Triton 3.6, transformers
# and Python 3.12, and no package registry). Fetch them here with
#   pip download --no-deps -d .whl liger-kernel==0.8.5
#   pip download --no-deps -d .whl --python-version 3.12 --only-binary=:all: --platform manylinux_2_34_x86_64 \
#       --platform manylinux2014_x86_64 sglang==0.5.23 apache-tvm-ffi==0.1.11
# liger_kernel-0.8.5-py3-none-any.whl (0.9 MB), sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl (39.0 MB),
# apache_tvm_ffi-0.1.11-cp312-abi3-manylinux2014_x86_64.manylinux_2_17_x86_64.whl (2.7 MB): 42.7 MB of the 64 MiB a
# call carries. sglang and tvm-ffi serve the sglang peer (bench/sglang_peer.py: sglang's files are read, not
# imported; tvm-ffi and nvcc build its CUDA alignment kernel once, into ~/.cache/tvm-ffi). Without them the bench
# skips that peer with one line and goes on.
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton_cache PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# tvm-ffi links its builds against $CUDA_HOME/lib64/libcudart; it guesses CUDA_HOME from nvcc's path otherwise.
# On a torch without the DLPack exchange API it would also compile an optional addon at import (minutes of
# this call's time); without the addon it passes torch tensors through torch.utils.dlpack, on torch's stream.
[ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda/lib64 ] && export CUDA_HOME=/usr/local/cuda
export TVM_FFI_DISABLE_TORCH_C_DLPACK=${TVM_FFI_DISABLE_TORCH_C_DLPACK:-1}
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
