"""Megatron's reporting formats, read back the way Megatron's tools read them: the progress and
validation lines through a Megatron log-parser regex, TensorBoard tags through tensorboard's
event reader, the W&B offline run's records through its protobuf, progress.txt by its fields;
--log-num-zeros-in-grad against a direct count of the gradients. One 2-rank world (tp2 + SP,
a DLM run with every switch on, then a short AR run) serves all the run-level assertions."""

from __future__ import annotations

import glob
import importlib.util
import logging
import math
import os
import re

import pytest

from tests.dist_utils import run_distributed

# What a Megatron log parser matches (training.py training_log's fields, in its order); the
# bracketed groups are the fields Megatron prints only when they are on / exist.
MEGATRON_LINE = re.compile(
    r"^ \[(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\]"
    r" iteration\s+(?P<iteration>\d+)/\s*(?P<train_iters>\d+) \|"
    r" consumed samples:\s+(?P<consumed>\d+) \|"
    r" elapsed time per iteration \(ms\): (?P<ms>[\d.]+) \|"
    r"(?: throughput per GPU \(TFLOP/s/GPU\): (?P<tflops>[\d.]+) \|)?"
    r" learning rate: (?P<lr>[-+.\dE]+) \|"
    r" global batch size:\s+(?P<gbs>\d+) \|"
    r"(?: lm loss: (?P<loss>[-+.\dE]+) \|)?"
    r"(?: real input length: (?P<input_len>[-+.\dE]+) \|)?"  # MegaDLMs' difflm-noshift key
    r" loss scale: (?P<scale>[\d.]+) \|"
    r"(?: grad norm: (?P<gnorm>[\d.]+) \|)?"
    r"(?: num zeros: (?P<zeros>[\d.]+) \|)?"
    r"(?: params norm: (?P<pnorm>[\d.]+) \|)?"
    r" number of skipped iterations:\s+(?P<skipped>\d+) \|"
    r" number of nan iterations:\s+(?P<nan>\d+) \|"
)
# evaluate_and_print_results: ' validation loss at {prefix} | {key} value: {:.6E} | {key} PPL: {:.6E} | '
MEGATRON_VALID = re.compile(
    r"^ validation loss at (?P<prefix>.+?) \| lm loss value: (?P<loss>[-+.\dE]+) \| "
    r"lm loss PPL: (?P<ppl>[-+.\dE]+) \| "
)

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 8 --train-iters 4 --lr 2e-3 --seed 7 --mock-data --num-workers 0 "
    "--tokenizer-type ByteTokenizer --log-interval 2 --eval-interval 2 --eval-iters 1 "
    "--tensor-model-parallel-size 2 --sequence-parallel --untie-embeddings-and-output-weights"
).split()
SWITCHES = (
    "--log-num-zeros-in-grad --log-params-norm --log-throughput --log-timers-to-tensorboard "
    "--timing-log-level 1 --log-validation-ppl-to-tensorboard --log-memory-to-tensorboard "
    "--log-progress --save-interval 2 --rerun-mode validate_results --tp-comm-overlap "
    "--wandb-project dlm --wandb-exp-name t --wandb-mode offline"
).split()


def _progress_dict(**kw):
    m = dict(
        iteration=40, consumed_samples=640, ms_per_iter=182.04, throughput=None, lr=2e-4,
        global_batch_size=16, lm_loss=4.8123, loss_scale=1.0, grad_norm=1.3102, num_zeros=None,
        params_norm=None, skipped_iters=0, nan_iters=0, tokens_per_sec=11200.0,
        tflops_per_device=0.05, mem_gb=0.9, eta_sec=29.0,
    )  # fmt: skip
    return {**m, **kw}


def test_progress_line_fields_and_order():
    from megadlms.training.logging_utils import progress_line

    line = progress_line(_progress_dict(), 200, layout="tp2 x dp2, 1.2M params/rank")
    g = MEGATRON_LINE.match(line)
    assert g, line
    assert (g["iteration"], g["train_iters"], g["consumed"], g["gbs"]) == ("40", "200", "640", "16")
    assert (g["ms"], g["lr"], g["loss"], g["scale"], g["gnorm"]) == (
        "182.0",
        "2.000000E-04",
        "4.812300E+00",
        "1.0",
        "1.310",
    )
    assert g["tflops"] is None and g["zeros"] is None and g["pnorm"] is None
    assert line.endswith("| tp2 x dp2, 1.2M params/rank") and "tokens/s: 11.2k" in line
    # the optional fields at Megatron's places; an interval without a finite loss has no lm loss
    line = progress_line(
        _progress_dict(
            throughput=0.25, num_zeros=17, params_norm=12.5, lm_loss=None, skipped_iters=2, nan_iters=1
        ),
        200,
    )
    g = MEGATRON_LINE.match(line)
    assert g and (g["tflops"], g["zeros"], g["pnorm"], g["skipped"], g["nan"]) == (
        "0.2",
        "17.0",
        "12.500",
        "2",
        "1",
    )
    assert g["loss"] is None and "lm loss" not in line


