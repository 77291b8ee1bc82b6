# shellcheck shell=bash
# The layouts and base flags shared by tools/loss_curves.sh and tools/resume_check.sh (sourced):
# a tiny fixed-seed fp32 model on mock data with Megatron's defaults (dropout 0.1, fusion on).
CURVE_BASE="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2
 --global-batch-size 8 --lr 1e-3 --mock-data --log-interval 1 --seed 1234
 --lr-warmup-iters 5 --untie-embeddings-and-output-weights"
# name:extra flags
CURVE_RUNS=(
  "ddp:"
  "distopt:--use-distributed-optimizer --overlap-grad-reduce"
  "fsdp2:--use-torch-fsdp2"
  "tp2sp:--tensor-model-parallel-size 2 --sequence-parallel"
  "pp2:--pipeline-model-parallel-size 2"
  "ep2:--num-experts 4 --expert-model-parallel-size 2"
  "vanilla:--model-running-mode vanilla"
  "bf16:--bf16"
)
