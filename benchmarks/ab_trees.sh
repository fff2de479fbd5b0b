#!/usr/bin/env bash
# Same-run A/B of two source trees on the device: each round times the table config of every case in the OLD
# tree and in this one (NEW), alternating which goes first, and prints ab_configs' lines prefixed
# "ROUND TREE LABEL" for benchmarks/ab_results.py. The OLD tree is an export of a commit, made here before the call
# (it travels as an ignored folder named in the device call's carry):
#
#   mkdir -p .scratch/old && git archive REV src benchmarks | tar -x -C .scratch/old
#   benchmarks/ab_trees.sh .scratch/old 2 gpt-oss:mxfp4:256,1024,4096 qwen3:nvfp4:16,256,4096
#   python benchmarks/ab_results.py $OUT/ab.log NAME --change "..." --old REV --new HEAD --date YYYY-MM-DD
#
# A case is LABEL:WEIGHTS:T,T,... with LABEL one of ab_results' presets (gpt-oss, qwen3, deepseek).
set -u -o pipefail
old=$1 rounds=$2; shift 2
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
site=${PYTHONPATH:-}
declare -A PRESET=([gpt-oss]=gpt-oss-120b [qwen3]=qwen3-30b-a3b [deepseek]=deepseek-v3)
run() {  # ROUND TREE CASE
  local r=$1 tree=$2 label weights tokens src=$PWD
  IFS=: read -r label weights tokens <<< "$3"
  [ "$tree" = OLD ] && src=$old
  PYTHONPATH="$src/src${site:+:$site}" timeout "${CASE_LIMIT:-300}" python3 "$src/benchmarks/ab_configs.py" \
    --preset "${PRESET[$label]}" --weights "$weights" --tokens ${tokens//,/ } --config table \
    --out "/tmp/ab_${r}_${tree}_${label}.json" 2>&1 | sed "s|^|$r $tree $label |" | tee -a "$OUT/ab.log"
}
for r in $(seq 1 "$rounds"); do
  order="OLD NEW"; [ $((r % 2)) = 0 ] && order="NEW OLD"
  for c in "$@"; do for tree in $order; do run "$r" "$tree" "$c"; done; done
done
grep " us " "$OUT/ab.log"
