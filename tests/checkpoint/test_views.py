"""Format 4's box math (checkpoint/views.py), one process: every rank's pieces put back where
their offsets say rebuild the full tensor exactly, each element once; a format-3 checkpoint
(one full chunk per key) reads into views; the torch_dist -> torch_dist conversion writes 4."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
import torch.distributed as dist

from megadlms import checkpoint as ck
from megadlms.checkpoint.views import (
    NO_CUT,
    ShardView,
    ep_cut,
    flat_boxes,
    flat_view,
    local_view,
    tp_cut,
)
from megadlms.parallel.sharding import shard_full


def _assemble(views, shape) -> torch.Tensor:
    """The full tensor from every rank's views; each element must be covered exactly once."""
    out = torch.zeros(shape)
    hits = torch.zeros(shape, dtype=torch.int64)
    for v in views:
        assert tuple(v.size()) == tuple(shape)
        for t, off in v.pieces:
            box = tuple(slice(o, o + s) for o, s in zip(off, t.shape))
            out[box] = t
            hits[box] += 1
    assert bool((hits == 1).all()), "pieces overlap or leave a hole"
    return out


@pytest.mark.parametrize("tp", [2, 3, 4])
@pytest.mark.parametrize("blocks", [1, 2])
@pytest.mark.parametrize("dim", [0, 1])
def test_tp_boxes_rebuild_the_full_tensor(tp, blocks, dim):
    shape = [12 * blocks, 12 * blocks]
    full = torch.randn(shape)
    views = []
    for r in range(tp):
        local = shard_full(full, r, tp, dim, blocks)
        v = local_view(local, tp_cut(dim, local.shape[dim], blocks, r, tp))
        assert len(v.pieces) == blocks
        # the pieces are views of the local storage, not copies
        assert all(t.untyped_storage().data_ptr() == local.untyped_storage().data_ptr() for t, _ in v.pieces)
        views.append(v)
    assert torch.equal(_assemble(views, shape), full)


def test_ep_boxes_and_fill_from_full():
    full = torch.randn(8, 3, 5)
    views = [local_view(full[2 * e : 2 * e + 2].clone(), ep_cut(0, 2, e, 4)) for e in range(4)]
    assert torch.equal(_assemble(views, full.shape), full)
    dst = torch.zeros(2, 3, 5)  # the torch format's load: the same description, other way round
    local_view(dst, ep_cut(0, 2, 3, 4)).fill_from_full(full)
    assert torch.equal(dst, full[6:8])


@pytest.mark.parametrize("shape", [(4, 3, 5), (6, 10), (17,)])
def test_flat_ranges_cross_rows(shape):
    n = torch.Size(shape).numel()
    full = torch.randn(shape)
    flat = full.flatten()
    cuts = [0, 1, 7, n // 2 + 3, n - 2, n]
    views = []
    for a, b in zip(cuts, cuts[1:]):
        assert len(flat_boxes(a, b, shape)) <= 2 * len(shape) - 1
        views.append(flat_view(flat[a:b].clone(), a, b, shape))
    assert torch.equal(_assemble(views, shape), full)
    assert flat_view(torch.empty(0), 5, 5, shape).pieces == []  # a rank holding none of it


@pytest.mark.parametrize("dim", [0, 1])
def test_flat_ranges_of_swiglu_tp_shards(dim):
    """The distributed optimizer's flat pieces of a TP rank's [gate; up] shard, at tp 2, dp 3."""
    tp, blocks, shape = 2, 2, [8, 6] if dim == 0 else [6, 8]
    full = torch.randn(shape)
    views = []
    for r in range(tp):
        local = shard_full(full, r, tp, dim, blocks)
        cut = tp_cut(dim, local.shape[dim], blocks, r, tp)
        n, flat = local.numel(), local.flatten()
        bounds = [0, 5, 17, n]  # dp 3, uneven, crossing rows and blocks
        for a, b in zip(bounds, bounds[1:]):
            views.append(flat_view(flat[a:b], a, b, local.shape, cut))
    assert torch.equal(_assemble(views, shape), full)


@contextlib.contextmanager
def _fake_rank(rank: int, world: int):
    """A process group that moves no data (shapes and offsets only): one rank of ``world``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def _fsdp2(local_full: torch.Tensor, mesh, rank: int, world: int):
    from torch.distributed.tensor import DTensor, Shard

    piece = local_full.chunk(world)[rank].clone() if rank < len(local_full.chunk(world)) else None
    if piece is None:  # torch.chunk gives fewer pieces than ranks: this rank holds none
        piece = local_full[:0].clone()
    return DTensor.from_local(
        piece, mesh, [Shard(0)], run_check=False, shape=local_full.shape, stride=local_full.stride()
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_fsdp2_uneven_dp3_and_fsdp2_x_tp(tp):
    """FSDP2 at dp 3 over 10 rows (4, 4, 2), alone and over a TP rank's [gate; up] shard."""
    shape = [20 * tp, 3]
    full = torch.randn(shape)
    views = []
    for r in range(tp):
        local = shard_full(full, r, tp, 0, 2)  # this TP rank's shard: the DTensor's global tensor
        cut = tp_cut(0, local.shape[0], 2, r, tp) if tp > 1 else NO_CUT
        for d in range(3):
            with _fake_rank(d, 3) as mesh:
                views.append(local_view(_fsdp2(local, mesh, d, 3), cut))
    assert torch.equal(_assemble(views, shape), full)


def _write_v3(root: str) -> str:
    """A format-3 checkpoint: one full chunk per key (tp = 1, as the old save wrote any layout)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 4))
    path = ck.save_checkpoint(root, 3, model=model, save_rng=False)
    common_file = os.path.join(path, ck.COMMON_FILE)
    with open(common_file) as f:
        common = json.load(f)
    common["format_version"] = 3
    with open(common_file, "w") as f:
        json.dump(common, f)
    return path


def test_v3_checkpoint_reads_into_tp_views(tmp_path):
    ckpt = _write_v3(str(tmp_path / "v3"))
    common = ck.read_common(ckpt)
    assert common["format_version"] == 3
    full = {"model/0.weight": torch.empty(8, 6)}
    ck.read_tensors(ckpt, common, full)
    for tp in (2, 4):
        for r in range(tp):
            dst = torch.zeros(8 // tp, 6)
            view = local_view(dst, tp_cut(0, 8 // tp, 2 if tp == 2 else 1, r, tp))
            ck.read_tensors(ckpt, common, {"model/0.weight": view})
            assert torch.equal(dst, shard_full(full["model/0.weight"], r, tp, 0, 2 if tp == 2 else 1))


def test_views_survive_async_staging():
    """A staged view owns minimal CPU copies: later writes to the source do not reach it."""
    src = torch.arange(12.0).view(4, 3)
    view = local_view(src, tp_cut(0, 4, 2, 1, 2))
    staged = view.staged()
    src.zero_()
    assert [tuple(int(x) for x in t.flatten().tolist()) for t, _ in staged.pieces] == [
        tuple(range(0, 6)),
        tuple(range(6, 12)),
    ]
    assert all(t.untyped_storage().nbytes() == t.nbytes for t, _ in staged.pieces)
    import copy

    assert copy.deepcopy(staged) is staged
    assert isinstance(copy.deepcopy(view), ShardView)
