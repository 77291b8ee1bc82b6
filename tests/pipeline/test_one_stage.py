"""The one-stage schedule (no pipeline) against the plain gradient-accumulation loop it
replaced, and the step's scale factors against their definitions (one process)."""

from __future__ import annotations

import contextlib
import types
from dataclasses import astuple

import pytest
import torch

from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig, step_scales
from megadlms.distributed.finalize import bucket_fold_scales, fsdp2_reduction
from megadlms.pipeline import (
    forward_backward_no_pipelining,
    forward_backward_pipelining,
    get_forward_backward_func,
    stages_in_lockstep,
)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _pair(cfg):
    torch.manual_seed(0)
    a = _Net()
    b = _Net()
    b.load_state_dict(a.state_dict())
    return DistributedDataParallel(a, cfg), DistributedDataParallel(b, cfg)


def test_one_stage_schedule_is_the_accumulation_loop_bitwise():
    """Gradients, logged losses and no_sync use equal the loop the trainer's step ran before
    (forward and backward of every micro-batch but the last under no_sync)."""
    cfg = DistributedDataParallelConfig(
        calculate_per_token_loss=True, overlap_grad_reduce=True, bucket_size=64
    )
    ref, ddp = _pair(cfg)
    torch.manual_seed(1)
    micro = [torch.randn(3, 8) for _ in range(4)]
    scale, loss_scale = torch.tensor(1.0 / 12.0), 8.0

    ref_losses = []
    for i, x in enumerate(micro):
        with contextlib.nullcontext() if i == len(micro) - 1 else ref.no_sync():
            loss = ref(x).square().sum()
            ((loss * scale) * loss_scale).backward()
        ref_losses.append(loss.detach().double())
    ref.finish_grad_sync()

    entered = []

    def no_sync(c):
        entered.append(c)
        return ddp.no_sync()

    def forward_step(c, i, x):
        assert c == 0 and x is None
        loss = ddp(micro[i]).square().sum()
        return loss * scale, loss.detach().double()

    timeline = []
    losses = forward_backward_no_pipelining(
        ddp.chunks,
        micro,
        forward_step,
        backward_loss=lambda t: t * loss_scale,
        no_sync=no_sync,
        timeline=timeline,
    )
    ddp.finish_grad_sync()
    for (n, p), q in zip(ref.module.named_parameters(), ddp.module.parameters()):
        assert torch.equal(p.main_grad, q.main_grad), n
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert entered == [0] * (len(micro) - 1)
    assert [(e["kind"], e["micro"]) for e in timeline] == [(k, i) for i in range(4) for k in "FB"]

    # forward-only: the losses, no gradients, no backward
    ddp.zero_grad_buffer()
    with torch.no_grad():
        again = forward_backward_no_pipelining(ddp.chunks, micro, forward_step, forward_only=True)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, again))
    # no gradient was written: each bucket is zeroed, or its zeroing deferred with nothing
    # written over it (distributed/param_and_grad_buffer.py, Bucket.zero_or_defer)
    assert all(not b.written and (b.stale or not b.grad_data.any()) for b in ddp.buckets)


def test_schedule_choice_and_errors():
    assert get_forward_backward_func(1) is forward_backward_no_pipelining
    assert get_forward_backward_func(2) is forward_backward_pipelining
    assert not stages_in_lockstep(1) and stages_in_lockstep(4)
    net = _Net()
    with pytest.raises(ValueError, match="one model chunk"):
        forward_backward_no_pipelining([net, net], [None], lambda c, i, x: None)
    with pytest.raises(TypeError, match="loss_to_backprop"):
        forward_backward_no_pipelining([net], [None], lambda c, i, x: torch.zeros(()))


def test_step_scales_follow_their_definitions():
    """Sum mode: 1/N on the loss; averaging: dp/N (the wrapper divides by dp); the aux
    scale is loss_scale * dp / micro-batches; the optimizer undoes the loss scale."""
    tokens = torch.tensor(96.0, dtype=torch.float64)
    micro = torch.tensor(6.0, dtype=torch.float64)
    for per_token, dp in ((True, 3), (False, 3), (False, 1)):
        cfg = DistributedDataParallelConfig(calculate_per_token_loss=per_token)
        model = types.SimpleNamespace(ddp_config=cfg, comm=types.SimpleNamespace(world_size=dp))
        s = step_scales(model, tokens, micro, 4.0)
        k = 1 if per_token else dp
        assert s.loss.dtype == torch.float32 and s.loss.item() == pytest.approx(k / 96.0)
        assert s.moe_aux.item() == pytest.approx(4.0 * k / 6.0)
        assert s.grad_unscale * s.loss_scale == 1.0
        assert torch.equal(s.backward_loss(torch.tensor(2.0)), torch.tensor(8.0))


def test_reduction_factors():
    sum_mode = DistributedDataParallelConfig(calculate_per_token_loss=True)
    avg_mode = DistributedDataParallelConfig(calculate_per_token_loss=False)
    assert bucket_fold_scales(sum_mode, 4, 2, avg=False) == (1.0, 1.0)
    assert bucket_fold_scales(avg_mode, 4, 2, avg=False) == (0.25, 0.25)
    assert bucket_fold_scales(avg_mode, 4, 2, avg=True) == (1.0, 0.5)
    assert astuple(fsdp2_reduction(sum_mode, 4, backend_sums_avg=False, can_force_sum=True)) == (
        1.0,
        True,
        1.0,
    )
    assert astuple(fsdp2_reduction(avg_mode, 4, backend_sums_avg=False, can_force_sum=True)) == (
        None,
        False,
        1.0,
    )
    assert astuple(fsdp2_reduction(avg_mode, 4, backend_sums_avg=True, can_force_sum=True)) == (
        None,
        True,
        1.0,
    )
    assert astuple(fsdp2_reduction(avg_mode, 4, backend_sums_avg=True, can_force_sum=False)) == (
        None,
        False,
        0.25,
    )
