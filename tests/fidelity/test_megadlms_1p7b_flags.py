"""MegaDLMs' examples/dlm_training/dlm_pretrain_1.7b.sh flag arrays, as written there with
the sizes shrunk (model, batch, iterations, vocabulary), on 2 gloo ranks for 3 iterations.
Data: a corpus tokenized by megadlms-preprocess with a tokenizer.json written here by the
`tokenizers` library (no downloads). Checks the objective settings the run ends up with."""

from __future__ import annotations

import json
import os

import pytest

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
        "3",
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
        "3",
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
        "--log-memory-to-tensorboard", "--save-interval", "3", "--non-persistent-save-interval", "6",
        "--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir",
        os.path.join(ckpt, "non_persistent"), "--ckpt-format", "torch_dist", "--auto-detect-ckpt-format",
        "--ckpt-fully-parallel-load", "--eval-interval", "3", "--save", ckpt, "--load", ckpt,
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


def _world(rank, world, argv):
    from megadlms.config import parse_config
    from megadlms.pretrain import run

    cfg = parse_config(argv, world_size=world).with_tokenizer(
        parse_config(argv, world_size=world).data.tokenizer.build()
    )
    res = run(argv + ["--num-workers", "0"])
    return cfg, res


def test_megadlms_1p7b_flag_set_trains_megadlms_objective(tmp_path):
    tmp = str(tmp_path)
    tokenizer = os.path.join(tmp, "tokenizer.json")
    vocab = _tokenizer_json(tokenizer)
    train = _corpus(tmp, tokenizer, "train", 200, 1)
    valid = _corpus(tmp, tokenizer, "valid", 40, 2)
    argv = _argv(tmp, tokenizer, train, valid, vocab["<|mask|>"])
    (cfg, res), _ = run_distributed(_world, 2, (argv,), timeout=600)
    d = cfg.diffusion
    assert (d.model_running_mode, d.objective, d.mask_eps, d.p_mask) == (
        "difflm-noshift", "megadlms", 0.0, "realised",
    )  # fmt: skip
    assert d.varilen_prob == 0.01 and d.eval_mc_samples == 1 and d.mask_token_id == vocab["<|mask|>"]
    assert cfg.model.attention == "bidirectional" and cfg.model.vocab_size == 128  # 64 padded to 128
    assert cfg.data.tokenizer.tokenizer_type == "HuggingFaceTokenizer"
    assert cfg.training.num_micro_batches == 2 and cfg.optimizer.use_distributed_optimizer
    assert res.iteration == 3 and res.exit_reason == "done" and sorted(res.losses) == [1, 2, 3]
    assert all(v == v for v in res.losses.values())  # finite
    assert res.last_checkpoint.endswith("iter_0000003") and 3 in res.evals
    assert set(res.final_evals) == {"validation"}  # the script has no test data
