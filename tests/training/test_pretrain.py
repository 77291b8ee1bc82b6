"""The training loop end to end through ``megadlms.pretrain.run`` (the real CLI parser),
on gloo CPU ranks with a tiny model and mock data.

References are independent runs, not the code's own numbers: the uninterrupted run for
every resume, a run of one iteration fewer for a NaN-skipped step, a saved checkpoint for
the exit paths. Worlds are grouped so each spawn does several checks (spawn costs ~4 s
per rank): DDP x2 -> FSDP2 x2 -> DDP x3 (+ NaN, SIGTERM) -> distributed optimizer x1.
"""

from __future__ import annotations

import json
import math
import os
import signal

import pytest

from tests.dist_utils import run_distributed

# Runs are compared across data-parallel sizes (resharded resumes): the LLaDA objective draws
# the random-length crop once per step, so its loss curve does not depend on the layout;
# MegaDLMs' (the default) draws it per micro-batch, seeded by the micro-batch count.
TINY = (
    "--difflm-objective llada "
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
    "--attention-dropout 0 --hidden-dropout 0 --micro-batch-size 2 --global-batch-size 12 "
    "--train-iters 8 --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 3 "
    "--weight-decay 0.1 --clip-grad 1.0 --seed 7 --mock-data --num-workers 0 --log-interval 1 "
    "--eval-interval 4 --eval-iters 1 --difflm-eval-mc-samples 2 --difflm-varilen-prob 0.2"
).split()
ITERS, HALF = 8, 4  # every resume splits the run at HALF (the eval interval too)
# Only the straight DDP run's evaluations are read (--metrics-jsonl): the other runs skip
# them (validation draws from its own seed, so the training curve is the same either way).
NO_EVAL = ["--eval-iters", "0"]
# FSDP2 runs take the global batch in one micro-batch per rank (12 = 6 x dp 2): its gathers and
# reduce-scatters run per micro-batch, and the curve does not depend on the split (the
# LLaDA crop is drawn per step, the masks per sample), so it still matches DDP's at 2 x 3.
FSDP = ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights", "--micro-batch-size", "6"]
UNTIED = ["--untie-embeddings-and-output-weights"]


def _run(argv):
    from megadlms.pretrain import run

    return run(TINY + list(argv))


def _losses(res, lo, hi):
    return [res.losses[i] for i in range(lo, hi + 1)]


# ------------------------------------------------------------------ world 1: DDP, 2 ranks
def _ddp_world(rank, world, tmp):
    out = {}
    out["straight"] = _run(UNTIED + ["--metrics-jsonl", os.path.join(tmp, "m.jsonl")])
    for fmt in ("torch_dist", "torch"):
        save = os.path.join(tmp, f"ddp_{fmt}")
        out[f"part_{fmt}"] = _run(
            UNTIED
            + NO_EVAL
            + ["--save", save, "--save-interval", "100", "--exit-interval", "4", "--ckpt-format", fmt]
        )
        out[f"resume_{fmt}"] = _run(UNTIED + NO_EVAL + ["--load", save, "--ckpt-format", fmt])
    return out


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    return tmp, run_distributed(_ddp_world, 2, (str(tmp),))


def test_ddp_resume_is_bitwise_and_metrics_parse(ddp_runs):
    tmp_path, (a, b) = ddp_runs
    straight = a["straight"]
    assert straight.wrapper == "DistributedDataParallel" and straight.iteration == ITERS
    assert _losses(straight, 1, ITERS) == _losses(b["straight"], 1, ITERS)  # ranks agree
    for fmt in ("torch_dist", "torch"):
        part, resume = a[f"part_{fmt}"], a[f"resume_{fmt}"]
        assert part.exit_reason == "exit_interval" and part.iteration == HALF
        assert sorted(resume.losses) == list(range(HALF + 1, ITERS + 1))
        assert _losses(part, 1, HALF) == _losses(straight, 1, HALF)
        # bitwise: same floats, not approximately
        assert _losses(resume, HALF + 1, ITERS) == _losses(straight, HALF + 1, ITERS), fmt
        second_half = range(HALF + 1, ITERS + 1)
        assert [resume.lrs[i] for i in second_half] == [straight.lrs[i] for i in second_half]
    assert os.path.isfile(tmp_path / "ddp_torch" / f"iter_{HALF:07d}" / "mp_rank_00" / "model_optim_rng.pt")
    assert (tmp_path / "ddp_torch_dist" / "latest_checkpointed_iteration.txt").read_text() == str(HALF)
    # --metrics-jsonl: one JSON object per logged iteration, plus eval records
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    train = [m for m in records if m["event"] == "train"]
    evals = [m for m in records if m["event"] == "eval"]
    assert [m["iteration"] for m in train] == list(range(1, ITERS + 1))
    for m in train:
        for key in (
            "iteration",
            "consumed_samples",
            "lm_loss",
            "lr",
            "grad_norm",
            "loss_scale",
            "skipped",
            "tokens_per_sec",
        ):
            assert key in m
        assert m["consumed_samples"] == 12 * m["iteration"] and m["tokens_per_sec"] > 0
        assert m["lm_loss"] == pytest.approx(straight.losses[m["iteration"]], rel=1e-12)
    assert [e["iteration"] for e in evals] == [HALF, ITERS]
    assert evals[0]["valid_nelbo"] == pytest.approx(straight.evals[HALF])
    # the loss falls on average (random tokens: towards log(vocab) from above)
    assert sum(_losses(straight, ITERS - 2, ITERS)) < sum(_losses(straight, 1, 3))


