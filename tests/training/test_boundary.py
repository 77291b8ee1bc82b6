"""The trainer's seams: a failure on one rank stops every rank, gradients are zeroed once per
step, the model's mode is checked once, and checkpoints carry their own model and tokenizer
records (loading never reads flag names)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.dist_utils import run_distributed

TINY = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 8 --train-iters 4 --lr 1e-3 --mock-data --num-workers 0 --log-interval 1 "
    "--eval-interval 100 --eval-iters 1 --untie-embeddings-and-output-weights"
).split()


def _failure_world(rank, world):
    from megadlms.diffusion.objective import ObjectiveBatch
    from megadlms.pretrain import run

    real, calls = ObjectiveBatch.forward, [0]

    def failing(*a, **k):  # the schedule's forward of one micro-batch (2 per step here)
        calls[0] += 1
        if rank == world - 1 and calls[0] == 5:  # step 3's first micro-batch
            raise KeyError("injected data error on the last rank")
        return real(*a, **k)

    ObjectiveBatch.forward = failing
    try:
        run(TINY + ["--overlap-grad-reduce", "--ddp-bucket-size", "500", "--global-batch-size", "12"])
    except (RuntimeError, KeyError) as exc:
        return type(exc).__name__, str(exc)
    finally:
        ObjectiveBatch.forward = real
    return None


def test_failure_inside_a_step_on_one_rank_stops_every_rank():
    results = run_distributed(_failure_world, 3, timeout=240)
    *others, last = results
    assert last is not None and last[0] == "KeyError" and "injected" in last[1]
    for res in others:  # the healthy ranks are not left waiting in a collective
        assert res is not None and res[0] == "RuntimeError", res
        assert "other rank(s) failed inside the step" in res[1] and "iteration 3" in res[1], res


def _data_failure_world(rank, world):
    """One rank's data loading fails at its third step: every rank stops (no collective left
    waiting until the timeout)."""
    from megadlms.pretrain import run
    from megadlms.training import train

    real, calls = train._to_device, [0]

    def failing(batch, device):
        calls[0] += 1
        if rank == 0 and calls[0] == 5:  # 2 micro-batches per step: the first of step 3
            raise OSError("injected: a data shard became unreadable on rank 0")
        return real(batch, device)

    train._to_device = failing
    try:
        run(TINY + ["--global-batch-size", "12", "--overlap-grad-reduce", "--ddp-bucket-size", "500"])
    except (RuntimeError, OSError) as exc:
        return type(exc).__name__, str(exc)
    finally:
        train._to_device = real
    return None


def test_data_loading_failure_on_one_rank_stops_every_rank():
    first, *others = run_distributed(_data_failure_world, 3, timeout=240)
    assert first is not None and first[0] == "OSError" and "injected" in first[1], first
    for res in others:
        assert res is not None and res[0] == "RuntimeError", res
        assert "other rank(s) failed inside the step" in res[1] and "iteration 3" in res[1], res


def _spy_world(rank, world, tmp):
    from megadlms.diffusion import loss as loss_mod
    from megadlms.distributed import DistributedDataParallel
    from megadlms.pretrain import run

    counts = {"zero": 0, "check": 0}
    real_zero, real_check = DistributedDataParallel.zero_grad_buffer, loss_mod.check_model_for_mode

    def zero(self):
        counts["zero"] += 1
        return real_zero(self)

    def check(*a, **k):
        counts["check"] += 1
        return real_check(*a, **k)

    DistributedDataParallel.zero_grad_buffer = zero
    loss_mod.check_model_for_mode = check
    try:
        res = run(TINY + ["--save", tmp, "--save-interval", "4", "--global-batch-size", "16"])
    finally:
        DistributedDataParallel.zero_grad_buffer = real_zero
        loss_mod.check_model_for_mode = real_check
    return counts, res.iteration


def test_gradients_zeroed_once_per_step_and_checkpoint_records(tmp_path):
    results = run_distributed(_spy_world, 2, (str(tmp_path),), timeout=240)
    for counts, iters in results:
        # 4 steps x 2 micro-batches: one zeroing per step, no per-micro-batch mode check
        assert iters == 4 and counts["zero"] == 4, counts
        assert counts["check"] == 0, counts  # the trainer checks before wrapping, not per step
    common = json.loads((tmp_path / "iter_0000004" / "common.json").read_text())
    from megadlms.checkpoint import FORMAT_VERSION

    assert common["format_version"] == FORMAT_VERSION >= 2  # 2: records of its own (tokenizer)
    assert common["tokenizer"] == {
        "tokenizer_type": "ByteTokenizer",
        "tokenizer_model": None,
        "mask_token": None,
        "vocab_size": None,
    }
    assert common["model_config"]["attention"] == "bidirectional"
    assert common["model_config"]["vocab_size"] == 384  # 259 ids padded to 128
    assert common["model_config"]["unpadded_vocab_size"] == 259  # the real ones travel with the model
    # Loading needs no flag names: drop the run record and generate from the checkpoint alone.
    common["args"] = {}
    (tmp_path / "iter_0000004" / "common.json").write_text(json.dumps(common))
    from megadlms.generate import generate_text, load_for_inference

    model, tok, loaded = load_for_inference(str(tmp_path), torch.device("cpu"))
    assert model.config.attention == "bidirectional" and tok.vocab_size == 259
    assert len(generate_text(model, tok, loaded, "ab", gen_length=4, steps=2)) == 1


def test_config_tree_owns_derived_defaults_and_reports_fields():
    from megadlms.common.errors import ConfigError
    from megadlms.config import LRScheduleConfig, ParallelConfig, TrainingConfig

    par = ParallelConfig(world_size=6, tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    assert par.data_parallel_size == 3
    t = TrainingConfig(micro_batch_size=2, train_iters=5, data_parallel_size=3)
    assert (t.global_batch_size, t.num_micro_batches) == (6, 1)
    assert LRScheduleConfig(train_iters=50, lr_warmup_fraction=0.1).lr_warmup_iters == 5
    with pytest.raises(ConfigError) as exc:
        TrainingConfig(micro_batch_size=0, train_iters=None, nan_skip_limit=-1)
    assert exc.value.problems == [
        "micro_batch_size must be a positive integer, got 0",
        "train_iters is required",
        "nan_skip_limit must be >= 0, got -1",
    ]


@pytest.mark.parametrize("env", [{}, {"RANK": "0"}])
def test_cli_reports_every_problem_once(env, capsys, monkeypatch):
    from megadlms.pretrain import main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc = main(TINY + ["--hidden-dropout", "1.5", "--lr", "-1", "--global-batch-size", "7"])
    err = capsys.readouterr().err
    assert rc == 2 and "3 problems" in err, err
    for needle in ("--hidden-dropout must be in [0, 1)", "--lr must be >= 0", "--global-batch-size 7"):
        assert err.count(needle) == 1, (needle, err)
    assert os.environ.get("WORLD_SIZE") in (None, "1")


def _modes_world(rank, world):
    from megadlms.pretrain import run

    argv = TINY + ["--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "3"]
    summed = run(argv)  # the trainer's sum mode: loss / N, SUM over ranks
    averaged = run(argv + ["--ddp-average-in-collective"])  # loss x dp / N, AVG over ranks
    fsdp = run(argv + ["--use-torch-fsdp2"])  # FSDP2 in sum mode
    return (
        [summed.losses[i] for i in (1, 2, 3, 4)],
        [averaged.losses[i] for i in (1, 2, 3, 4)],
        [fsdp.losses[i] for i in (1, 2, 3, 4)],
    )


def test_sum_and_average_modes_train_the_same_curve():
    for summed, averaged, fsdp in run_distributed(_modes_world, 2, timeout=300):
        for a, b, c in zip(summed, averaged, fsdp):
            assert abs(a - b) <= 1e-6 * abs(a) and abs(a - c) <= 1e-5 * abs(a), (summed, averaged, fsdp)
