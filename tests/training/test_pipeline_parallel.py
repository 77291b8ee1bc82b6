"""Pipeline parallelism end to end through ``megadlms.pretrain.run`` (the real CLI) on gloo
CPU ranks (fp32, dropout 0, tiny model, mock data, 5 steps).

The independent reference is the one-process run (the plain model, no collectives). Every
layout trains the same model from the same seed on the same global batch, so its loss curve,
grad norms, validation NELBO and final weights must match the reference within 1e-5 relative:

* pp=2 with 1F1B and with the interleaved schedule (2 model chunks per rank), uneven
  first/last stages, untied embeddings, and the tied embedding (its last-stage copy summed
  over the embedding group); the --metrics-jsonl records carry the same lm_loss per iteration;
* pp=2 x dp=2 (distributed optimizer) and pp=2 x tp=2 x dp=2 (8 ranks), with LLaDA's crop
  (one per step: MegaDLMs' per-micro-batch crop depends on the data-parallel size);
* checkpoints: a (pp=2, tp=2) checkpoint resumes at (pp=1, tp=2, dp=2) and on one process,
  a (pp=1, tp=2, dp=2) one at (pp=2, tp=2), distributed-optimizer state included (sharded
  over dp on one side): iterations 4-5 equal the one-process run's; a pp=2 checkpoint of the
  final weights equals the one-process run's; megadlms-generate loads a PP checkpoint on one
  process;
* Megatron's defaults (dropout 0.1, gradient-accumulation fusion, distributed optimizer with
  --overlap-grad-reduce) at pp=2 x dp=2 train and resume: the resumed iterations 4-5 are
  bitwise the uninterrupted run's (RNG restored at the same layout);
* too few micro-batches for the schedule stop the CLI with the error naming the flags.

One world per size does all its runs (the 4-rank one in two jobs: a job's runs keep their
process groups and their threads until it ends). Only the pp=2 x tp=2 x dp=2 curve runs on 8
ranks (8 ranks on 2 cores cost 4x): the resharding runs use 4, where the same pp/tp/dp
changes fit. Runs whose evaluation no test reads pass --eval-iters 0 (the train stream does
not depend on it).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.diffusion._padding import checkpoint_generates_real_tokens
from tests.dist_utils import run_distributed

TINY = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu "
    "--attention-dropout 0 --hidden-dropout 0 --micro-batch-size 1 --global-batch-size 4 "
    "--train-iters 5 --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 1 "
    "--weight-decay 0.1 --clip-grad 1.0 --seed 7 --mock-data --num-workers 0 --log-interval 1 "
    "--eval-interval 5 --eval-iters 1 --difflm-eval-mc-samples 2 --difflm-varilen-prob 0.3 "
    # The tests read the evaluation at iteration 5; stopping there by --exit-interval skips the
    # end-of-training evaluations of the validation (the same numbers again) and test sets.
    "--exit-interval 5"
).split()
PP2 = ["--pipeline-model-parallel-size", "2"]
TP2 = ["--tensor-model-parallel-size", "2"]
VP2 = ["--num-layers-per-virtual-pipeline-stage", "1"]
UNEVEN = ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "3"]
UNTIED = ["--untie-embeddings-and-output-weights"]
DISTOPT = ["--use-distributed-optimizer"]
MEGATRON = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1", "--overlap-grad-reduce"] + DISTOPT
# Data-parallel layouts: global batch 8, and LLaDA's crop (drawn once per step): MegaDLMs' crop
# is drawn per micro-batch of a rank, so it depends on dp (the dp=1 runs above use it).
B8 = ["--global-batch-size", "8", "--difflm-objective", "llada"]
LLADA = ["--difflm-objective", "llada"]  # global batch 4: the resharding runs (dp <= 2)
# No evaluation (no valid/test set): for runs whose NELBO no test reads (resumes, partial runs).
NOEVAL = ["--eval-iters", "0"]
REL = 1e-5


def _run(argv):
    """One run; the vocabulary is padded to the same rows at tp 1 and 2 (Megatron pads to a
    multiple of --make-vocab-size-divisible-by x tp), so every layout trains the same model."""
    from megadlms.pretrain import run

    divisible = "64" if "--tensor-model-parallel-size" in argv else "128"
    return run(TINY + ["--make-vocab-size-divisible-by", divisible] + list(argv))


def _save(tmp, name, every=5):
    return ["--save", os.path.join(tmp, name), "--save-interval", str(every)]


def _two_rank_world(rank, world, tmp):
    jsonl = os.path.join(tmp, "pp2.jsonl")
    out = {
        "pp2": _run(PP2 + ["--metrics-jsonl", jsonl] + _save(tmp, "pp2ckpt")),
        "pp2_vp2": _run(PP2 + VP2),
        "pp2_uneven": _run(PP2 + UNEVEN),
        "pp2_untied": _run(PP2 + UNTIED + ["--virtual-pipeline-model-parallel-size", "2"]),
    }
    try:
        _run(PP2 + ["--global-batch-size", "1"])
    except ValueError as exc:
        out["too_few"] = str(exc)
    return out


def _four_rank_world(rank, world, tmp):
    out = {"pp2_dp2": _run(PP2 + DISTOPT + B8)}
    full = PP2 + MEGATRON + ["--global-batch-size", "8"]
    out["megatron"] = _run(full)
    out["megatron_part"] = _run(full + NOEVAL + _save(tmp, "megatron", 100) + ["--exit-interval", "3"])
    out["megatron_resumed"] = _run(full + NOEVAL + ["--load", os.path.join(tmp, "megatron")])
    return out


def _four_rank_resharding(rank, world, tmp):
    out = {}
    # resharding: a (pp2, tp2) checkpoint at (tp2, dp2) and back (the distributed optimizer's
    # state unsharded on the grid, sharded over dp=2 on the flat layout)
    grid = PP2 + TP2 + DISTOPT + LLADA + NOEVAL
    flat = TP2 + DISTOPT + LLADA + NOEVAL
    out["grid_part"] = _run(grid + _save(tmp, "gridckpt", 100) + ["--exit-interval", "3"])
    out["grid_to_tp2_dp2"] = _run(flat + ["--load", os.path.join(tmp, "gridckpt")])
    out["flat_part"] = _run(flat + _save(tmp, "flatckpt", 100) + ["--exit-interval", "3"])
    out["flat_to_grid"] = _run(grid + ["--load", os.path.join(tmp, "flatckpt")])
    return out


def _eight_rank_world(rank, world, tmp):
    return {"pp2_tp2_dp2": _run(PP2 + TP2 + DISTOPT + B8)}


def _library_first_step(argv):
    """Iteration 1's lm loss through the library on one process: ``compute_loss`` on each of
    the trainer's micro-batches (its model, data and crops), summed over the global N."""
    from megadlms.config import parse_config
    from megadlms.diffusion import compute_loss, loss_token_count, micro_batch_crop
    from megadlms.distributed import unwrap_model
    from megadlms.training.train import Trainer
    from megadlms.training.validation import to_device

    trainer = Trainer(parse_config(TINY + ["--make-vocab-size-divisible-by", "128"] + argv, world_size=1))
    model, cfg, n = unwrap_model(trainer.model), trainer.config.diffusion, trainer.num_micro
    it = iter(trainer.train_loader)
    micro = [to_device(next(it), trainer.device) for _ in range(n)]
    S = micro[0]["labels"].shape[1]
    crops = [micro_batch_crop(cfg, 0, i, n, S) for i in range(n)]
    total = sum(float(loss_token_count(b, c, cfg)) for b, c in zip(micro, crops))
    with torch.no_grad():
        losses = [compute_loss(model, b, cfg, 0, c).loss_sum for b, c in zip(micro, crops)]
    return {"crops": crops, "loss": float(sum(float(x) for x in losses)) / total}


