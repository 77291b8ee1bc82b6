"""Resume is bitwise with Megatron's default dropout (0.1) on 2 DDP ranks: stop at
iteration 4, resume, and compare every later loss with the uninterrupted run."""

from __future__ import annotations

import os

from tests.dist_utils import run_distributed

ARGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 7 --lr 2e-3 --seed 3 "
    "--mock-data --num-workers 0 --log-interval 1 --eval-interval 2 --eval-iters 1 "
    "--untie-embeddings-and-output-weights"
).split()  # attention and hidden dropout stay at Megatron's default 0.1


def _world(rank, world, tmp):
    from megadlms.pretrain import run

    straight = run(ARGS)
    save = os.path.join(tmp, "ckpt")
    part = run(ARGS + ["--save", save, "--save-interval", "100", "--exit-interval", "4"])
    resumed = run(ARGS + ["--load", save])
    return straight.losses, part.losses, resumed.losses


def test_resume_with_dropout_is_bitwise(tmp_path):
    straight, part, resumed = run_distributed(_world, 2, (str(tmp_path),))[0]
    assert sorted(part) == [1, 2, 3, 4] and sorted(resumed) == [5, 6, 7]
    assert [part[i] for i in range(1, 5)] == [straight[i] for i in range(1, 5)]
    assert [resumed[i] for i in range(5, 8)] == [straight[i] for i in range(5, 8)]
