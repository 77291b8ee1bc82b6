"""An MoE DLM through the real CLI (``megadlms.pretrain.run``, gloo CPU, mock data): the MoE
flags reach the model, the aux and z losses train with a normalisation that does not depend
on the layout (dp = 2 with 2 micro-batches per rank follows dp = 1 with 4 on the same global
batch, with a large aux coefficient), a checkpoint resumes bitwise, and the metrics log the
aux loss and the load balance.
Megatron's dropout 0.1 runs; the CLI rules name the flags."""

from __future__ import annotations

import json
import math
import os

import pytest

from megadlms.config import parse_config
from tests.dist_utils import run_distributed

# LLaDA's objective draws its crop once per step: the loss curve does not depend on dp.
TINY = (
    "--difflm-objective llada "
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 6 --lr 3e-3 --min-lr 3e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 1 --clip-grad 1.0 --seed 7 --mock-data --num-workers 0 "
    "--log-interval 1 --eval-interval 100 --eval-iters 1 "
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-aux-loss-coeff 0.5 "
    "--moe-z-loss-coeff 0.01 --moe-layer-freq ([1]*1+[1]) --moe-shared-expert-intermediate-size 16 "
    "--moe-expert-capacity-factor 1.5 --moe-token-dispatcher-type alltoall --moe-grouped-gemm"
).split()
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]


def _world(rank, world, tmp, extra, resume=False):
    from megadlms.pretrain import run

    metrics = os.path.join(tmp, f"m{world}_{len(extra)}.jsonl")
    res = run(TINY + extra + ["--metrics-jsonl", metrics])
    if not resume:
        return res.losses, metrics
    save = os.path.join(tmp, "ckpt")
    run(TINY + extra + ["--save", save, "--save-interval", "100", "--exit-interval", "3"])
    resumed = run(TINY + extra + ["--load", save])
    return res.losses, metrics, resumed.losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("moe"))
    dp2 = run_distributed(_world, 2, (tmp, NO_DROPOUT, True), timeout=600)
    dp1 = run_distributed(_world, 1, (tmp, NO_DROPOUT), timeout=600)
    dropout = run_distributed(_world, 2, (tmp, []), timeout=600)
    return dp2, dp1, dropout


def test_moe_loss_does_not_depend_on_dp(runs):
    dp2, dp1, _ = runs
    losses2, losses1 = dp2[0][0], dp1[0][0]
    resumed = dp2[0][2]
    assert sorted(resumed) == [4, 5, 6]
    for i in resumed:  # a checkpoint at iteration 3 resumes the MoE run bitwise
        assert resumed[i] == losses2[i], i
    assert sorted(losses2) == sorted(losses1) == list(range(1, 7))
    for i in losses1:  # the updates (aux gradients included) are the same at dp 1 and 2
        assert losses2[i] == pytest.approx(losses1[i], rel=1e-5), i


def test_moe_metrics_logged(runs):
    dp2, dp1, _ = runs
    by_layout = []
    for res in (dp2, dp1):
        with open(res[0][1]) as f:
            recs = [json.loads(line) for line in f if '"train"' in line]
        assert len(recs) == 6
        for r in recs:
            assert r["moe_aux_loss"] > 0 and r["moe_z_loss"] > 0
            assert r["moe_load_max_over_mean"] >= 1.0
            assert set(r["moe_layers"]) == {"1", "2"}
            for layer in r["moe_layers"].values():
                assert layer["forwards"] == 4  # the global batch's micro-batches, every layout
                assert len(layer["tokens_per_expert"]) == 4
        by_layout.append(recs)
    for a, b in zip(*by_layout):  # summed over the ranks: the same numbers at dp 1 and 2
        assert a["moe_aux_loss"] == pytest.approx(b["moe_aux_loss"], rel=1e-5)
        assert a["moe_layers"]["1"]["tokens_per_expert"] == b["moe_layers"]["1"]["tokens_per_expert"]


def test_moe_with_megatron_dropout_trains(runs):
    losses, _ = runs[2][0]
    assert all(math.isfinite(v) for v in losses.values())


def test_moe_cli_rules_name_flags():
    base = TINY + NO_DROPOUT
    with pytest.raises(ValueError) as exc:
        parse_config(base + ["--tensor-model-parallel-size", "2"], world_size=2)
    assert "--num-experts 4" in str(exc.value) and "--tensor-model-parallel-size" in str(exc.value)
    with pytest.raises(ValueError) as exc:
        parse_config(base + ["--moe-router-topk", "5"], world_size=1)
    assert "--moe-router-topk 5 exceeds --num-experts 4" in str(exc.value)
    cfg = parse_config(base, world_size=1).model
    assert cfg.num_moe_experts == 4 and cfg.moe_layer_freq == [1, 1]
    assert cfg.moe_token_dispatcher_type == "alltoall" and cfg.moe_expert_capacity_factor == 1.5
    with pytest.raises(SystemExit):
        parse_config(base + ["--moe-layer-freq", "__import__('os')"], world_size=1)