def test_validation_line_dlm_and_ar():
    from megadlms.training.logging_utils import validation_line
    from megadlms.training.validation import Evaluation

    res = Evaluation(nelbo=25.0, ppl_bound=math.exp(25.0), num_tokens=248.0)
    dlm = validation_line("iteration 4", res, diffusion=True)
    ar = validation_line("iteration 4 on test set", res, diffusion=False)
    for line, prefix in ((dlm, "iteration 4"), (ar, "iteration 4 on test set")):
        g = MEGATRON_VALID.match(line)
        assert g and g["prefix"] == prefix and float(g["loss"]) == 25.0
        assert float(g["ppl"]) == pytest.approx(math.exp(20.0), rel=1e-6)  # Megatron's clamp
    assert "NELBO PPL bound: 7.200490E+10" in dlm and "NELBO" not in ar and "bound" not in ar


def _parse_problems(argv):
    from megadlms.config import parse_config

    with pytest.raises(ValueError) as err:
        parse_config(TINY + argv, world_size=2)
    return [line[4:] for line in str(err.value).splitlines() if line.startswith("  - ")]


def test_wandb_and_tp_comm_overlap_rules(monkeypatch):
    from megadlms.config import parse_config

    cfg = parse_config(TINY + ["--tp-comm-overlap", "--rerun-mode", "report_stats"], world_size=2)
    notes = [n for n in cfg.logging.notes if n.startswith(("--tp-comm-overlap", "--rerun-mode"))]
    assert len(notes) == 1 and "not overlapped with the GEMMs" in notes[0]
    assert cfg.resilience.rerun_mode == "report_stats"  # it acts (training/rerun.py): no note
    no_sp = [a for a in TINY if a != "--sequence-parallel"]
    with pytest.raises(ValueError) as err:
        parse_config(no_sp + ["--tp-comm-overlap"], world_size=2)
    assert "--tp-comm-overlap needs --sequence-parallel" in str(err.value)
    assert _parse_problems(["--wandb-project", "dlm"]) == [
        "--wandb-project dlm needs --wandb-exp-name NAME (the W&B run name)",
        "--wandb-project dlm needs --wandb-save-dir DIR (or --save DIR: W&B then writes to DIR/wandb)",
    ]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    assert _parse_problems(
        ["--wandb-project", "dlm", "--wandb-exp-name", "r", "--wandb-save-dir", "/tmp/x"]
    ) == [
        "--wandb-project dlm needs the wandb package: pip install 'megadlms[wandb]' (or drop --wandb-project)"
    ]


def _megadlms_input_length(step, num_micro, seq, prob):
    """MegaDLMs' real input length of one step (0-based), restated from its gpt_model.py:
    numpy seeded step * num_micro + micro draws u, then L in [2, seq]; crop to L iff u < prob;
    then one position is dropped; the mean over the micro-batches."""
    import numpy as np

    lengths = []
    for micro in range(num_micro):
        rng = np.random.RandomState(step * num_micro + micro)
        u, L = rng.uniform(0, 1), int(rng.randint(low=2, high=seq + 1))
        lengths.append((L if u < prob else seq) - 1)
    return sum(lengths) / num_micro


def _direct_zero_count(trainer):
    """Zeros of the full gradient: TP shards summed over the ranks, replicated tensors once
    (and checked equal on both ranks), from the parameters' own gradients."""
    import torch
    import torch.distributed as dist

    from megadlms.distributed import unwrap_model
    from megadlms.parallel.sharding import shard_spec

    counts = torch.zeros(2, dtype=torch.float64)
    for p in unwrap_model(trainer.model).parameters():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        counts[0 if shard_spec(p) is not None else 1] += float((g == 0).sum())
    gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, counts)
    assert gathered[0][1] == gathered[1][1]  # the replicated gradients agree
    return int(gathered[0][0] + gathered[1][0] + gathered[0][1])


