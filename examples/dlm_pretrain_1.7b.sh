#!/bin/bash
# Pretrain a 1.7B-parameter diffusion LM with megadlms: the equivalent of MegaDLMs'
# examples/dlm_training/dlm_pretrain_1.7b.sh (same model, objective, schedule and
# checkpoint flags), launched with torchrun on GPU nodes (NCCL).
#
#   GPUS_PER_NODE=8 NUM_NODES=1 NODE_RANK=0 MASTER_ADDR=localhost MASTER_PORT=6000 \
#   TRAIN_DATA=/data/train_text_document VALID_DATA=/data/valid_text_document \
#   TOKENIZER=/path/to/gptneox/tokenizer.json CKPT_DIR=/ckpt \
#   bash examples/dlm_pretrain_1.7b.sh
#
# USE_FSDP2=1 shards with PyTorch FSDP2 instead of DDP + the distributed optimizer.
# DRY_RUN=1 prints the command instead of running it.
# Differences from the MegaDLMs script: no tensor/pipeline parallelism yet (TP=PP=1;
# other values stop with a clear error), no W&B client (the --wandb-* flags are accepted
# and ignored, so they are left out here), no non-persistent checkpoints, and
# --num-distributed-optimizer-instances stays 1. Speed-only flags such as
# --attention-backend flash are accepted and reported as having no effect.
set -euo pipefail

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
WORLD_SIZE=$((GPUS_PER_NODE * NUM_NODES))
DATA_PARALLEL_SIZE=$WORLD_SIZE            # TP = PP = 1

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
VAL_ITERS=$((150000000 / (GLOBAL_BATCH_SIZE * SEQ_LENGTH)))   # 150M validation tokens
CHECKPOINT_PATH=$CKPT_DIR/$RUN_NAME
LOGS_PATH=${LOG_DIR:-$CKPT_DIR/logs}/$RUN_NAME

# Largest micro-batch that divides the global batch at this data-parallel size.
while (( MICRO_BATCH_SIZE > 1 && GLOBAL_BATCH_SIZE % (DATA_PARALLEL_SIZE * MICRO_BATCH_SIZE) != 0 )); do
  MICRO_BATCH_SIZE=$((MICRO_BATCH_SIZE - 1))
done

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
if [[ "${USE_FSDP2:-0}" == "1" ]]; then
  PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
                 --use-torch-fsdp2 --no-gradient-accumulation-fusion)
else
  PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
                 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)
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

CMD=(torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_difflm.py "${GPT_MODEL_ARGS[@]}" "${PLMT_ARGS[@]}"
     "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}")

if [[ "${DRY_RUN:-0}" == "1" ]]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi

# Like MegaDLMs: do nothing when the final checkpoint already exists.
if [[ -f "$CHECKPOINT_PATH/latest_checkpointed_iteration.txt" ]] &&
   [[ "$(cat "$CHECKPOINT_PATH/latest_checkpointed_iteration.txt")" == "$TRAIN_ITERS" ]]; then
  echo "the final checkpoint (iteration $TRAIN_ITERS) exists in $CHECKPOINT_PATH; nothing to do"
  exit 0
fi
mkdir -p "$LOGS_PATH" "$CHECKPOINT_PATH"
cd "$(dirname "$(readlink -f "$0")")/.."
export CUDA_DEVICE_MAX_CONNECTIONS=1
"${CMD[@]}"
