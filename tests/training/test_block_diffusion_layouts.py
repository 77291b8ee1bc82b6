"""Block diffusion (--difflm-block-size) end to end through ``megadlms.pretrain.run`` on gloo
CPU ranks: the [x_t ; x_0] pass gives the one-process loss curve and validation NELBO at DDP,
the distributed optimizer, FSDP2, TP + SP, PP and EP (fp32, dropout 0, within 1e-5 relative),
with variable-length crops (rounded to blocks); B = seq-length is today's curve bitwise.
One world per size runs all its layouts."""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed

ITERS = 3
BASE = (
    "--difflm-objective llada "
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu "
    "--attention-dropout 0 --hidden-dropout 0 --micro-batch-size 2 --global-batch-size 8 "
    f"--train-iters {ITERS} --lr 2e-3 --seed 7 --mock-data --num-workers 0 --log-interval 1 "
    f"--eval-interval {ITERS} --eval-iters 1 --difflm-varilen-prob 0.5 "
    f"--untie-embeddings-and-output-weights --exit-interval {ITERS}"
).split()
TINY = BASE + ["--difflm-block-size", "8"]
TP1 = ["--make-vocab-size-divisible-by", "128"]
TP2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
MOE = ["--num-experts", "2", "--moe-router-topk", "1", "--moe-ffn-hidden-size", "32"]
REL = 1e-5


def _run(argv, base=TINY):
    from megadlms.pretrain import run

    return run(base + list(argv))


def _one_process_world(rank, world):
    return {
        "single": _run(TP1),
        "single_moe": _run(TP1 + MOE),
        "block_eq_seq": _run(TP1 + ["--difflm-block-size", "32"], base=BASE),
        "plain": _run(TP1, base=BASE),
    }


def _four_rank_world(rank, world):
    return {
        "dp4": _run(TP1),
        "dp4_distopt": _run(TP1 + ["--use-distributed-optimizer", "--overlap-grad-reduce"]),
        "fsdp2": _run(TP1 + ["--use-torch-fsdp2"]),
        "tp2_sp": _run(TP2 + ["--sequence-parallel"]),
        "pp2": _run(TP1 + ["--pipeline-model-parallel-size", "2"]),
        "ep2": _run(TP1 + MOE + ["--expert-model-parallel-size", "2"]),
    }


@pytest.fixture(scope="module")
def worlds():
    one = run_distributed(_one_process_world, 1, timeout=600)[0]
    four = run_distributed(_four_rank_world, 4, timeout=900)[0]
    return four, one


def _assert_same(res, ref):
    its = range(1, ITERS + 1)
    assert [res.losses[i] for i in its] == pytest.approx([ref.losses[i] for i in its], rel=REL)
    assert res.evals[ITERS] == pytest.approx(ref.evals[ITERS], rel=REL)


@pytest.mark.parametrize("name", ["dp4", "dp4_distopt", "fsdp2", "tp2_sp", "pp2"])
def test_block_diffusion_curve_matches_one_process(worlds, name):
    four, one = worlds
    _assert_same(four[name], one["single"])


def test_block_diffusion_expert_parallel_matches_one_process(worlds):
    four, one = worlds
    _assert_same(four["ep2"], one["single_moe"])


def test_block_size_equal_seq_length_is_todays_curve_bitwise(worlds):
    _, one = worlds
    same = one["block_eq_seq"]
    assert same.losses == one["plain"].losses and same.evals == one["plain"].evals
    assert one["single"].losses != same.losses  # blocks of 8 train another objective
