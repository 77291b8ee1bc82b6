"""The shard rule of megadlms.parallel.sharding: shard_full / gather_full are inverse on 3
gloo ranks (odd tp), for one block and for SwiGLU's two blocks, on both dims."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megadlms.parallel.sharding import gather_full, local_from_full, mark_sharded, shard_full, shard_spec
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
    p = mark_sharded(torch.nn.Parameter(torch.zeros(4, 2)), 1, 2)
    assert shard_spec(p) == (1, 2) and shard_spec(torch.zeros(1)) is None
    full = torch.randn(4, 2)
    assert torch.equal(local_from_full(full, p, None), full)


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
