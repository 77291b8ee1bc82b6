"""ParallelGroups: Megatron's rank order (tables written out by hand from Megatron-core's
RankGenerator, order tp-cp-ep-dp-pp), the size checks, and real gloo groups on 4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megadlms.parallel import ParallelGroups, check_sizes, rank_grid
from tests.dist_utils import run_distributed

# Megatron-core, world 8, tp 2, pp 2 -> dp 2: global rank = tp_rank + 2*dp_rank + 4*pp_rank.
WORLD8_TP2_PP2 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "ep": [[0], [1], [2], [3], [4], [5], [6], [7]],
    "expert_dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
}
WORLD4_TP2 = {
    "tp": [[0, 1], [2, 3]],
    "dp": [[0, 2], [1, 3]],
    "pp": [[0], [1], [2], [3]],
    "ep": [[0], [1], [2], [3]],
    "expert_dp": [[0, 2], [1, 3]],
}
WORLD6_TP3 = {
    "tp": [[0, 1, 2], [3, 4, 5]],
    "dp": [[0, 3], [1, 4], [2, 5]],
    "pp": [[0], [1], [2], [3], [4], [5]],
    "ep": [[0], [1], [2], [3], [4], [5]],
    "expert_dp": [[0, 3], [1, 4], [2, 5]],
}
# Expert groups carved out of dp (ep fast, expert_dp slow): world 8, tp 2, ep 2 -> dp 4.
WORLD8_TP2_EP2 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    "pp": [[0], [1], [2], [3], [4], [5], [6], [7]],
    "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "expert_dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
}


@pytest.mark.parametrize(
    "world,tp,pp,ep,table",
    [
        (8, 2, 2, 1, WORLD8_TP2_PP2),
        (4, 2, 1, 1, WORLD4_TP2),
        (6, 3, 1, 1, WORLD6_TP3),
        (8, 2, 1, 2, WORLD8_TP2_EP2),
    ],
)
def test_rank_grid_matches_megatron_order(world, tp, pp, ep, table):
    assert rank_grid(world, tp=tp, pp=pp, ep=ep) == table


def test_check_sizes_returns_dp_and_accepts_matching_dp():
    assert check_sizes(8, tp=2, pp=2) == 2
    assert check_sizes(8, tp=2, pp=1, dp=4) == 4
    assert check_sizes(1) == 1


def test_error_sizes_do_not_divide_world():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tensor_model_parallel_size 4"):
        check_sizes(6, tp=4)
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size 3 = 6"):
        check_sizes(8, tp=2, pp=3)


def test_error_dp_mismatch_names_all_three():
    with pytest.raises(ValueError) as err:
        check_sizes(8, tp=2, pp=1, dp=2)
    msg = str(err.value)
    for part in (
        "data_parallel_size 2",
        "world size 8",
        "tensor_model_parallel_size 2",
        "pass data_parallel_size 4",
    ):
        assert part in msg


def test_error_ep_and_non_positive():
    with pytest.raises(
        ValueError, match=r"expert_model_parallel_size 3 does not divide the data-parallel size 4"
    ):
        check_sizes(8, tp=2, ep=3)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size must be a positive integer, got 0"):
        check_sizes(4, tp=0)


def test_single_has_no_groups():
    g = ParallelGroups.single()
    for axis in (g.tp, g.dp, g.pp, g.ep, g.expert_dp):
        assert (axis.size, axis.rank, axis.ranks, axis.group) == (1, 0, (0,), None)
    assert g.world_size == 1 and g.describe() == "tp1 x dp1"


def test_build_needs_initialised_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="ParallelGroups.single"):
        ParallelGroups.build(tp=2)


def _build_layouts(rank, world):
    out = {}
    for name, sizes in {"tp2_ep2": dict(tp=2, ep=2), "tp2_pp2": dict(tp=2, pp=2)}.items():
        g = ParallelGroups.build(**sizes)
        axes = {}
        for axis_name in ("tp", "dp", "pp", "ep", "expert_dp"):
            axis = getattr(g, axis_name)
            assert dist.get_process_group_ranks(axis.group) == list(axis.ranks)
            # The group really talks: sum of global ranks over it.
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=axis.group)
            axes[axis_name] = (axis.size, axis.rank, axis.ranks, t.item())
        out[name] = (axes, g.describe())
    try:  # bad sizes fail on every rank before any collective (no rank left blocked)
        ParallelGroups.build(tp=3)
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    return out


def test_build_on_four_ranks_matches_rank_grid():
    results = run_distributed(_build_layouts, world_size=4, timeout=120)
    for name, sizes, describe in (
        ("tp2_ep2", dict(tp=2, ep=2), "tp2 x dp2 x ep2"),
        ("tp2_pp2", dict(tp=2, pp=2), "pp2 x tp2 x dp1"),
    ):
        table = rank_grid(4, **sizes)
        for rank, res in enumerate(results):
            axes, desc = res[name]
            assert desc == describe
            for axis_name, (size, axis_rank, ranks, total) in axes.items():
                group = next(g for g in table[axis_name] if rank in g)
                assert ranks == tuple(group) and size == len(group)
                assert axis_rank == group.index(rank) and total == sum(group)
    assert all("world size 4 is not divisible by tensor_model_parallel_size 3" in r["error"] for r in results)