# ------------------------------------------------------------------ world 2: FSDP2, 2 ranks
def _fsdp_world(rank, world, tmp, ddp_torch_ckpt):
    save = os.path.join(tmp, "fsdp")
    return {
        "straight": _run(FSDP + NO_EVAL),
        # a periodic save before the exit's save (the resume reads the newest)
        "part": _run(FSDP + NO_EVAL + ["--save", save, "--save-interval", "3", "--exit-interval", str(HALF)]),
        "resume": _run(FSDP + NO_EVAL + ["--load", save]),
        # a DDP checkpoint in the single-file torch format, read into DTensor shards
        "from_ddp_torch": _run(FSDP + NO_EVAL + ["--load", ddp_torch_ckpt]),
    }


def _ddp3_world(rank, world, tmp):
    """DDP at dp=3 resumes the FSDP2 dp=2 checkpoint; then NaN injection and SIGTERM."""
    from megadlms.distributed import unwrap_model
    from megadlms.training import pipeline_run, train

    out = {"from_fsdp": _run(UNTIED + NO_EVAL + ["--load", os.path.join(tmp, "fsdp")])}

    # NaN in rank 2's loss at iteration 3 only: the step is skipped on every rank.
    real_inputs, real_step = pipeline_run.training_inputs, train.train_step
    sums, current = [], [None]

    def nan_inputs(batch, cfg, crop=None):  # the objective's inputs of one micro-batch
        inputs = real_inputs(batch, cfg, crop)
        if rank == world - 1 and current[0] in inject:
            scorer = inputs.scorer

            def nan_scorer(logits, ce, **targets):
                loss_sum, num_tokens = scorer(logits, ce, **targets)
                return loss_sum * float("nan"), num_tokens

            inputs.scorer = nan_scorer
        return inputs

    def spy_step(model, optimizer, micro, cfg, iteration, **k):
        current[0] = iteration
        res = real_step(model, optimizer, micro, cfg, iteration, **k)
        sums.append(sum(p.detach().double().sum().item() for p in unwrap_model(model).parameters()))
        return res

    pipeline_run.training_inputs, train.train_step = nan_inputs, spy_step
    try:
        inject = {2}  # 0-based: the third iteration
        out["nan"] = _run(UNTIED + NO_EVAL + ["--train-iters", "5"])
        out["sums"] = list(sums)
        inject = set(range(100))
        try:
            _run(UNTIED + NO_EVAL + ["--train-iters", "5", "--nan-skip-limit", "1"])
            out["limit_error"] = None
        except RuntimeError as exc:
            out["limit_error"] = str(exc)
    finally:
        pipeline_run.training_inputs = real_inputs

    # SIGTERM on rank 0 during iteration 4: every rank saves and exits after it.
    def sigterm_step(model, optimizer, micro, cfg, iteration, **k):
        if rank == 0 and iteration == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(model, optimizer, micro, cfg, iteration, **k)

    train.train_step = sigterm_step
    try:
        out["signal"] = _run(
            UNTIED
            + NO_EVAL
            + ["--exit-signal-handler", "--save", os.path.join(tmp, "sig"), "--save-interval", "100"]
        )
    finally:
        train.train_step = real_step
    return out


def _distopt_world(rank, world, tmp):
    fsdp = os.path.join(tmp, "fsdp")
    out = {
        "resume": _run(UNTIED + NO_EVAL + ["--load", fsdp, "--use-distributed-optimizer"]),
        "finetune": _run(UNTIED + NO_EVAL + ["--load", fsdp, "--finetune", "--train-iters", "4"]),
        "duration": _run(
            UNTIED
            + NO_EVAL
            + ["--exit-duration-in-mins", "0", "--save", os.path.join(tmp, "dur"), "--save-interval", "100"]
        ),
        "vanilla": _run(NO_EVAL + ["--model-running-mode", "vanilla", "--train-iters", "4"]),
    }
    # --pretrained-checkpoint: the first run starts from its weights (as --finetune), the restart resumes
    # from its own --load / --save
    sft = os.path.join(tmp, "from_pretrained")
    start = (
        UNTIED
        + NO_EVAL
        + ["--load", sft, "--save", sft, "--save-interval", "100", "--pretrained-checkpoint", fsdp]
    )
    out["pretrained"] = _run(start + ["--train-iters", "4", "--exit-interval", "2"])
    out["pretrained_restart"] = _run(start + ["--train-iters", "4"])
    try:
        _run(UNTIED + NO_EVAL + ["--load", fsdp, "--hidden-size", "64"])
        out["mismatch"] = None
    except ValueError as exc:
        out["mismatch"] = str(exc)
    return out


