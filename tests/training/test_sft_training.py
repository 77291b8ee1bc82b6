"""Supervised fine-tuning end to end through ``megadlms.pretrain.run`` (the real CLI) on gloo CPU
ranks: the same global batch of conversations gives the one-process SFT loss curve and
validation (the answer NELBO) at every layout (DDP, distributed optimizer, FSDP2 and FSDP2 x TP,
TP + SP, PP, CP, EP), fp32 and dropout 0, within 1e-5 relative; packing and the token
normalisation train; bad conversations stop with one line naming the file and row.

The conversations are jsonl rows tokenized with a tiny LLaDA-style chat template
(tests/data/sft_fixtures.py) into a shared --data-cache-path: rank 0 tokenizes, the others and
later runs read its cache. The vocabulary is padded to the same 128 rows at tp 1 and tp 2.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from tests.data.sft_fixtures import WORDS, make_chat_tokenizer
from tests.dist_utils import run_distributed

REL = 1e-5
ITERS = 4
TINY = (
    "--difflm-objective llada --sft "
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
    "--attention-dropout 0 --hidden-dropout 0 --micro-batch-size 2 --global-batch-size 8 "
    f"--train-iters {ITERS} --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 1 "
    "--weight-decay 0.1 --clip-grad 1.0 --seed 7 --num-workers 0 --log-interval 1 "
    f"--eval-interval {ITERS} --eval-iters 1 --difflm-eval-mc-samples 2 "
    f"--untie-embeddings-and-output-weights --exit-interval {ITERS} --tokenizer-type HuggingFaceTokenizer"
).split()
TP1 = ["--make-vocab-size-divisible-by", "128"]
TP2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
MOE = ["--num-experts", "2", "--moe-router-topk", "1", "--moe-ffn-hidden-size", "32"]


def _conversations(n: int, seed: int):
    rng = random.Random(seed)
    words = WORDS[4:]  # content words (not the role names)
    rows = []
    for i in range(n):
        turns = [{"role": "system", "content": "you are a helpful bot"}] if i % 3 == 0 else []
        for _ in range(1 + (i % 4 == 0)):  # some dialogues have two assistant turns
            turns.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(2, 6)))})
            turns.append({"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(1, 5)))})
        rows.append({"messages": turns})
    return rows


def _write(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def _data_flags(tmp):
    return [
        "--tokenizer-model", os.path.join(tmp, "tok"),
        "--train-data-path", os.path.join(tmp, "train.jsonl"),
        "--valid-data-path", os.path.join(tmp, "valid.jsonl"),
        "--data-cache-path", os.path.join(tmp, "cache"),
    ]  # fmt: skip


def _run(tmp, argv):
    from megadlms.pretrain import run

    return run(TINY + _data_flags(tmp) + list(argv))


def _four_rank_world(rank, world, tmp):
    return {
        "dp4": _run(tmp, TP1),
        "dp4_distopt": _run(tmp, TP1 + ["--use-distributed-optimizer", "--overlap-grad-reduce"]),
        "fsdp2": _run(tmp, TP1 + ["--use-torch-fsdp2"]),
        "fsdp2_tp2": _run(tmp, TP2 + ["--use-torch-fsdp2"]),
        "tp2_sp": _run(tmp, TP2 + ["--sequence-parallel"]),
        "pp2": _run(tmp, TP1 + ["--pipeline-model-parallel-size", "2"]),
        "cp2": _run(tmp, TP1 + ["--context-parallel-size", "2"]),
        "ep2": _run(tmp, TP1 + MOE + ["--expert-model-parallel-size", "2"]),
        "packing_dp4": _run(tmp, TP1 + ["--sft-sequence-packing"]),
    }


def _one_process_world(rank, world, tmp):
    out = {
        "single": _run(tmp, TP1),
        "single_moe": _run(tmp, TP1 + MOE),
        "packing": _run(tmp, TP1 + ["--sft-sequence-packing"]),
        "token": _run(tmp, TP1 + ["--sft-loss-normalization", "token"]),
    }
    bad = _write(
        os.path.join(tmp, "bad.jsonl"),
        _conversations(3, 1) + [{"messages": [{"role": "user", "content": "hi"}]}],
    )
    try:
        _run(tmp, TP1 + ["--train-data-path", bad])
        out["bad"] = None
    except ValueError as exc:
        out["bad"] = str(exc)
    return out


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("sft"))
    make_chat_tokenizer(os.path.join(tmp, "tok"), "llada")
    _write(os.path.join(tmp, "train.jsonl"), _conversations(60, 0))
    _write(os.path.join(tmp, "valid.jsonl"), _conversations(12, 1))
    one = run_distributed(_one_process_world, 1, args=(tmp,), timeout=600)[0]
    four = run_distributed(_four_rank_world, 4, args=(tmp,), timeout=900)[0]
    return four, one


def _assert_same(res, ref):
    its = range(1, ITERS + 1)
    assert [res.losses[i] for i in its] == pytest.approx([ref.losses[i] for i in its], rel=REL)
    assert res.evals[ITERS] == pytest.approx(ref.evals[ITERS], rel=REL)


@pytest.mark.parametrize("name", ["dp4", "dp4_distopt", "fsdp2", "fsdp2_tp2", "tp2_sp", "pp2", "cp2"])
def test_sft_curve_matches_one_process(worlds, name):
    four, one = worlds
    _assert_same(four[name], one["single"])


def test_sft_expert_parallel_and_packing_match_one_process(worlds):
    four, one = worlds
    _assert_same(four["ep2"], one["single_moe"])
    _assert_same(four["packing_dp4"], one["packing"])


def test_sft_trains_and_reports(worlds):
    _, one = worlds
    single = one["single"]
    assert single.losses[ITERS] < single.losses[1]
    # the token normalisation trains on the same masks, with another weighting
    assert one["token"].losses[1] != single.losses[1]
    assert all(v > 0 for v in one["token"].losses.values())
    # a row without an assistant answer: one line naming the file and the row
    assert "bad.jsonl:4" in one["bad"] and "\n" not in one["bad"]
