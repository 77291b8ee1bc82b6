#!/bin/bash
# Pretrain a 1.7B-parameter diffusion LM with megadlms: the equivalent of MegaDLMs'
# examples/dlm_training/dlm_pretrain_1.7b.sh (same model, objective, schedule, checkpoint and
# conversion flags), launched with torchrun on GPU nodes (NCCL). Two modes, as there:
#
#   # train (skipped when the final checkpoint exists)
#   GPUS_PER_NODE=8 NUM_NODES=1 NODE_RANK=0 MASTER_ADDR=localhost MASTER_PORT=6000 \
#   TRAIN_DATA=/data/train_text_document VALID_DATA=/data/valid_text_document \
#   TOKENIZER=/path/to/gptneox/tokenizer.json CKPT_DIR=/ckpt \
#   bash examples/dlm_pretrain_1.7b.sh
#
#   # convert checkpoint step N (or, without N, every iter_* of the run) to the torch format
#   # and then to a Hugging Face directory, under $CKPT_DIR/converted/$RUN_NAME/ckptstep_N/{torch,hf}
#   ... bash examples/dlm_pretrain_1.7b.sh convert_ckpt [N]
#
# TP / PP: MODEL_PARALLEL_SIZE and PIPELINE_MODEL_PARALLEL_SIZE (default 1; with TP > 1 the
# script adds --sequence-parallel). USE_FSDP2=1 shards with PyTorch FSDP2 instead of DDP + the
# distributed optimizer. DRY_RUN=1 prints the commands instead of running them.
# Like MegaDLMs' script: the first step counts the data's tokens (tools/count_tokens.py); saves
# go every epoch to $CKPT_DIR/$RUN_NAME and non-persistent ones (only the newest is kept) to its
# non_persistent/ directory; a restart resumes from the newer of the two.
# Speed-only flags such as --attention-backend flash are accepted and reported as having no
# effect; docs/flags.md lists every difference from MegaDLMs.
set -euo pipefail

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
WORLD_SIZE=$((GPUS_PER_NODE * NUM_NODES))
MODEL_PARALLEL_SIZE=${MODEL_PARALLEL_SIZE:-1}
PIPELINE_MODEL_PARALLEL_SIZE=${PIPELINE_MODEL_PARALLEL_SIZE:-1}
DATA_PARALLEL_SIZE=$((WORLD_SIZE / MODEL_PARALLEL_SIZE / PIPELINE_MODEL_PARALLEL_SIZE))
MODE=${1:-}                  # "" (train) or convert_ckpt
CONVERT_CKPT_STEP=${2:-}     # convert_ckpt: the step to convert (default: all)

RUN_NAME=${RUN_NAME:-dlm_training}
TRAIN_DATA=${TRAIN_DATA:-/path/to/train/data/prefix}
VALID_DATA=${VALID_DATA:-/path/to/valid/data/prefix}
TOKENIZER=${TOKENIZER:-/path/to/gptneox_tokenizer/tokenizer.json}
CKPT_DIR=${CKPT_DIR:-./checkpoints}
TRAINING_TOKENS_PER_EPOCH=${TRAINING_TOKENS_PER_EPOCH:-10000000000}
EPOCHS=${EPOCHS:-1000}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-256}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
SEQ_LENGTH=${SEQ_LENGTH:-2048}

TRAINING_TOKENS=$((TRAINING_TOKENS_PER_EPOCH * EPOCHS))
TRAIN_ITERS=$((TRAINING_TOKENS / (GLOBAL_BATCH_SIZE * SEQ_LENGTH)))
SAVE_INTERVAL=$((TRAIN_ITERS / EPOCHS))
EVAL_INTERVAL=$((TRAIN_ITERS / EPOCHS))
NON_PERSISTENT_SAVE_INTERVAL=${NON_PERSISTENT_SAVE_INTERVAL:-$((TRAIN_ITERS * 2))}  # MegaDLMs' value (never due)
VAL_ITERS=$((150000000 / (GLOBAL_BATCH_SIZE * SEQ_LENGTH)))   # 150M validation tokens
CHECKPOINT_PATH=$CKPT_DIR/$RUN_NAME
CONVERTED_PATH=$CKPT_DIR/converted/$RUN_NAME
LOGS_PATH=${LOG_DIR:-$CKPT_DIR/logs}/$RUN_NAME
cd "$(dirname "$(readlink -f "$0")")/.."

# Largest micro-batch that divides the global batch at this data-parallel size.
while (( MICRO_BATCH_SIZE > 1 && GLOBAL_BATCH_SIZE % (DATA_PARALLEL_SIZE * MICRO_BATCH_SIZE) != 0 )); do
  MICRO_BATCH_SIZE=$((MICRO_BATCH_SIZE - 1))
done

