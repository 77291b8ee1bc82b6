"""The optimizer's TensorTables of the grad lists (optimizer/grad_tables.py) and the distributed
optimizer's cast tables: bitwise the list path's steps; kept across steps exactly when the
grads are DDP buffer views, released when they are per-step copies; rebuilt when the list
changes."""

from __future__ import annotations

import copy

import pytest
import torch

import megadlm_ext as ext
from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig, Float16Module
from megadlms.optimizer import OptimizerConfig, get_optimizer
from megadlms.optimizer.grad_tables import GradTables

from .nets import SmallNet

# name -> (model dtype or None, DDP config kwargs or None for a plain module, optimizer kwargs,
#          whether the grads the optimizer sees are the buffer views themselves)
SETUPS = {
    "fp32": (None, {}, {}, True),
    "bf16, fp32 grads": (torch.bfloat16, {"grad_reduce_in_fp32": True}, {"bf16": True}, True),
    "bf16, bf16 grads (copies)": (torch.bfloat16, {}, {"bf16": True}, False),
    "fp16, loss scaling": (torch.float16, {"grad_reduce_in_fp32": True}, {"fp16": True}, True),
    "distopt, bf16": (
        torch.bfloat16,
        {"grad_reduce_in_fp32": True, "use_distributed_optimizer": True, "bucket_size": 100},
        {"bf16": True, "use_distributed_optimizer": True},
        True,
    ),
    "distopt, bf16 grads (copies)": (
        torch.bfloat16,
        {"use_distributed_optimizer": True},
        {"bf16": True, "use_distributed_optimizer": True},
        False,
    ),
    "plain module": (None, None, {}, False),
}


def _build(setup, base):
    dtype, ddp_kw, opt_kw, _ = SETUPS[setup]
    model = copy.deepcopy(base)
    if dtype is not None:
        model = Float16Module(model, dtype=dtype)
    wrapped = (
        model if ddp_kw is None else DistributedDataParallel(model, DistributedDataParallelConfig(**ddp_kw))
    )
    # clip_grad small enough that every step clips: scale_ runs on the clip list too
    cfg = OptimizerConfig(lr=1e-2, clip_grad=0.05, initial_loss_scale=2.0**8, **opt_kw)
    return wrapped, get_optimizer(cfg, wrapped)


def _step(wrapped, opt, step):
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
    opt.zero_grad()
    loss = wrapped(x).float().pow(2).mean()
    opt.scale_loss(loss).backward()
    if hasattr(wrapped, "finish_grad_sync"):
        wrapped.finish_grad_sync()
    return opt.step()


class _Lists(GradTables):
    """The list path: every op parses the list, as before tables."""

    def get(self, name, tensors):
        return tensors


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_steps_bitwise_equal_to_lists_and_tables_kept_when_views(setup):
    torch.manual_seed(0)
    base = SmallNet()
    ours, opt = _build(setup, base)
    lists, opt_lists = _build(setup, base)
    opt_lists._grad_tables = _Lists()
    seen = []
    for step in range(4):
        a, b = _step(ours, opt, step), _step(lists, opt_lists, step)
        assert a == b, step  # (success, grad norm): the same floats
        seen.append(dict(opt._grad_tables._tables))
    for p, q in zip(ours.parameters(), lists.parameters()):
        assert torch.equal(p, q)
    persist = SETUPS[setup][3]
    assert opt.layout.grads_persist is persist
    norm = [s["norm"] for s in seen]
    assert all(t is norm[0] for t in norm) is persist  # one table for every step, or one per step
    assert all(s["clip"] is s["norm"] for s in seen)  # the clip list is the norm list
    if "fp16" in setup:
        assert all(s["grads"] is s["norm"] for s in seen)
    opt.zero_grad()
    assert bool(opt._grad_tables._tables) is persist  # copies are not kept past the step


def test_tables_rebuilt_when_the_grads_change():
    """A parameter without a gradient this step: another list, another table; never the old one."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(SmallNet())
    opt = get_optimizer(OptimizerConfig(lr=1e-2, clip_grad=0.05), ddp)
    _step(ddp, opt, 0)
    first = opt._grad_tables._tables["norm"]
    assert len(first) == 6
    opt.zero_grad()
    x = torch.randn(8, 6)
    # only fc2 gets a gradient: DDP still reports zeros for the others (its buffer views) ...
    ddp.module.fc2(torch.randn(8, 12)).pow(2).mean().backward()
    ddp.finish_grad_sync()
    opt.step()
    assert opt._grad_tables._tables["norm"] is first and first.matches(opt.layout.collect_grads())
    # ... but a layout that drops a parameter hands over a shorter list: rebuilt
    opt.layout.entries = opt.layout.entries[2:]
    opt.zero_grad()
    ddp(x).pow(2).mean().backward()
    ddp.finish_grad_sync()
    opt.step()
    second = opt._grad_tables._tables["norm"]
    assert second is not first and len(second) == 4 and second.matches(opt.layout.collect_grads())


def test_distributed_optimizer_cast_tables_built_once():
    torch.manual_seed(0)
    model = Float16Module(SmallNet(), dtype=torch.bfloat16)
    ddp = DistributedDataParallel(
        model,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True, bucket_size=100
        ),
    )
    opt = get_optimizer(OptimizerConfig(lr=1e-2, bf16=True, use_distributed_optimizer=True), ddp)
    tables = opt.layout._cast_tables
    assert len(tables) == len(ddp.buckets) > 1
    for step in range(3):
        _step(ddp, opt, step)
    for bucket, table in tables:
        table.validate()  # the pieces never moved
        mains = list(table.tensors)
        want = bucket.param_data.clone()
        ext.flatten(mains, want, offsets=table.offsets)  # the list path: the same bytes
        assert torch.equal(want, bucket.param_data)
        if isinstance(table, ext._C.TensorTable):
            hits, misses, _ = table._cache_stats()
            assert (hits, misses) == (2, 1)  # built at the first of the 3 casts, then looked up


def test_ddp_whole_buffer_tables():
    ddp = DistributedDataParallel(SmallNet(), DistributedDataParallelConfig(bucket_size=100))
    assert ddp._buffers_table.matches([b.grad_data for b in ddp.buffers_])
    for bucket in ddp.buckets:
        assert bucket.grad_table.matches([bucket.grad_data])
    ddp(torch.randn(4, 6)).sum().backward()
    ddp.finish_grad_sync()
    before = [b.grad_data.clone() for b in ddp.buffers_]
    ddp.scale_gradients(0.5)
    for b, old in zip(ddp.buffers_, before):
        assert torch.equal(b.grad_data, old * 0.5)
