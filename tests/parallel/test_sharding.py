"""The shard rule of megadlms.parallel.sharding: shard_full / gather_full are inverse on 3
gloo ranks (odd tp), for one block and for SwiGLU's two blocks, on both dims."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megadlms.parallel.sharding import (
    REPLICATED,
    ParamSharding,
    counts_once,
    gather_full,
    local_from_full,
    set_sharding,
    shard_full,
    shard_spec,
    sharding_of,
)
from tests.dist_utils import run_distributed


def test_two_blocks_pair_gate_and_up_halves():
    full = torch.arange(8.0).reshape(8, 1)  # [gate 0..3 | up 4..7]
    assert shard_full(full, 0, 2, 0, blocks=2).flatten().tolist() == [0, 1, 4, 5]
    assert shard_full(full, 1, 2, 0, blocks=2).flatten().tolist() == [2, 3, 6, 7]
    assert shard_full(full, 1, 2, 0).flatten().tolist() == [4, 5, 6, 7]


def test_indivisible_size_names_the_shape():
    with pytest.raises(ValueError, match=r"dim 0 = 6 cannot be split into 2 block\(s\) x 2"):
        shard_full(torch.zeros(6, 2), 0, 2, 0, blocks=2)


def test_spec_and_local_from_full_single_process():
    p = set_sharding(torch.nn.Parameter(torch.zeros(4, 2)), tp_dim=1, tp_blocks=2)
    assert shard_spec(p) == (1, 2) and shard_spec(torch.zeros(1)) is None
    full = torch.randn(4, 2)
    assert torch.equal(local_from_full(full, p, None), full)


def test_set_sharding_merges_into_one_frozen_description():
    p = torch.nn.Parameter(torch.zeros(4, 2))
    assert sharding_of(p) is REPLICATED and not vars(p)  # undeclared: nothing attached
    set_sharding(p, tp_dim=0)
    set_sharding(p, tied_copy=True)  # the second call keeps tp_dim
    assert sharding_of(p) == ParamSharding(tp_dim=0, tied_copy=True)
    assert list(vars(p)) == ["megadlms_sharding"]  # one attribute, not one per field
    with pytest.raises(AttributeError):
        sharding_of(p).tp_dim = 1  # frozen: only set_sharding changes it
    with pytest.raises(ValueError, match="not both"):
        set_sharding(p, expert_dim=0)
    with pytest.raises(ValueError, match="tp_blocks"):
        ParamSharding(tp_blocks=2)


def test_counts_once_is_one_owner_per_element():
    # grid (tp x dp replicas) of ranks: each element of the full tensor counts exactly once.
    tp, dp = 2, 3
    cases = {
        "sharded": (set_sharding(torch.nn.Parameter(torch.zeros(2)), tp_dim=0), tp),
        "replicated": (torch.nn.Parameter(torch.zeros(2)), 1),
        "partial": (set_sharding(torch.nn.Parameter(torch.zeros(2)), tp_partial_grad=True), 1),
        "tied": (set_sharding(torch.nn.Parameter(torch.zeros(2)), tp_dim=0, tied_copy=True), 0),
    }
    for name, (p, holders) in cases.items():
        over_dp = sum(
            counts_once(p, tp_rank=t, dp_rank=d, expert_dp_rank=0) for t in range(tp) for d in range(dp)
        )
        inside_mp = sum(counts_once(p, tp_rank=t) for t in range(tp))  # dp replicas not summed
        assert over_dp == holders and inside_mp == holders, name
    expert = set_sharding(torch.nn.Parameter(torch.zeros(2)), expert_dim=0)
    # experts: replicated over expert_dp, whatever the dp rank says
    assert [counts_once(expert, tp_rank=0, dp_rank=1, expert_dp_rank=e) for e in range(2)] == [True, False]


def _roundtrip(rank, world):
    torch.manual_seed(0)
    out = {}
    for dim, blocks in ((0, 1), (1, 1), (0, 2), (1, 2)):
        shape = [12, 6]
        shape[dim] = 2 * 3 * blocks
        full = torch.randn(shape)
        local = shard_full(full, rank, world, dim, blocks)
        back = gather_full(local, dist.group.WORLD, dim, blocks)
        out[(dim, blocks)] = bool(torch.equal(back, full))
    return out


def test_gather_inverts_shard_on_3_ranks():
    for res in run_distributed(_roundtrip, 3, timeout=240):
        assert all(res.values()), res
