#!/usr/bin/env bash
# Old checkpoints must load and continue bitwise: checkout OLD trains 20 iterations of each layout
# (Megatron's dropout 0.1) saving at iteration 10; checkout NEW loads that checkpoint and trains
# iterations 11-20; tools/compare_metrics.py-style check of 11-20 against OLD's uninterrupted run.
#   tools/resume_check.sh OLD_REPO NEW_REPO OUTDIR [RUN...]      (PORT: first master port, 29640)
set -euo pipefail
OLD=$(cd "$1" && pwd); NEW=$(cd "$2" && pwd); OUT=$3; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); shift 3
PY=${PY:-python}
export OMP_NUM_THREADS=1
# shellcheck source=tools/curve_runs.sh
source "$(dirname "${BASH_SOURCE[0]}")/curve_runs.sh"
BASE="$CURVE_BASE --train-iters 20 --save-interval 10"
# the wrappers and parallel layouts (each stores its state differently); loss_curves.sh has all eight
RUNS=("${CURVE_RUNS[@]:0:6}")
port=${PORT:-29640}
launch() {  # REPO LOG ARGS...
  local repo=$1 log=$2; shift 2
  (cd "$repo" && PYTHONPATH=$repo/python:$repo timeout 600 "$PY" -m torch.distributed.run \
     --nproc_per_node 2 --master_port $port pretrain_difflm.py "$@" > "$log" 2>&1) \
     || { echo "FAILED (see $log)"; exit 1; }
  port=$((port + 1))
}
status=0
for run in "${RUNS[@]}"; do
  name=${run%%:*}; extra=${run#*:}
  if [[ $# -gt 0 && ! " $* " == *" $name "* ]]; then continue; fi
  rm -rf "$OUT/$name" && mkdir -p "$OUT/$name"
  # shellcheck disable=SC2086
  launch "$OLD" "$OUT/$name/old.log" $BASE $extra --save "$OUT/$name/ckpt" --metrics-jsonl "$OUT/$name/old.jsonl"
  rm -rf "$OUT/$name/ckpt/iter_0000020"; echo 10 > "$OUT/$name/ckpt/latest_checkpointed_iteration.txt"
  # shellcheck disable=SC2086
  launch "$NEW" "$OUT/$name/new.log" $BASE $extra --load "$OUT/$name/ckpt" --metrics-jsonl "$OUT/$name/new.jsonl"
  "$PY" - "$name" "$OUT/$name/old.jsonl" "$OUT/$name/new.jsonl" <<'PYEOF' || status=1
import json, sys
name, old, new = sys.argv[1:4]
def recs(p):
    with open(p) as f:
        return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in map(json.loads, f) if r.get("event") == "train"}
a = {i: v for i, v in recs(old).items() if i > 10}
b = recs(new)
same = sum(a.get(i) == b.get(i) for i in range(11, 21))
print(f"{name:8s} resumed iterations 11-20 identical {same}/10")
sys.exit(same != 10)
PYEOF
done
exit $status
