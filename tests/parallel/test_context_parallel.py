"""Context parallelism (--context-parallel-size) end to end through ``megadlms.pretrain.run``
on gloo CPU ranks (fp32, dropout 0, tiny model, mock data).

The independent reference is the one-process run of the same global batch: every layout must
give its loss curve, grad norms and validation NELBO within 1e-5 relative:

* 4 ranks (one world): cp2 x dp2 with the distributed optimizer (sharded over dp x cp; it
  saves a checkpoint that the one-process run and a cp4 run resume), cp2 x tp2 with sequence parallelism
  and cp2 x pp2 (bidirectional difflm: the MegaDLMs objective feeds L-1 = 31 tokens and
  variable-length crops, so the split pads), cp4 causal (vanilla: Megatron's 2C-chunk
  load-balanced split);
* pure: the 2C-chunk index, the padding, the rank order (Megatron's tp-cp-dp-pp) and the
  refusals by flag name.
"""

from __future__ import annotations

import os

import pytest
import torch

from megadlms.config import parse_config
from megadlms.parallel.context_parallel import padded_length, sequence_index, shard_sequence
from megadlms.parallel.groups import rank_grid
from tests.dist_utils import run_distributed

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu "
    "--attention-dropout 0 --hidden-dropout 0 --micro-batch-size 1 --global-batch-size 2 "
    "--train-iters 3 --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 1 "
    "--seed 7 --mock-data --num-workers 0 --log-interval 1 "
    "--eval-interval 3 --eval-iters 1 --difflm-eval-mc-samples 2 --difflm-varilen-prob 0.3"
).split()
VANILLA = ["--model-running-mode", "vanilla", "--attention-mask-type", "causal"]
# dp 2: LLaDA's crop (drawn once per step; MegaDLMs' per-micro-batch crop depends on dp)
B4 = ["--global-batch-size", "4", "--difflm-objective", "llada"]
# No evaluation (no valid/test set; the train stream does not depend on it): for the runs whose
# NELBO no test reads.
NOEVAL = ["--eval-iters", "0"]
REL = 1e-5


def _cp(n):
    return ["--context-parallel-size", str(n)]


def _run(argv):
    """One run; the vocabulary is padded to the same rows at tp 1 and 2 (Megatron pads to a
    multiple of --make-vocab-size-divisible-by x tp), so every layout trains the same model."""
    from megadlms.pretrain import run

    divisible = "64" if "--tensor-model-parallel-size" in argv else "128"
    return run(TINY + ["--make-vocab-size-divisible-by", divisible] + list(argv))


def _four_rank_world(rank, world, tmp):
    save = ["--save", os.path.join(tmp, "cp2dp2"), "--save-interval", "2", "--exit-interval", "2"]
    return {
        "cp2_dp2": _run(_cp(2) + B4 + ["--use-distributed-optimizer"] + save),
        "cp2_tp2_sp": _run(_cp(2) + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        "cp2_pp2": _run(_cp(2) + ["--pipeline-model-parallel-size", "2"]),
        "cp4_causal": _run(_cp(4) + VANILLA),
        # the cp2 x dp2 checkpoint resumed at cp4 x dp1
        "cp4_resumed": _run(_cp(4) + B4 + NOEVAL + ["--use-distributed-optimizer", "--load", save[1]]),
    }


def _one_process_world(rank, world, tmp):
    return {
        "single": _run([]),
        "single_causal": _run(VANILLA),
        "single_b4": _run(B4 + NOEVAL + ["--use-distributed-optimizer"]),
        "resumed": _run(B4 + NOEVAL + ["--use-distributed-optimizer", "--load", os.path.join(tmp, "cp2dp2")]),
    }


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("cp"))
    out = {}
    for res in (
        run_distributed(_four_rank_world, 4, args=(tmp,), timeout=900),
        run_distributed(_one_process_world, 1, args=(tmp,), timeout=600),
    ):
        out.update(res[0])
    return out


def _close(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), what
    for k in a:
        assert abs(a[k] - b[k]) <= REL * abs(b[k]), f"{what} iteration {k}: {a[k]} != {b[k]}"