def _one_process_world(rank, world, tmp):
    return {
        "library": _library_first_step([]),
        "single": _run(_save(tmp, "single")),
        "single_b8": _run(B8),
        "single_untied": _run(UNTIED),
        "single_llada": _run(LLADA + NOEVAL),  # the resharding runs' reference (global batch 4)
        "grid_to_single": _run(DISTOPT + LLADA + NOEVAL + ["--load", os.path.join(tmp, "gridckpt")]),
    }


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("pp"))
    two = run_distributed(_two_rank_world, 2, args=(tmp,), timeout=900)
    # two jobs: a job's runs keep their process groups (and their threads) until it ends
    four = run_distributed(_four_rank_world, 4, args=(tmp,), timeout=900)
    reshard = run_distributed(_four_rank_resharding, 4, args=(tmp,), timeout=900)
    four = [{**a, **b} for a, b in zip(four, reshard)]
    eight = run_distributed(_eight_rank_world, 8, args=(tmp,), timeout=900)
    one = run_distributed(_one_process_world, 1, args=(tmp,), timeout=600)
    return {"two": two, "four": four, "eight": eight, "one": one[0], "tmp": tmp}


def _assert_curve(res, ref, its=range(1, 6)):
    got = [res.losses[i] for i in its]
    want = [ref.losses[i] for i in its]
    assert got == pytest.approx(want, rel=REL), (got, want)


@pytest.mark.parametrize(
    "world,name,ref",
    [
        ("two", "pp2", "single"),
        ("two", "pp2_vp2", "single"),
        ("two", "pp2_uneven", "single"),
        ("two", "pp2_untied", "single_untied"),
        ("four", "pp2_dp2", "single_b8"),
        ("eight", "pp2_tp2_dp2", "single_b8"),
    ],
)
def test_loss_curve_matches_one_process(worlds, world, name, ref):
    res, want = worlds[world][0][name], worlds["one"][ref]
    _assert_curve(res, want)
    assert [res.grad_norms[i] for i in range(1, 6)] == pytest.approx(
        [want.grad_norms[i] for i in range(1, 6)], rel=1e-4
    )
    assert res.evals[5] == pytest.approx(want.evals[5], rel=REL)
    for rank_result in worlds[world][1:]:  # every rank reports the same numbers
        assert rank_result[name].losses == res.losses