def _world(rank, world, tmp):
    from megadlms.config import parse_config
    from megadlms.training.logging_utils import setup_logging
    from megadlms.training.train import Trainer

    lines = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    setup_logging(rank)
    logging.getLogger("megadlms").addHandler(handler)
    try:
        argv = TINY + SWITCHES + ["--tensorboard-dir", f"{tmp}/tb", "--save", f"{tmp}/ck"]
        argv += ["--metrics-jsonl", f"{tmp}/m.jsonl"]
        trainer = Trainer(parse_config(argv, world_size=world))
        res = trainer.train()
        direct = _direct_zero_count(trainer)
        ar_lines = len(lines)
        ar = Trainer(
            parse_config(
                TINY[:-4] + ["--model-running-mode", "vanilla", "--train-iters", "2"], world_size=world
            )
        )
        ar.train()
        # a W&B dir that cannot be made: the last rank's writer fails, every rank stops at once
        open(f"{tmp}/file", "w").close()
        try:
            Trainer(
                parse_config(
                    TINY
                    + ["--wandb-project", "p", "--wandb-exp-name", "t", "--wandb-save-dir", f"{tmp}/file"],
                    world_size=world,
                )
            )
            failed = None
        except Exception as exc:  # noqa: BLE001 - the test compares the ranks' errors
            failed = f"{type(exc).__name__}: {exc}"
    finally:
        logging.getLogger("megadlms").removeHandler(handler)
    return res, direct, lines[:ar_lines], lines[ar_lines:], failed


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    tmp = str(tmp_path_factory.mktemp("megatron_logging"))
    (res, direct, lines, ar_lines, failed0), last = run_distributed(_world, 2, (tmp,), timeout=300)
    # no rank is left waiting: the last rank has its own error, rank 0 the one-vote's
    assert (
        failed0 == "RuntimeError: the last rank could not open the TensorBoard / W&B writer (see its error)"
    )
    assert last[-1] is not None and "file" in last[-1]
    return tmp, res, direct, lines, ar_lines


def test_progress_and_validation_lines_parse(logged):
    import json

    tmp, res, direct, lines, ar_lines = logged
    train = [MEGATRON_LINE.match(x) for x in lines if MEGATRON_LINE.match(x)]
    assert [int(g["iteration"]) for g in train] == [2, 4] and all(g["train_iters"] == "4" for g in train)
    assert [int(g["consumed"]) for g in train] == [16, 32] and all(g["gbs"] == "8" for g in train)
    assert float(train[1]["loss"]) == pytest.approx((res.losses[3] + res.losses[4]) / 2, rel=1e-6)
    assert float(train[1]["gnorm"]) == pytest.approx(res.grad_norms[4], abs=1e-3)
    assert train[0]["tflops"] is not None and train[0]["pnorm"] is not None
    assert (train[1]["skipped"], train[1]["nan"]) == ("0", "0")
    from megadlms.config import parse_config

    prob = parse_config(TINY, world_size=2).diffusion.varilen_prob
    expect = [_megadlms_input_length(s, 4, 32, prob) for s in range(4)]
    assert float(train[1]["input_len"]) == pytest.approx((expect[2] + expect[3]) / 2, rel=1e-6)
    # --log-num-zeros-in-grad: the last step's count is the gradients' own (each element once)
    assert float(train[1]["zeros"]) == direct > 0
    records = [json.loads(x) for x in open(f"{tmp}/m.jsonl")]
    assert [r["num_zeros"] for r in records if r["event"] == "train"][-1] == direct
    valid = [MEGATRON_VALID.match(x) for x in lines if MEGATRON_VALID.match(x)]
    assert [g["prefix"] for g in valid] == [
        "iteration 2", "iteration 4", "iteration 4 on validation set", "iteration 4 on test set",
    ]  # fmt: skip
    assert float(valid[1]["loss"]) == pytest.approx(res.evals[4], rel=1e-6)
    assert sum(x.startswith("note: --tp-comm-overlap") for x in lines) == 1
    # --rerun-mode validate_results acts: no note, and nothing rejected in a healthy run
    assert not any(x.startswith("note: --rerun-mode") or "re-running the step" in x for x in lines)
    ar_valid = [x for x in ar_lines if MEGATRON_VALID.match(x)]
    assert ar_valid and not any("NELBO" in x for x in ar_lines)
    assert any(MEGATRON_LINE.match(x) and " lm loss: " in x for x in ar_lines)
    assert not any("real input length" in x for x in ar_lines)  # a DLM-only key, as in MegaDLMs


