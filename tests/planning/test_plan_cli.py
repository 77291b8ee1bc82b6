"""megadlms-plan on the trainer's flags: activations against a saved-tensor count, the
trainer's FLOPs, the CLI's table / JSON / sweep, and one-line errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megadlms.config import parse_config
from megadlms.models import num_floating_point_operations
from megadlms.planning.activations import block_saved_bytes, layer_bytes
from megadlms.planning.cli import main
from megadlms.planning.plan import with_vocabulary
from megadlms.planning.throughput import step_flops

SMALL = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 96 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 8 --lr 1e-3 --train-iters 1 "
    "--mock-data --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--vocab-size 300 --bf16 --qk-layernorm"
).split()
RECOMPUTE = {
    "none": [],
    "selective": ["--recompute-granularity", "selective"],
    "full": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split(),
}


@pytest.mark.parametrize("lever", list(RECOMPUTE))
def test_activation_bytes_match_the_saved_tensor_count(lever):
    # a shape none of the fit's small layers has, larger in every dimension, GQA on
    argv = SMALL + RECOMPUTE[lever] + "--group-query-attention --num-query-groups 2".split()
    argv = [*argv, "--hidden-size", "192", "--num-attention-heads", "6", "--ffn-hidden-size", "320"]
    argv = [*argv, "--seq-length", "160", "--max-position-embeddings", "160"]
    config = parse_config(argv, world_size=1)
    planned = 3 * layer_bytes(config)  # three layers
    model = dataclasses.replace(config.model, num_layers=3, params_dtype=torch.bfloat16)
    # a 4-layer minus a 1-layer block: what three layers add (what they share cancels)
    one = block_saved_bytes(dataclasses.replace(model, num_layers=1))
    four = block_saved_bytes(dataclasses.replace(model, num_layers=4))
    measured = four - one
    assert measured > 0
    assert abs(planned - measured) <= 0.05 * measured, (lever, planned, measured)


def test_flops_are_the_trainers_count():
    config = with_vocabulary(parse_config(SMALL, world_size=1))
    # training/train.py: num_floating_point_operations(model, gbs, seq_length, causal=...)
    want = num_floating_point_operations(config.model, 8, 64, causal=False)
    assert step_flops(config) == want


def test_block_diffusion_plans_the_2s_pass():
    # training/step.py's model_length: [x_t ; x_0] is twice the tokens in FLOPs and activations
    plain = with_vocabulary(parse_config(SMALL, world_size=1))
    block = with_vocabulary(parse_config([*SMALL, "--difflm-block-size", "16"], world_size=1))
    assert step_flops(block) == num_floating_point_operations(block.model, 8, 128, causal=False)
    assert layer_bytes(block) > 2 * layer_bytes(plain) * 0.99


def test_table_and_json(capsys):
    assert main(["--world-size", "2", "--device", "H200", *SMALL, "--use-distributed-optimizer"]) == 0
    out = capsys.readouterr().out
    assert "optimizer state" in out and "MFU" in out and "fits" in out
    assert main(["--world-size", "2", "--json", *SMALL]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layout"]["dp"] == 2 and report["fits"] is True
    assert report["bytes_per_rank"]["weights"] > 0 and report["step"]["flops"] > 0


def test_sweep_lists_fitting_layouts_fastest_first(capsys):
    assert main(["--world-size", "4", "--sweep", "--json", "--top", "50", *SMALL]) == 0
    plans = json.loads(capsys.readouterr().out)
    times = [p["step"]["step_s"] for p in plans]
    assert plans and times == sorted(times)
    assert {p["layout"]["tp"] for p in plans} >= {1, 2} and {p["layout"]["recompute"] for p in plans} >= {
        "none",
        "full",
    }


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size"),
        (["--device", "TPU"], "--device TPU"),
        (["--device-field", "hbm=1"], "--device-field hbm=1"),
    ],
)
def test_invalid_input_is_a_one_line_error(capsys, extra, words):
    assert main(["--world-size", "4", *SMALL, *extra]) == 2
    err = capsys.readouterr().err
    assert words in err and err.startswith("megadlms-plan: ")
