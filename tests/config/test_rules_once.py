"""Each cross-config rule is stated once: a command that breaks it gets exactly one message,
and that message is the owning layer's own ``*_problems`` function's (reworded with flags),
the same text its run-time guard raises. Parse-level only: no ranks."""

from __future__ import annotations

import shlex

import pytest

from megadlms.config import flag_message, parse_config
from megadlms.data import build_pretraining_datasets, data_source_problems
from megadlms.data.tokenizers import ByteTokenizer
from megadlms.distributed import DistributedDataParallelConfig
from megadlms.distributed.ddp_groups import expert_instances_problems
from megadlms.distributed.fsdp2 import fsdp2_config_problems
from megadlms.optimizer import OptimizerConfig, dtensor_problems
from megadlms.pipeline import check_micro_batches, micro_batch_problems

BASE = shlex.split(
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3"
)
FSDP = ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"]
MOCK = ["--mock-data"]
DATA = ["--data-path", "/nonexistent/corpus"]


def _problems(argv, world):
    with pytest.raises(ValueError) as err:
        parse_config(BASE + argv, world_size=world)
    return [line[4:] for line in str(err.value).splitlines() if line.startswith("  - ")]


# (id, flags, world, which problem lines are about the rule, the owner's message as flags)
RULES = [
    (
        "fsdp2_nccl_ext",
        MOCK + FSDP + ["--comm-backend", "nccl_ext"],
        2,
        lambda p: "--use-torch-fsdp2" in p and "--comm-backend" in p,
        fsdp2_config_problems(DistributedDataParallelConfig(comm_backend="nccl_ext"), who="use_torch_fsdp2"),
    ),
    (
        "fsdp2_fp16",
        MOCK + FSDP + ["--fp16"],
        2,
        lambda p: "--fp16" in p,
        dtensor_problems(OptimizerConfig(lr=1e-3, fp16=True), who="use_torch_fsdp2"),
    ),
    (
        "micro_batches_lt_pp",
        MOCK + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "2"],
        2,
        lambda p: "micro-batches" in p,
        micro_batch_problems(1, 2, 1, batch=(2, 2, 1)),
    ),
    (
        "interleaved_micro_batches",
        MOCK + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "6"]
        + ["--virtual-pipeline-model-parallel-size", "2", "--micro-batch-size", "2"],
        2,
        lambda p: "micro-batches" in p,
        micro_batch_problems(3, 2, 2, batch=(6, 2, 1)),
    ),
    (
        "ep_with_optimizer_instances",
        MOCK + ["--num-experts", "4", "--expert-model-parallel-size", "2", "--use-distributed-optimizer"]
        + ["--num-distributed-optimizer-instances", "2"],
        4,
        lambda p: "--num-distributed-optimizer-instances" in p,
        expert_instances_problems(2, 2),
    ),
    (
        "two_data_sources",
        MOCK + DATA,
        2,
        lambda p: "data" in p,
        data_source_problems(mock=True, data_path=DATA[1:]),
    ),
    (
        "no_data_source",
        [],
        2,
        lambda p: "data" in p,
        data_source_problems(),
    ),
    (
        "valid_without_train",
        ["--valid-data-path", "/nonexistent/valid"],
        2,
        lambda p: "data" in p,
        data_source_problems(valid_data_path=["/nonexistent/valid"]),
    ),
    (
        "split_gives_train_nothing",
        DATA + ["--split", "0,1,0"],
        2,
        lambda p: "--split" in p or "data" in p,
        data_source_problems(data_path=DATA[1:], split="0,1,0"),
    ),
]  # fmt: skip


@pytest.mark.parametrize("rule_id,flags,world,about,owned", RULES, ids=[r[0] for r in RULES])
def test_one_message_per_rule_from_its_owner(rule_id, flags, world, about, owned):
    assert len(owned) == 1, owned  # the owner states the rule once
    got = [p for p in _problems(flags, world) if about(p)]
    assert got == [flag_message(owned[0])], f"{rule_id}: {got}"


def test_one_command_breaking_several_rules_gets_one_message_each():
    flags = MOCK + DATA + FSDP + ["--fp16", "--comm-backend", "nccl_ext"]
    problems = _problems(flags, 2)
    owned = [
        data_source_problems(mock=True, data_path=DATA[1:])[0],
        fsdp2_config_problems(DistributedDataParallelConfig(comm_backend="nccl_ext"), who="use_torch_fsdp2")[
            0
        ],
        dtensor_problems(OptimizerConfig(lr=1e-3, fp16=True), who="use_torch_fsdp2")[0],
    ]
    for message in map(flag_message, owned):
        assert problems.count(message) == 1, (message, problems)
    # nothing else speaks of the same rules (the old duplicates named these pairs)
    assert sum("--use-torch-fsdp2" in p and "--comm-backend" in p for p in problems) == 1
    assert sum("--fp16" in p for p in problems) == 1
    assert sum("data source" in p for p in problems) == 1


def test_run_time_guards_raise_the_owners_message():
    """The lower layers' guards (for callers that skip the CLI) raise the same text."""
    with pytest.raises(ValueError) as err:
        check_micro_batches(1, 2)
    assert str(err.value) == micro_batch_problems(1, 2)[0]
    common = dict(seq_length=8, seed=1, train_samples=4, tokenizer=ByteTokenizer())
    with pytest.raises(ValueError) as err:
        build_pretraining_datasets(mock=True, data_path=DATA[1:], **common)
    assert str(err.value) == data_source_problems(mock=True, data_path=DATA[1:])[0]
    with pytest.raises(ValueError) as err:
        build_pretraining_datasets(valid_data_path=["/nonexistent/valid"], **common)
    assert str(err.value) == data_source_problems(valid_data_path=["/nonexistent/valid"])[0]
