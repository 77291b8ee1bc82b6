"""The planner's weight / gradient / optimizer bytes equal what the wrappers allocate, exactly,
for every layout below (measured on every rank of one 4-rank world of the test pool)."""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tests.planning.measure import measure_and_plan

BASE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 96 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 8 --lr 1e-3 --train-iters 1 --mock-data "
    "--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
)
BF16_DO = "--bf16 --use-distributed-optimizer --ddp-bucket-size 3000 "
LAYOUTS = {
    "ddp fp32": "",
    "ddp bf16": "--bf16 --overlap-grad-reduce",
    "distributed optimizer": BF16_DO,
    "instances": BF16_DO + "--num-distributed-optimizer-instances 2",
    "tp2 sp": BF16_DO + "--tensor-model-parallel-size 2 --sequence-parallel",
    "pp2 interleaved": BF16_DO + "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1",
    "pp2 tied": "--bf16 --pipeline-model-parallel-size 2",
    "cp2": BF16_DO + "--context-parallel-size 2",
    "ep2": BF16_DO + "--num-experts 4 --expert-model-parallel-size 2 --moe-ffn-hidden-size 48",
    "precision-aware bf16": BF16_DO + "--use-precision-aware-optimizer --exp-avg-dtype bf16 "
    "--exp-avg-sq-dtype bf16 --main-grads-dtype bf16 --no-gradient-accumulation-fusion",
    "precision-aware fp8 fp16 master": BF16_DO + "--use-precision-aware-optimizer --exp-avg-dtype fp8 "
    "--exp-avg-sq-dtype fp16 --main-params-dtype fp16",
    "fsdp2": "--use-torch-fsdp2 --untie-embeddings-and-output-weights --ckpt-format torch_dist --bf16",
    "fsdp2 tp2": "--use-torch-fsdp2 --untie-embeddings-and-output-weights --ckpt-format torch_dist "
    "--tensor-model-parallel-size 2",
    "hsdp": "--use-torch-fsdp2 --untie-embeddings-and-output-weights --ckpt-format torch_dist "
    "--num-distributed-optimizer-instances 2",
}


@pytest.fixture(scope="module")
def four_ranks():
    argvs = [(BASE + extra).split() for extra in LAYOUTS.values()]
    per_rank = run_distributed(measure_and_plan, 4, args=(argvs,), timeout=300)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(LAYOUTS)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planned_state_bytes_equal_the_allocated_bytes(four_ranks, name):
    for rank, (measured, planned) in enumerate(four_ranks[name]):
        assert min(measured) > 0, f"{name}, rank {rank}: nothing measured {measured}"
        assert planned == measured, f"{name}, rank {rank}: planned {planned} != measured {measured}"
