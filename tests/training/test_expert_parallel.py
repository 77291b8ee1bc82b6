"""Expert parallelism end to end through ``megadlms.pretrain.run`` (the real CLI) on gloo CPU
ranks: a tiny MoE DLM (4 experts, top-2, capacity 1.5 with dropping, aux + z loss, fp32,
dropout 0) trains the same 5 steps at (ep=2 x dp=4) with DDP and with the distributed
optimizer (overlapped reduce and gather over several buckets), at (ep=4) with the allgather
dispatcher and at (ep=1, dp=4) as on one process: the loss, the aux loss and the grad norm
within 1e-5 relative. An (ep=2) checkpoint resumes at (ep=1, dp=4), at (ep=4) and on one
process, an (ep=1) checkpoint at (ep=4), continuing the uninterrupted curve; the CLI rules
(FSDP2 with experts, EP without experts, EP not dividing dp or the experts) name the flags.
Pipeline and expert parallelism together: (pp=2 x dp=2, ep=2) with the distributed optimizer
and overlapped reduce trains the same 5 steps as one process; its checkpoint resumes on one
process and at (pp=1, dp=4, ep=2), continuing the uninterrupted curve.

The independent reference is the one-process run (all experts local, no collectives).
Megatron's dropout 0.1 runs at ep=2. One 4-rank world (two jobs: the curves, then the
resumes) and one one-process world do every run (the PP x EP runs share them: same model,
same reference). No test reads an evaluation,
so none runs (--eval-iters 0: no valid/test set; the train stream does not depend on it).
"""

from __future__ import annotations

import json
import math
import os

import pytest

from megadlms.config import parse_config
from tests.diffusion._padding import checkpoint_generates_real_tokens
from tests.dist_utils import run_distributed

TINY = (
    "--difflm-objective llada "
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 5 --lr 3e-3 --min-lr 3e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 1 --weight-decay 0.1 --clip-grad 1.0 --seed 7 "
    "--mock-data --num-workers 0 --log-interval 1 --eval-interval 100 --eval-iters 0 "
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-aux-loss-coeff 0.1 "
    "--moe-z-loss-coeff 0.01 --moe-expert-capacity-factor 1.5 --moe-token-dispatcher-type alltoall"
).split()
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]
EP2, EP4 = ["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size", "4"]
PP2 = ["--pipeline-model-parallel-size", "2"]
DISTOPT = ["--use-distributed-optimizer"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "4000"]
REL = 1e-5


def _run(tmp, name, argv, dropout=False):
    from megadlms.pretrain import run

    metrics = os.path.join(tmp, f"{name}.jsonl")
    res = run(TINY + ([] if dropout else NO_DROPOUT) + list(argv) + ["--metrics-jsonl", metrics])
    return res, metrics


def _four(rank, world, tmp, part_two):
    ep2ck, ep1ck = os.path.join(tmp, "ep2ckpt"), os.path.join(tmp, "ep1ckpt")
    ppck = os.path.join(tmp, "pp2ep2")
    part = ["--save-interval", "100", "--exit-interval", "3"]
    curves = {
        "ep1_dp4": [],
        "ep2": EP2,
        "ep2_distopt": EP2 + DISTOPT + OVERLAP,
        "ep4_allgather": EP4 + DISTOPT + ["--moe-token-dispatcher-type", "allgather"],
        # pipeline x expert parallelism (tied embeddings across the two stages)
        "pp2_ep2": PP2 + EP2 + DISTOPT + OVERLAP,
    }
    resumes = {
        "ep2_part": EP2 + DISTOPT + ["--save", ep2ck] + part,
        "ep2_to_ep1": DISTOPT + ["--load", ep2ck],
        "ep2_to_ep4": EP4 + ["--load", ep2ck],
        "ep1_part": ["--save", ep1ck] + part,
        "ep1_to_ep4": EP4 + DISTOPT + ["--load", ep1ck],
        "pp2_ep2_part": PP2 + EP2 + DISTOPT + ["--save", ppck] + part,
        "pp2_to_pp1_ep2_dp4": EP2 + DISTOPT + ["--load", ppck],
    }
    out = {name: _run(tmp, name, argv) for name, argv in (resumes if part_two else curves).items()}
    if not part_two:
        out["dropout"] = _run(tmp, "dropout", EP2 + DISTOPT, dropout=True)
    return out


def _one(rank, world, tmp):
    return {
        "single": _run(tmp, "single", []),
        "ep2_to_single": _run(tmp, "ep2_to_single", ["--load", os.path.join(tmp, "ep2ckpt")]),
        "pp2_ep2_to_single": _run(tmp, "pp2_ep2_to_single", ["--load", os.path.join(tmp, "pp2ep2")]),
        "pp2_ep2_generate": checkpoint_generates_real_tokens(os.path.join(tmp, "pp2ep2")),
    }


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ep"))
    # Two jobs on the 4-rank world: a job's runs keep their process groups (and the groups'
    # threads) until the job ends, and 13 runs in one job took a slot past the pool's
    # recycling limit (a respawn, imports again, for the next test).
    curves, resumes = (run_distributed(_four, 4, args=(tmp, two), timeout=900) for two in (False, True))
    four = [{**a, **b} for a, b in zip(curves, resumes)]
    one = run_distributed(_one, 1, args=(tmp,), timeout=600)
    return four, one[0]