def test_fsdp2_resume_and_cross_wrapper_resharding(tmp_path, ddp_runs):
    tmp = str(tmp_path)
    ddp_tmp, (ddp, _) = ddp_runs
    f = run_distributed(_fsdp_world, 2, (tmp, str(ddp_tmp / "ddp_torch")))[0]
    straight = f["straight"]
    assert straight.wrapper == "TorchFullyShardedDataParallel"
    # dp-invariance across wrappers: FSDP2 and DDP runs of the same flags give the same curve
    for i in range(1, ITERS + 1):
        assert straight.losses[i] == pytest.approx(ddp["straight"].losses[i], rel=1e-5), i
        if i > HALF:
            assert f["from_ddp_torch"].losses[i] == pytest.approx(ddp["straight"].losses[i], rel=1e-5), i
    assert f["part"].iteration == HALF and f["part"].exit_reason == "exit_interval"
    # FSDP2 HALF + resume the rest == ITERS straight, to 1e-6
    for i in range(HALF + 1, ITERS + 1):
        assert f["resume"].losses[i] == pytest.approx(straight.losses[i], rel=1e-6, abs=1e-6)

    # FSDP2 dp=2 checkpoint -> DDP dp=3 and distributed optimizer dp=1
    d3 = run_distributed(_ddp3_world, 3, (tmp,))
    dist1 = run_distributed(_distopt_world, 1, (tmp,))[0]
    d1 = dist1["resume"]
    from_fsdp = d3[0]["from_fsdp"]
    rest = list(range(HALF + 1, ITERS + 1))
    assert from_fsdp.wrapper == "DistributedDataParallel" and sorted(from_fsdp.losses) == rest
    for i in rest:
        assert from_fsdp.losses[i] == pytest.approx(straight.losses[i], rel=1e-5), i
        assert d1.losses[i] == pytest.approx(straight.losses[i], rel=1e-5), i

    # NaN on one rank skipped the step everywhere: parameters after iteration 3 equal
    # those after iteration 2 on every rank, and all ranks agree on every value.
    for res in d3:
        nan = res["nan"]
        assert nan.nan_iterations == [3] and math.isnan(nan.losses[3])
        assert all(math.isfinite(nan.losses[i]) for i in (1, 2, 4, 5))
        assert res["sums"][2] == res["sums"][1] and res["sums"][3] != res["sums"][2]
        assert res["sums"] == d3[0]["sums"]
        assert "--nan-skip-limit 1" in res["limit_error"]
        sig = res["signal"]
        assert sig.exit_reason == "signal" and sig.iteration == 4
    assert (tmp_path / "sig" / "latest_checkpointed_iteration.txt").read_text() == "4"
    # --finetune starts a new run from the weights; the time limit saves and stops; AR mode
    # trains; a checkpoint of another width is refused naming the field and its flag
    assert sorted(dist1["finetune"].losses) == [1, 2, 3, 4]
    assert sorted(dist1["pretrained"].losses) == [1, 2] and sorted(dist1["pretrained_restart"].losses) == [
        3,
        4,
    ]
    assert dist1["pretrained"].losses[1] == dist1["finetune"].losses[1]  # the same weights, the same batch
    assert dist1["duration"].exit_reason == "exit_duration" and dist1["duration"].iteration == 1
    assert (tmp_path / "dur" / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert all(math.isfinite(x) for x in dist1["vanilla"].losses.values())
    assert "hidden_size=32" in dist1["mismatch"] and "(--hidden-size)" in dist1["mismatch"]
    # the run before and after the NaN matches the uninterrupted DDP losses
    assert d3[0]["nan"].losses[1] == pytest.approx(straight.losses[1], rel=1e-5)


def test_reference_commands_behave_as_documented(tmp_path, capsys):
    """The seed's DDP + TP=2 command launched on one process stops with the layout error
    naming the flags (exit status 2, before any process group exists)."""
    from megadlms.pretrain import main
    from tests.config.test_arguments import seed_ddp_tp2

    assert main(seed_ddp_tp2()) == 2
    err = capsys.readouterr().err
    assert "world size 1 is not divisible by --tensor-model-parallel-size 2" in err
