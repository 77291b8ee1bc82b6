#!/usr/bin/env bash
# Loss curves of one checkout for before/after comparisons (refactors must not move them):
# 50 fixed-seed iterations on 2 gloo ranks with Megatron's dropout 0.1, for DDP, DDP + distributed
# optimizer + overlap, FSDP2, tp2+SP, pp2, ep2 (MoE), vanilla (AR) mode and bf16; one
# --metrics-jsonl per run in OUTDIR.
#   tools/loss_curves.sh REPO OUTDIR [RUN...]    then   python tools/compare_metrics.py DIR_A DIR_B
# RUN names a subset (default: all). PORT (default 29610) is the first master port; runs in
# parallel need disjoint ranges (8 ports each).
set -euo pipefail
REPO=$(cd "$1" && pwd); OUT=$2; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); shift 2
PY=${PY:-python}
export PYTHONPATH=$REPO/python:$REPO OMP_NUM_THREADS=1
# shellcheck source=tools/curve_runs.sh
source "$(dirname "${BASH_SOURCE[0]}")/curve_runs.sh"
BASE="$CURVE_BASE --train-iters 50"
RUNS=("${CURVE_RUNS[@]}")
port=${PORT:-29610}
for run in "${RUNS[@]}"; do
  name=${run%%:*}; extra=${run#*:}
  if [[ $# -gt 0 && ! " $* " == *" $name "* ]]; then port=$((port + 1)); continue; fi
  rm -f "$OUT/$name.jsonl"
  # shellcheck disable=SC2086
  (cd "$REPO" && timeout 600 "$PY" -m torch.distributed.run --nproc_per_node 2 --master_port $port \
     pretrain_difflm.py $BASE $extra --metrics-jsonl "$OUT/$name.jsonl" > "$OUT/$name.log" 2>&1) \
     || { echo "$name FAILED (see $OUT/$name.log)"; exit 1; }
  port=$((port + 1))
done
echo "wrote $(ls "$OUT"/*.jsonl | xargs -n1 basename | tr '\n' ' ')"
