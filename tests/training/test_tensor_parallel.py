"""Tensor parallelism end to end through ``megadlms.pretrain.run`` (the real CLI) on gloo
CPU ranks: the same global batch gives the same loss curve at (tp=2, dp=2), (tp=1, dp=4)
and on one process (fp32, dropout 0, within 1e-5 relative), with DDP and the distributed
optimizer, sequence parallelism, distributed-optimizer instances and with/without
gradient-accumulation fusion; with dropout on the TP replicas stay bitwise identical; a
(tp=2, dp=2) checkpoint resumes at (tp=1, dp=4) and on one process, tp=1 checkpoints (DDP +
distributed optimizer, FSDP2) resume at tp=2, and megadlms-generate loads a TP checkpoint.

The independent reference is the one-process run (the plain model, no collectives). The
vocabulary is padded to the same 384 rows at every tp (--make-vocab-size-divisible-by 128
at tp 1, 64 at tp 2: Megatron pads to a multiple of that x tp), so every layout trains the
same model. One world per size does all its runs (the 4-rank one in two jobs); the runs
whose evaluation no test reads pass --eval-iters 0.
"""

from __future__ import annotations

import os

import pytest

from megadlms.parallel.sharding import sharding_of
from tests.diffusion._padding import checkpoint_generates_real_tokens
from tests.dist_utils import run_distributed

TINY = (
    "--difflm-objective llada "
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--seq-length 32 --position-embedding-type rope --normalization RMSNorm --swiglu --qk-layernorm "
    "--attention-dropout 0 --hidden-dropout 0 --micro-batch-size 2 --global-batch-size 8 "
    "--train-iters 5 --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 1 "
    "--weight-decay 0.1 --clip-grad 1.0 --seed 7 --mock-data --num-workers 0 --log-interval 1 "
    "--eval-interval 5 --eval-iters 1 --difflm-eval-mc-samples 2 --difflm-varilen-prob 0.2 "
    "--untie-embeddings-and-output-weights "
    # The tests read the evaluation at iteration 5; stopping there by --exit-interval skips the
    # end-of-training evaluations of the validation (the same numbers again) and test sets.
    "--exit-interval 5"
).split()
TP1 = ["--make-vocab-size-divisible-by", "128"]
TP2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
DISTOPT = ["--use-distributed-optimizer"]
DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
# No evaluation (no valid/test set; the train stream does not depend on it): for the runs whose
# NELBO no test reads.
NOEVAL = ["--eval-iters", "0"]
REL = 1e-5


def _run(argv):
    from megadlms.pretrain import run

    return run(TINY + list(argv))


def _replicated_after(argv):
    """Run, and return the TP-replicated parameters (norms) of the final model."""
    from megadlms.distributed import unwrap_model
    from megadlms.training import train

    real, seen = train.train_step, {}

    def spy(model, *a, **k):
        seen["model"] = model
        return real(model, *a, **k)

    train.train_step = spy
    try:
        res = _run(argv)
    finally:
        train.train_step = real
    params = {
        n: p.detach().clone()
        for n, p in unwrap_model(seen["model"]).named_parameters()
        if sharding_of(p).tp_dim is None
    }
    return res, params


def _counting_fused_gemms(argv):
    """Run, counting the weight-gradient GEMMs that went straight into main_grad."""
    import megadlm_ext

    real, calls = megadlm_ext.wgrad_accumulate, [0]

    def counting(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    megadlm_ext.wgrad_accumulate = counting
    try:
        return _run(argv), calls[0]
    finally:
        megadlm_ext.wgrad_accumulate = real


def _four_rank_curves(rank, world, tmp):
    out = {
        "dp4": _run(TP1),
        "dp4_distopt": _run(TP1 + DISTOPT),
        "tp2_sp": _run(TP2 + ["--sequence-parallel"]),
        "tp2_distopt": _run(TP2 + DISTOPT + ["--overlap-grad-reduce", "--ddp-bucket-size", "2000"]),
        "instances2": _run(TP1 + DISTOPT + NOEVAL + ["--num-distributed-optimizer-instances", "2"]),
    }
    out["tp2"], out["fused_gemms"] = _counting_fused_gemms(TP2)
    out["tp2_nofusion"], out["unfused_gemms"] = _counting_fused_gemms(
        TP2 + ["--no-gradient-accumulation-fusion"]
    )
    return out


def _four_rank_resumes(rank, world, tmp):
    out = {}
    ckpt = os.path.join(tmp, "tp2ckpt")
    out["tp2_part"] = _run(
        TP2 + DISTOPT + NOEVAL + ["--save", ckpt, "--save-interval", "100", "--exit-interval", "3"]
    )
    out["tp2_to_dp4"] = _run(TP1 + DISTOPT + NOEVAL + ["--load", ckpt])
    # and back: a tp1 checkpoint (DDP + distributed optimizer, or FSDP2) resumes at tp2
    for name, flags in (("dp4", DISTOPT), ("fsdp", ["--use-torch-fsdp2"])):
        root = os.path.join(tmp, f"{name}ckpt")
        out[f"{name}_part"] = _run(
            TP1 + flags + NOEVAL + ["--save", root, "--save-interval", "100", "--exit-interval", "3"]
        )
        out[f"{name}_to_tp2"] = _run(TP2 + DISTOPT + NOEVAL + ["--load", root])
    out["dropout"] = _replicated_after(TP2 + DROPOUT + NOEVAL)
    return out


def _one_process_world(rank, world, tmp):
    return {
        "single": _run(TP1),
        "tp2_to_single": _run(TP1 + NOEVAL + ["--load", os.path.join(tmp, "tp2ckpt")]),
    }


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("tp"))
    # Two jobs on the 4-rank world: a job's runs keep their process groups (and the groups'
    # threads) until the job ends, and 14 runs in one job took a slot past the pool's
    # recycling limit (a respawn, imports again, for the next test).
    curves = run_distributed(_four_rank_curves, 4, args=(tmp,), timeout=900)
    resumes = run_distributed(_four_rank_resumes, 4, args=(tmp,), timeout=900)
    four = [{**a, **b} for a, b in zip(curves, resumes)]
    one = run_distributed(_one_process_world, 1, args=(tmp,), timeout=600)
    return four, one[0], tmp