run() {  # run, or print with DRY_RUN=1
  if [[ "${DRY_RUN:-0}" == "1" ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}

DISTRIBUTED_ARGS=(--nproc_per_node "$GPUS_PER_NODE" --nnodes "$NUM_NODES" --node_rank "$NODE_RANK"
                  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")

GPT_MODEL_ARGS=(
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --attention-backend flash --attention-softmax-in-fp32
  --attention-dropout 0.0 --hidden-dropout 0.0
  --num-layers 28 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 6144 --swiglu
  --vocab-size 50289 --normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 10000
  --disable-bias-linear --position-embedding-type rope --qk-layernorm
  --untie-embeddings-and-output-weights --init-method-std 0.02
)

PLMT_ARGS=(
  --model-running-mode difflm-noshift --base-model vanilla --mask-token 50277
  --attention-mask-type no_mask
)

TRAINING_ARGS=(
  --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
  --train-iters "$TRAIN_ITERS"
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16
  --lr 0.0002 --min-lr 0.00002 --lr-decay-style WSD --lr-warmup-iters 2000
  --lr-decay-iters "$TRAIN_ITERS" --lr-wsd-decay-style exponential --lr-wsd-decay-iters 1000
  --distributed-timeout-minutes 60
)
PARALLEL_ARGS=(--tensor-model-parallel-size "$MODEL_PARALLEL_SIZE"
               --pipeline-model-parallel-size "$PIPELINE_MODEL_PARALLEL_SIZE")
if (( MODEL_PARALLEL_SIZE > 1 )); then PARALLEL_ARGS+=(--sequence-parallel); fi
if [[ "${USE_FSDP2:-0}" == "1" ]]; then
  PARALLEL_ARGS+=(--use-torch-fsdp2 --no-gradient-accumulation-fusion)
else
  PARALLEL_ARGS+=(--use-distributed-optimizer --num-distributed-optimizer-instances "$NUM_NODES"
                  --overlap-grad-reduce --overlap-param-gather)
fi

DATA_ARGS=(
  --train-data-path "$TRAIN_DATA" --valid-data-path "$VALID_DATA"
  --data-cache-path "$CKPT_DIR/data_cache/$RUN_NAME"
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
)

EVAL_AND_LOGGING_ARGS=(
  --log-interval 50 --log-throughput --metrics-jsonl "$LOGS_PATH/metrics.jsonl"
  --save-interval "$SAVE_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$VAL_ITERS"
  --ckpt-format torch_dist --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH"
  --exit-signal-handler --tensorboard-dir "$LOGS_PATH/tensorboard"
)
NON_PERSISTENT_ARGS=(
  --non-persistent-save-interval "$NON_PERSISTENT_SAVE_INTERVAL" --non-persistent-ckpt-type global
  --non-persistent-global-ckpt-dir "$CHECKPOINT_PATH/non_persistent"
)

PRETRAIN=(torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_difflm.py "${GPT_MODEL_ARGS[@]}" "${PLMT_ARGS[@]}"
          "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}")
export CUDA_DEVICE_MAX_CONNECTIONS=1

train() {
  if [[ "$NODE_RANK" == "0" ]]; then  # MegaDLMs' first step: the data's statistics
    run python tools/count_tokens.py --weighted-prefix "1.0 $TRAIN_DATA"
    run python tools/count_tokens.py --weighted-prefix "1.0 $VALID_DATA"
  fi
  # Like MegaDLMs: do nothing when the final checkpoint already exists.
  if [[ -f "$CHECKPOINT_PATH/latest_checkpointed_iteration.txt" ]] &&
     [[ "$(cat "$CHECKPOINT_PATH/latest_checkpointed_iteration.txt")" == "$TRAIN_ITERS" ]]; then
    echo "the final checkpoint (iteration $TRAIN_ITERS) exists in $CHECKPOINT_PATH; nothing to do"
    return
  fi
  mkdir -p "$LOGS_PATH" "$CHECKPOINT_PATH"
  run "${PRETRAIN[@]}" "${NON_PERSISTENT_ARGS[@]}"
}

convert() {
  # As MegaDLMs: the non-persistent checkpoints are left out, so --ckpt-step names a persistent one.
  local steps=("$CONVERT_CKPT_STEP")
  if [[ -z "$CONVERT_CKPT_STEP" ]]; then
    mapfile -t steps < <(find "$CHECKPOINT_PATH" -maxdepth 1 -type d -name 'iter_*' ! -name '*.*' \
                           -printf '%f\n' | sed 's/^iter_0*//' | grep . | sort -n)
    (( ${#steps[@]} )) || { echo "no iter_* checkpoints in $CHECKPOINT_PATH" >&2; exit 1; }
  fi
  for step in "${steps[@]}"; do
    local out=$CONVERTED_PATH/ckptstep_$step
    if [[ ! -f "$out/torch/latest_checkpointed_iteration.txt" ]]; then
      run "${PRETRAIN[@]}" --no-load-optim --no-save-optim --no-save-rng --no-load-rng \
        --ckpt-convert-format torch --ckpt-convert-save "$out" --ckpt-step "$step"
    fi
    if [[ "$NODE_RANK" == "0" && ! -f "$out/hf/config.json" ]]; then
      run megadlms-export-hf --load "$out/torch" --output "$out/hf"
    fi
  done
}

case "$MODE" in
  "") train ;;
  convert_ckpt) convert ;;
  *) echo "unknown mode '$MODE': use convert_ckpt [STEP] or nothing (train)" >&2; exit 1 ;;
esac