def test_tensorboard_tags_are_megatrons(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, res, direct, _, _ = logged
    acc = EventAccumulator(f"{tmp}/tb", size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    megatron = {
        "learning-rate",
        "batch-size",
        "lm loss",
        "real input length",  # MegaDLMs' second loss key in difflm-noshift
        "loss-scale",
        "grad-norm",
        "num-zeros",
        "params-norm",
    }
    assert megatron | {f"{t} vs samples" for t in megatron} <= tags
    assert {
        "iteration-time",
        "throughput",
        "forward-backward-time",
        "optimizer-time",
        "mem-max-rss-bytes",
    } <= tags
    assert {"lm loss validation", "lm loss validation vs samples", "lm loss validation ppl"} <= tags
    assert {"lm loss validation ppl vs samples", "lm loss test"} <= tags

    def series(tag):
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    # --tensorboard-log-interval 1: every step's own loss, at the step and at the consumed samples
    assert series("lm loss") == [(i, pytest.approx(res.losses[i], rel=1e-6)) for i in (1, 2, 3, 4)]
    assert [s for s, _ in series("lm loss vs samples")] == [8, 16, 24, 32]
    assert series("num-zeros")[-1] == (4, direct) and [s for s, _ in series("iteration-time")] == [2, 4]
    valid = [(s, v) for s, v in series("lm loss validation") if s == 2]
    assert valid == [(2, pytest.approx(res.evals[2], rel=1e-6))]
    ppl = dict(series("lm loss validation ppl"))
    assert ppl[2] == pytest.approx(math.exp(res.evals[2]), rel=1e-5)


def _wandb_records(path):
    """The records of a .wandb file: W&B's 7-byte header, then LevelDB log-format chunks
    (crc32, length, type; 32 KiB blocks) carrying ``wandb_internal_pb2.Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf = open(path, "rb").read(), 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec
            buf = b""


def test_wandb_offline_run_has_the_tensorboard_keys(logged):
    import json

    tmp, res, direct, _, _ = logged
    (path,) = glob.glob(f"{tmp}/ck/wandb/wandb/offline-run-*/run-*.wandb")  # default dir: <--save>/wandb
    history = {}
    for rec in _wandb_records(path):
        if rec.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            history.setdefault(rec.history.step.num, {}).update(items)
    assert sorted(history) == [1, 2, 3, 4]
    for k in (
        "learning-rate",
        "batch-size",
        "lm loss",
        "loss-scale",
        "grad-norm",
        "num-zeros",
        "samples vs steps",
    ):
        assert k in history[1], k
    assert (
        history[4]["lm loss"] == pytest.approx(res.losses[4], rel=1e-9) and history[4]["num-zeros"] == direct
    )
    assert history[2]["lm loss validation"] == pytest.approx(res.evals[2], rel=1e-9)
    assert {"iteration-time", "lm loss validation ppl", "lm loss test"} <= set(history[4])
    assert not any(k.endswith(" vs samples") for h in history.values() for k in h)


def test_progress_txt_is_megatrons(logged):
    tmp = logged[0]
    rows = [line.rstrip("\n").split("\t") for line in open(os.path.join(tmp, "ck", "progress.txt"))]
    assert [r[3] for r in rows] == ["Starting job", "Saved checkpoint", "Saved checkpoint"]
    assert all(r[1].startswith("Job ID:") and r[2] == "# GPUs: 2" for r in rows)
    assert [r[4] for r in rows[1:]] == ["Iteration: 2", "Iteration: 4"]
    flops = [float(r[7].split(": ")[1]) for r in rows[1:]]
    assert flops[1] == pytest.approx(2 * flops[0], rel=0.2) and rows[2][8].startswith(
        "Tokens (in billions): "
    )


def test_logged_flops_are_the_planners(logged):
    """The planner's FLOPs (``megadlms-plan``'s step FLOPs) reproduce the trainer's logged figure:
    each logged window's FLOPs, read back from metrics.jsonl as TFLOP/s/GPU x GPUs x seconds per
    iteration x iterations (the clock cancels), equal the planner's count of its steps, each at
    the step's length (MegaDLMs' variable-length crop of micro-batch 0, when it draws one)."""
    import dataclasses
    import json

    from megadlms.config import parse_config
    from megadlms.diffusion import micro_batch_crop
    from megadlms.planning.plan import with_vocabulary
    from megadlms.planning.throughput import step_flops

    tmp = logged[0]
    config = with_vocabulary(parse_config(TINY, world_size=2))  # the run's model and batch
    seq, micro = config.model.seq_length, config.training.num_micro_batches

    def planned(step):  # 0-based step
        crop = micro_batch_crop(config.diffusion, step, 0, micro, seq)
        return step_flops(
            dataclasses.replace(config, model=dataclasses.replace(config.model, seq_length=crop or seq))
        )

    records = [r for r in map(json.loads, open(f"{tmp}/m.jsonl")) if r["event"] == "train"]
    assert [r["iteration"] for r in records] == [2, 4]
    for r in records:
        logged_flops = r["tflops_per_device"] * 2 * 1e12 * r["ms_per_iter"] / 1e3 * 2  # 2 GPUs, 2 iterations
        want = planned(r["iteration"] - 2) + planned(r["iteration"] - 1)
        assert logged_flops == pytest.approx(want, rel=1e-9), (r["iteration"], logged_flops, want)