def _assert_curve(res, ref, its=range(1, 6)):
    got = [res.losses[i] for i in its]
    want = [ref.losses[i] for i in its]
    assert got == pytest.approx(want, rel=REL), (got, want)


@pytest.mark.parametrize("name", ["dp4", "dp4_distopt", "tp2", "tp2_sp", "tp2_distopt", "tp2_nofusion"])
def test_loss_curve_matches_one_process(worlds, name):
    four, one, _ = worlds
    _assert_curve(four[0][name], one["single"])
    assert four[0][name].grad_norms[5] == pytest.approx(one["single"].grad_norms[5], rel=1e-4)
    assert four[0][name].evals[5] == pytest.approx(one["single"].evals[5], rel=REL)


def test_every_rank_reports_the_same_loss(worlds):
    four, _, _ = worlds
    for r in range(1, 4):
        assert four[r]["tp2"].losses == four[0]["tp2"].losses


def test_gradient_accumulation_fusion_is_on_by_default(worlds):
    four, _, _ = worlds
    # 5 steps x 2 micro-batches x (2 layers x 4 linears + the untied output layer)
    assert four[0]["fused_gemms"] == 5 * 2 * (2 * 4 + 1)
    assert four[0]["unfused_gemms"] == 0


def test_distributed_optimizer_instances_match_one_instance(worlds):
    four, _, _ = worlds
    _assert_curve(four[0]["instances2"], four[0]["dp4_distopt"])


def test_tp2_checkpoint_resumes_at_dp4_and_on_one_process(worlds):
    four, one, _ = worlds
    assert four[0]["tp2_part"].iteration == 3
    _assert_curve(four[0]["tp2_to_dp4"], four[0]["tp2_distopt"], its=range(4, 6))
    _assert_curve(one["tp2_to_single"], four[0]["tp2_distopt"], its=range(4, 6))


@pytest.mark.parametrize("name", ["dp4", "fsdp"])
def test_tp1_checkpoint_resumes_at_tp2(worlds, name):
    four, _, _ = worlds
    assert four[0][f"{name}_part"].iteration == 3
    _assert_curve(four[0][f"{name}_to_tp2"], four[0]["dp4_distopt"], its=range(4, 6))


def test_dropout_keeps_tp_replicas_bitwise_identical(worlds):
    four, _, _ = worlds
    (res0, p0), (res1, p1) = four[0]["dropout"], four[1]["dropout"]  # tp ranks 0, 1 of dp rank 0
    assert p0 and set(p0) == set(p1)
    for name in p0:
        assert p0[name].equal(p1[name]), name
    assert res0.losses == res1.losses


def test_generate_loads_the_tp_checkpoint_on_one_process(worlds, capsys):
    from megadlms.generate import main as generate_main

    _, _, tmp = worlds
    capsys.readouterr()
    argv = ["--load", os.path.join(tmp, "tp2ckpt"), "--prompt", "In the", "--gen-length", "8"]
    assert generate_main(argv + ["--steps", "4", "--block-length", "4"]) == 0
    assert capsys.readouterr().out.startswith("In the")
    # Padding rows pinned above every token: only real tokens come out ('x', the best of them).
    got = checkpoint_generates_real_tokens(os.path.join(tmp, "tp2ckpt"))
    assert got == {"rows": 384, "real": 259, "text": "x" * 8}