def test_library_loss_is_the_pp2_trainers(worlds):
    """One objective: ``compute_loss`` (the library, one process, the plain model) gives the
    loss the 2-rank pp=2 trainer reports for its first step (the last stage scores with the
    same function), with MegaDLMs' objective (text[1:L]) and its per-micro-batch crop draws."""
    lib = worlds["one"]["library"]
    assert len(lib["crops"]) == 4
    assert worlds["two"][0]["pp2"].losses[1] == pytest.approx(lib["loss"], rel=1e-6, abs=0)
    assert worlds["one"]["single"].losses[1] == pytest.approx(lib["loss"], rel=1e-6, abs=0)


def test_final_weights_match_one_process(worlds):
    """The pp=2 run's checkpoint (every stage's tensors, global names, no tied copy) holds the
    one-process run's weights."""
    from megadlms import checkpoint as ck

    tmp = worlds["tmp"]
    a, b = (ck.resolve_checkpoint(os.path.join(tmp, n)) for n in ("pp2ckpt", "single"))
    shapes_a = ck.tensor_shapes(a, ck.read_common(a))
    shapes_b = ck.tensor_shapes(b, ck.read_common(b))
    assert sorted(shapes_a) == sorted(shapes_b)
    assert not any("output_layer.weight" in k for k in shapes_a), "the tied copy is never stored"
    keys = sorted(k for k in shapes_a if k.startswith("model/"))
    ta = {k: torch.empty(shapes_a[k][0], dtype=shapes_a[k][1]) for k in keys}
    tb = {k: torch.empty(shapes_b[k][0], dtype=shapes_b[k][1]) for k in keys}
    ck.read_tensors(a, ck.read_common(a), ta)
    ck.read_tensors(b, ck.read_common(b), tb)
    for k in keys:
        torch.testing.assert_close(ta[k], tb[k], rtol=1e-4, atol=1e-5, msg=k)
    assert ck.read_common(a)["parallel"] == {
        "tp": 1,
        "pp": 2,
        "vp": 1,
        "dp": 1,
        "world": 2,
        "ep": 1,
    }


def test_metrics_jsonl_records_lm_loss_per_iteration(worlds):
    with open(os.path.join(worlds["tmp"], "pp2.jsonl")) as f:
        train = [r for r in map(json.loads, f) if r.get("event") == "train"]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4, 5]
    want = worlds["one"]["single"].losses
    assert [r["lm_loss"] for r in train] == pytest.approx([want[i] for i in range(1, 6)], rel=REL)


def test_grid_checkpoint_reshards(worlds):
    four, one = worlds["four"][0], worlds["one"]
    ref = one["single_llada"]  # the uninterrupted curve on one process
    assert four["grid_part"].iteration == 3 and four["flat_part"].iteration == 3
    _assert_curve(four["grid_to_tp2_dp2"], ref, its=range(4, 6))
    _assert_curve(four["flat_to_grid"], ref, its=range(4, 6))
    _assert_curve(one["grid_to_single"], ref, its=range(4, 6))


def test_megatron_defaults_train_and_resume(worlds):
    four = worlds["four"][0]
    full, resumed = four["megatron"], four["megatron_resumed"]
    assert four["megatron_part"].iteration == 3 and resumed.iteration == 5
    assert all(torch.isfinite(torch.tensor(v)) for v in full.losses.values())
    # the same layout: RNG (dropout) restored, so the continuation is the uninterrupted run
    assert [resumed.losses[i] for i in (4, 5)] == [full.losses[i] for i in (4, 5)]


def test_too_few_micro_batches_is_a_cli_error(worlds):
    msg = worlds["two"][0]["too_few"]
    assert "--global-batch-size 1 / (--micro-batch-size 1 x --data-parallel-size 1) = 1 micro-batches" in msg
    assert "needs at least --pipeline-model-parallel-size 2" in msg


def test_generate_loads_the_pp_checkpoint_on_one_process(worlds, capsys):
    from megadlms.generate import main as generate_main

    capsys.readouterr()
    argv = ["--load", os.path.join(worlds["tmp"], "pp2ckpt"), "--prompt", "In the", "--gen-length", "8"]
    assert generate_main(argv + ["--steps", "4", "--block-length", "4"]) == 0
    assert capsys.readouterr().out.startswith("In the")
    # Padding rows pinned above every token: only real tokens come out ('x', the best of them).
    got = checkpoint_generates_real_tokens(os.path.join(worlds["tmp"], "pp2ckpt"))
    assert got["real"] == 259 and got["text"] == "x" * 8
