#!/usr/bin/env bash
# One device call: GPU tests, then a benchmark. Usage: benchmarks/gpu_check.sh [pytest args] -- [bench args]
set -u -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
pyargs=(); benchargs=(); seen=0
for a in "$@"; do if [ "$a" = "--" ]; then seen=1; elif [ $seen = 0 ]; then pyargs+=("$a"); else benchargs+=("$a"); fi; done
if [ ${#pyargs[@]} -gt 0 ]; then
  timeout "${PYTEST_LIMIT:-400}" python3 -m pytest -m gpu -q -p no:cacheprovider "${pyargs[@]}" 2>&1 | tee "$OUT/pytest.log" | tail -40
fi
if [ ${#benchargs[@]} -gt 0 ]; then
  timeout "${BENCH_LIMIT:-400}" python3 benchmarks/bench_router.py --out "$OUT" "${benchargs[@]}" 2>&1 | tee "$OUT/bench.log" | grep -v "^|" | tail -60
fi
