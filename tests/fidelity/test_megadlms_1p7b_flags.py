"""MegaDLMs' examples/dlm_training/dlm_pretrain_1.7b.sh flag arrays, as written there with
the sizes shrunk (model, batch, iterations, intervals, vocabulary), on 2 gloo ranks: its
training mode for 4 iterations, then its convert_ckpt mode (the script's own edit of the
flag arrays plus its CONVERT_CKPT_ARGS) with and without --ckpt-step. Data: a corpus
tokenized by megadlms-preprocess with a tokenizer.json written here by the `tokenizers`
library (no downloads). Checks the objective settings the run ends up with, the persistent
and non-persistent checkpoints it leaves, and that the conversion writes the requested step."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.dist_utils import run_distributed

tokenizers = pytest.importorskip("tokenizers")

WORDS = "the a cat dog sat on mat ran far and then slept under tree sun rose over hill".split()
SPECIALS = ["<|endoftext|>", "<|mask|>", "<|pad|>"]


def _tokenizer_json(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    tok.save(path)
    return vocab


def _corpus(tmp, tokenizer, name, n, seed):
    import random

    from megadlms.data.preprocess import main

    rng = random.Random(seed)
    src = os.path.join(tmp, f"{name}.jsonl")
    with open(src, "w") as f:
        for _ in range(n):
            f.write(
                json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))}) + "\n"
            )
    prefix = os.path.join(tmp, name)
    argv = ["--input", src, "--output-prefix", prefix, "--append-eod", "--tokenizer-type"]
    assert main(argv + ["HuggingFaceTokenizer", "--tokenizer-model", tokenizer]) == 0
    return prefix + "_text_document"


def _argv(tmp, tokenizer, train, valid, mask_id):
    ckpt, logs = os.path.join(tmp, "ckpt"), os.path.join(tmp, "logs")
    gpt_model_args = [
        "--seq-length",
        "32",
        "--attention-backend",
        "flash",
        "--attention-softmax-in-fp32",
        "--attention-dropout",
        "0.0",
        "--hidden-dropout",
        "0.0",
        "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion",
        "--no-bias-swiglu-fusion",
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--ffn-hidden-size",
        "64",
        "--swiglu",
        "--vocab-size",
        "64",
        "--normalization",
        "RMSNorm",
        "--max-position-embeddings",
        "32",
        "--norm-epsilon",
        "1e-6",
        "--rotary-base",
        "10000",
        "--disable-bias-linear",
        "--position-embedding-type",
        "rope",
        "--qk-layernorm",
        "--untie-embeddings-and-output-weights",
    ]
    plmt_args = [
        "--model-running-mode",
        "difflm-noshift",
        "--base-model",
        "vanilla",
        "--mask-token",
        str(mask_id),
        "--attention-mask-type",
        "no_mask",
    ]
    training_args = [
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--train-iters",
        "4",
        "--weight-decay",
        "0.1",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--init-method-std",
        "0.02",
        "--clip-grad",
        "1.0",
        "--bf16",
        "--lr",
        "0.0002",
        "--min-lr",
        "0.00002",
        "--lr-decay-style",
        "WSD",
        "--lr-warmup-iters",
        "1",
        "--lr-decay-iters",
        "4",
        "--lr-wsd-decay-style",
        "exponential",
        "--lr-wsd-decay-iters",
        "1",
        "--use-distributed-optimizer",
        "--num-distributed-optimizer-instances",
        "1",
        "--rerun-mode",
        "validate_results",
        "--overlap-param-gather",
        "--overlap-grad-reduce",
        "--distributed-timeout-minutes",
        "60",
    ]
    model_parallel_args = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
    data_args = [
        "--train-data-path",
        train,
        "--valid-data-path",
        valid,
        "--data-cache-path",
        os.path.join(tmp, "cache"),
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        tokenizer,
    ]
    eval_and_logging_args = [
        "--log-interval", "1", "--log-params-norm", "--log-num-zeros-in-grad", "--log-throughput",
        "--log-progress", "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
        "--log-memory-to-tensorboard", "--save-interval", "2", "--non-persistent-save-interval", "3",
        "--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir",
        os.path.join(ckpt, "non_persistent"), "--ckpt-format", "torch_dist", "--auto-detect-ckpt-format",
        "--ckpt-fully-parallel-load", "--eval-interval", "2", "--save", ckpt, "--load", ckpt,
        "--eval-iters", "1", "--wandb-project", "dlm",
        "--wandb-exp-name", "run", "--wandb-run-id", "run", "--wandb-save-dir", os.path.join(logs, "wandb"),
        "--wandb-mode", "offline", "--wandb-tags", "dlm", "--wandb-notes", "training", "--wandb-resume",
        "allow",
    ]  # fmt: skip
    # (the script's --tensorboard-dir is left out: it needs the tensorboard package, not installed here)
    # the script's order: GPT_MODEL, TRAINING, MODEL_PARALLEL, DATA, EVAL_AND_LOGGING, PLMT
    return (
        gpt_model_args + training_args + model_parallel_args + data_args + eval_and_logging_args + plmt_args
    )


def _convert_argv(argv, tmp, step):
    """The script's convert_ckpt mode: drop the non-persistent dir and type (and --log-progress,
    --async-save) from its arrays, then append its CONVERT_CKPT_ARGS for ``step``."""
    out, skip = [], False
    for a in argv:
        if skip or a in ("--non-persistent-global-ckpt-dir", "--log-progress", "--async-save"):
            skip = False
            continue
        if a == "--non-persistent-ckpt-type":
            skip = True  # and its value
            continue
        if a != os.path.join(tmp, "ckpt", "non_persistent"):
            out.append(a)
    root = os.path.join(tmp, "converted", f"ckptstep_{step}")
    convert = [
        "--no-load-optim",
        "--no-save-optim",
        "--no-save-rng",
        "--no-load-rng",
        "--ckpt-convert-format",
    ]
    convert += ["torch", "--ckpt-convert-save", root, "--tensorboard-dir", os.path.join(tmp, "convert_tb")]
    return out + convert + (["--ckpt-step", str(step)] if step is not None else [])


def _world(rank, world, argv, tmp):
    from megadlms.config import parse_config
    from megadlms.pretrain import run

    cfg = parse_config(argv, world_size=world).with_tokenizer(
        parse_config(argv, world_size=world).data.tokenizer.build()
    )
    res = run(argv + ["--num-workers", "0"])
    # convert_ckpt mode, once with the script's --ckpt-step and once without it (Megatron: the latest)
    converted = [run(_convert_argv(argv, tmp, step) + ["--num-workers", "0"]) for step in (2, None)]
    return cfg, res, converted


def _model_tensors(path):
    from megadlms.checkpoint import open_checkpoint, read_tensors, tensor_shapes

    ckpt, common = open_checkpoint(path)
    shapes = tensor_shapes(ckpt, common)
    out = {k: torch.empty(s, dtype=d) for k, (s, d) in shapes.items() if k.startswith("model/")}
    read_tensors(ckpt, common, out)
    return common, out


def test_megadlms_1p7b_flag_set_trains_megadlms_objective(tmp_path):
    tmp = str(tmp_path)
    tokenizer = os.path.join(tmp, "tokenizer.json")
    vocab = _tokenizer_json(tokenizer)
    train = _corpus(tmp, tokenizer, "train", 200, 1)
    valid = _corpus(tmp, tokenizer, "valid", 40, 2)
    argv = _argv(tmp, tokenizer, train, valid, vocab["<|mask|>"])
    (cfg, res, converted), _ = run_distributed(_world, 2, (argv, tmp), timeout=600)
    d = cfg.diffusion
    assert (d.model_running_mode, d.objective, d.mask_eps, d.p_mask) == (
        "difflm-noshift", "megadlms", 0.0, "realised",
    )  # fmt: skip
    assert d.varilen_prob == 0.01 and d.eval_mc_samples == 1 and d.mask_token_id == vocab["<|mask|>"]
    assert cfg.model.attention == "bidirectional" and cfg.model.vocab_size == 128  # 64 padded to 128
    assert cfg.data.tokenizer.tokenizer_type == "HuggingFaceTokenizer"
    assert cfg.training.num_micro_batches == 2 and cfg.optimizer.use_distributed_optimizer
    assert res.iteration == 4 and res.exit_reason == "done" and sorted(res.losses) == [1, 2, 3, 4]
    assert all(v == v for v in res.losses.values())  # finite
    assert res.last_checkpoint.endswith("iter_0000004") and {2, 4} <= set(res.evals)
    assert set(res.final_evals) == {"validation"}  # the script has no test data
    # Persistent saves at 2 and 4 (latest 4, what the script compares with TRAIN_ITERS); the
    # non-persistent one at 3 in --non-persistent-global-ckpt-dir, alone there.
    ckpt = os.path.join(tmp, "ckpt")
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("iter_")) == ["iter_0000002", "iter_0000004"]
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "4"
    assert sorted(os.listdir(os.path.join(ckpt, "non_persistent"))) == [
        "iter_0000003", "latest_checkpointed_iteration.txt",
    ]  # fmt: skip
    # convert_ckpt: --ckpt-step 2 converts iteration 2 (not the latest 4) to <save>/torch, the
    # directory the script then hands to its HF conversion; without --ckpt-step the latest.
    by_step = {}
    for step, path in zip((2, 4), converted):
        out = os.path.join(tmp, "converted", f"ckptstep_{step if step == 2 else None}", "torch")
        assert path == os.path.join(out, f"iter_{step:07d}")
        assert open(os.path.join(out, "latest_checkpointed_iteration.txt")).read() == str(step)
        common, by_step[step] = _model_tensors(path)
        assert common["ckpt_format"] == "torch" and common["optimizer"] is None  # --no-save-optim
        _, trained = _model_tensors(os.path.join(ckpt, f"iter_{step:07d}"))
        assert by_step[step].keys() == trained.keys()
        assert all(torch.equal(by_step[step][k], trained[k]) for k in trained)
    assert any(not torch.equal(by_step[2][k], by_step[4][k]) for k in by_step[2])  # the steps differ