def _aux(metrics):
    with open(metrics) as f:
        recs = [json.loads(line) for line in f if '"train"' in line]
    return {r["iteration"]: r["moe_aux_loss"] for r in recs}


def _assert_curve(got, want, its=range(1, 6)):
    (res, metrics), (ref, ref_metrics) = got, want
    assert [res.losses[i] for i in its] == pytest.approx([ref.losses[i] for i in its], rel=REL)
    aux, ref_aux = _aux(metrics), _aux(ref_metrics)
    assert [aux[i] for i in its] == pytest.approx([ref_aux[i] for i in its], rel=REL)
    assert [res.grad_norms[i] for i in its] == pytest.approx([ref.grad_norms[i] for i in its], rel=1e-4)


@pytest.mark.parametrize("name", ["ep1_dp4", "ep2", "ep2_distopt", "ep4_allgather"])
def test_loss_and_aux_match_one_process(worlds, name):
    four, one = worlds
    _assert_curve(four[0][name], one["single"])
    assert all(r[name][0].losses == four[0][name][0].losses for r in four)  # every rank reports it
    assert _aux(one["single"][1])[1] > 0


@pytest.mark.parametrize("name", ["ep2_to_ep1", "ep2_to_ep4", "ep1_to_ep4"])
def test_checkpoint_resumes_at_another_ep(worlds, name):
    four, one = worlds
    src = name.split("_to_")[0]
    assert four[0][f"{src}_part"][0].iteration == 3
    _assert_curve(four[0][name], one["single"], its=range(4, 6))


def test_ep2_checkpoint_resumes_on_one_process(worlds):
    _, one = worlds
    _assert_curve(one["ep2_to_single"], one["single"], its=range(4, 6))


def test_moe_pipeline_checkpoint_generates_real_tokens_only(worlds):
    # The MoE model saved by pp2 x ep2, loaded on one process: it knows its real vocabulary from the
    # checkpoint, and with its padding rows pinned above every token the sampler still draws real ones.
    _, one = worlds
    assert one["pp2_ep2_generate"] == {"rows": 384, "real": 259, "text": "x" * 8}


def test_pipeline_with_expert_parallelism_matches_one_process(worlds):
    four, one = worlds
    _assert_curve(four[0]["pp2_ep2"], one["single"])
    assert all(r["pp2_ep2"][0].losses == four[0]["pp2_ep2"][0].losses for r in four)
    assert four[0]["pp2_ep2_part"][0].iteration == 3
    _assert_curve(four[0]["pp2_to_pp1_ep2_dp4"], one["single"], its=range(4, 6))
    _assert_curve(one["pp2_ep2_to_single"], one["single"], its=range(4, 6))


def test_megatron_dropout_trains_at_ep2(worlds):
    four, _ = worlds
    assert all(math.isfinite(v) for v in four[0]["dropout"][0].losses.values())


@pytest.mark.parametrize(
    "extra,world,needles",
    [
        (
            ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"],
            2,
            ["--use-torch-fsdp2", "--num-experts 4"],
        ),
        (
            ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"] + EP2,
            2,
            ["--use-torch-fsdp2 requires --expert-model-parallel-size 1"],
        ),
        (["--expert-model-parallel-size", "3"], 4, ["--expert-model-parallel-size 3 does not divide"]),
        (
            ["--expert-model-parallel-size", "8"],
            8,
            ["--num-experts 4 is not divisible by --expert-model-parallel-size 8"],
        ),
        (
            EP2 + DISTOPT + ["--num-distributed-optimizer-instances", "2"],
            4,
            ["--num-distributed-optimizer-instances 2"],
        ),
    ],
)
def test_cli_rules_name_the_flags(extra, world, needles):
    with pytest.raises(ValueError) as exc:
        parse_config(TINY + NO_DROPOUT + extra, world_size=world)
    for needle in needles:
        assert needle in str(exc.value), str(exc.value)


def test_ep_without_experts_names_the_flags():
    dense = [a for a in TINY if not a.startswith("--moe")]
    dense = dense[: dense.index("--num-experts")]
    with pytest.raises(ValueError, match="--expert-model-parallel-size 2 needs a mixture-of-experts model"):
        parse_config(dense + EP2, world_size=2)
    cfg = parse_config(TINY + NO_DROPOUT + EP2, world_size=4)
    assert cfg.parallel.expert_model_parallel_size == 2 and cfg.parallel.data_parallel_size == 4
