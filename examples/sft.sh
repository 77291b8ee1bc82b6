#!/usr/bin/env bash
# Supervised fine-tuning on CPU, measured: a synthetic instruction task with checkable answers
# ("reverse c a h b" -> "b h a c", held-out words never seen in training; examples/sft_task.py),
#   1. build the tokenizer (LLaDA-style chat template) and the conversations,
#   2. tokenize them once with megadlms-preprocess-sft (the .bin/.idx pair with the answer mask),
#   3. train the same tiny DLM three ways on 2 ranks for the same steps and score held-out exact
#      match: one step (chance), --sft (LLaDA's objective: the prompt never noised), and the
#      pretraining objective on the same conversations' tokens (prompt noised too),
#   4. print the table (docs/fine_tuning.md quotes it).
# Knobs (environment): PY (python3), OUT (./demo_sft), NPROC (2), ITERS (1600), EXTRA_ARGS.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PY:-python3}"
OUT="${OUT:-$ROOT/demo_sft}"
NPROC="${NPROC:-2}"
ITERS="${ITERS:-1600}"
export PYTHONPATH="$ROOT/python:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
CORES="$(nproc 2>/dev/null || echo 2)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))}"

echo "== 1/4 data"
rm -rf "$OUT" && mkdir -p "$OUT"
"$PY" examples/sft_task.py data "$OUT"
echo "== 2/4 tokenize (megadlms-preprocess-sft)"
"$PY" -m megadlms.data.preprocess_sft --input "$OUT/train.jsonl" --output-prefix "$OUT/train" \
  --tokenizer-model "$OUT/tokenizer"

MODEL=(--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 24
  --max-position-embeddings 24 --position-embedding-type rope --normalization RMSNorm --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$OUT/tokenizer" --difflm-objective llada)
TRAIN=(--micro-batch-size 32 --global-batch-size 64 --lr 2e-3 --min-lr 1e-4 --lr-decay-style cosine
  --lr-warmup-iters $(( ITERS >= 200 ? 20 : 0 )) --weight-decay 0.0 --clip-grad 1.0 --seed 1234 --num-workers 0
  --log-interval 100 --eval-interval 100000 --eval-iters 1)

train() {  # NAME ITERS FLAGS...: train, save OUT/NAME, print the held-out exact match
  local name=$1 iters=$2; shift 2
  # shellcheck disable=SC2086
  "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" pretrain_difflm.py \
    "${MODEL[@]}" "${TRAIN[@]}" --train-iters "$iters" --save "$OUT/$name" --save-interval "$iters" \
    "$@" ${EXTRA_ARGS:-} > "$OUT/$name.log" 2>&1 || { tail -20 "$OUT/$name.log"; exit 1; }
  "$PY" examples/sft_task.py eval "$OUT/$name" "$OUT" > "$OUT/$name.score"
  echo "   $name: $(grep 'lm loss:' "$OUT/$name.log" | tail -1 | sed 's/.*lm loss: \([^ ]*\).*/lm loss \1/') | held-out exact match $(cat "$OUT/$name.score")%"
}

echo "== 3/4 train ($NPROC ranks, $ITERS steps each) and score held-out exact match"
SFT_DATA=(--sft --train-data-path "$OUT/train")
train chance 1 "${SFT_DATA[@]}" --lr-warmup-iters 0 --lr 1e-12 --min-lr 0
start=$(date +%s)
train sft "$ITERS" "${SFT_DATA[@]}"
sft_s=$(( $(date +%s) - start ))
train pretraining_objective "$ITERS" --train-data-path "$OUT/train_text_document" --split 100,0,0

echo "== 4/4 held-out exact match (${ITERS} steps, global batch 64, $NPROC CPU ranks; --sft run ${sft_s} s)"
printf '| objective | held-out exact match |\n|---|---|\n'
printf '| untrained (1 step at lr 1e-12) | %s%% |\n' "$(cat "$OUT/chance.score")"
printf '| --sft (LLaDA'"'"'s objective: the prompt is never noised) | %s%% |\n' "$(cat "$OUT/sft.score")"
printf '| pretraining objective (prompt noised too) | %s%% |\n' "$(cat "$OUT/pretraining_objective.score")"