@pytest.mark.parametrize(
    "layout,reference",
    [
        ("cp2_tp2_sp", "single"),
        ("cp2_pp2", "single"),
        ("cp4_causal", "single_causal"),
    ],
)
def test_layout_matches_one_process(worlds, layout, reference):
    got, ref = worlds[layout], worlds[reference]
    _close(got.losses, ref.losses, f"{layout} loss")
    _close(got.grad_norms, ref.grad_norms, f"{layout} grad norm")
    _close(got.final_evals, ref.final_evals, f"{layout} final NELBO")


def test_cp_dp_distopt_and_checkpoint_resharded_to_one_process(worlds):
    ref, part = worlds["single_b4"], worlds["cp2_dp2"]
    _close(part.losses, {k: ref.losses[k] for k in part.losses}, "cp2 x dp2 loss")
    _close(part.grad_norms, {k: ref.grad_norms[k] for k in part.grad_norms}, "cp2 x dp2 grad norm")
    # the cp2 x dp2 checkpoint (optimizer sharded over dp x cp) resumed on one process and at cp4
    for name in ("resumed", "cp4_resumed"):
        resumed = worlds[name]
        assert sorted(resumed.losses) == [3], name  # 1-based: the step after the checkpoint
        _close(resumed.losses, {3: ref.losses[3]}, f"{name} loss")
        _close(resumed.grad_norms, {3: ref.grad_norms[3]}, f"{name} grad norm")


def test_sequence_index_is_megatrons_load_balanced_split():
    # 2C = 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert sequence_index(8, 2, 0, True).tolist() == [0, 1, 6, 7]
    assert sequence_index(8, 2, 1, True).tolist() == [2, 3, 4, 5]
    assert sequence_index(8, 2, 1, False).tolist() == [4, 5, 6, 7]
    assert padded_length(31, 2, False) == 32 and padded_length(31, 2, True, multiple=2) == 32
    assert padded_length(33, 4, True) == 40
    pos = torch.arange(7).expand(2, 7)
    parts = [
        shard_sequence({"position_ids": pos, "x": pos + 10}, {"x": -5}, cp=2, rank=r, load_balance=True)
        for r in range(2)
    ]
    assert parts[0]["position_ids"][0].tolist() == [0, 1, 6, -1]
    assert parts[0]["x"][0].tolist() == [10, 11, 16, -5]
    assert parts[1]["x"][0].tolist() == [12, 13, 14, 15]


def test_rank_grid_with_context_parallelism_is_megatrons_order():
    # world 8, tp 2, cp 2 -> dp 2: global rank = tp_rank + 2 * cp_rank + 4 * dp_rank
    grid = rank_grid(8, tp=2, cp=2)
    assert grid["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid["mp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"], "--use-torch-fsdp2"),
        (["--reset-attention-mask"], "--reset-attention-mask"),
        (["--num-experts", "4"], "--num-experts"),
        (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size"),
        (
            ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"],
            "--num-distributed-optimizer-instances",
        ),
    ],
)
def test_refusals_name_the_flags(extra, needle):
    with pytest.raises(ValueError) as err:
        parse_config(TINY + _cp(2) + extra, world_size=4)
    lines = [line for line in str(err.value).splitlines() if "--context-parallel-size" in line]
    assert lines and needle in lines[0], str(err.value)


def test_context_parallel_size_parses_and_sets_dp():
    cfg = parse_config(TINY + _cp(2) + ["--tensor-model-parallel-size", "2"], world_size=8)
    assert cfg.parallel.context_parallel_size == 2 and cfg.parallel.data_parallel_size == 2
    assert not any("--cp-comm-type" in n for n in cfg.logging.notes)
    # Megatron's ring choice parses; it is noted once as without effect (the numbers are the same)
    cfg = parse_config(TINY + _cp(2) + ["--cp-comm-type", "p2p"], world_size=4)
    assert any(n.startswith("--cp-comm-type") for n in cfg.logging.notes)
