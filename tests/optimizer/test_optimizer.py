"""Single-process optimizer checks: loss scaler vs a hand-simulated sequence, clipping vs
torch.nn.utils.clip_grad_norm_, AdamW vs torch.optim.AdamW, the weight-decay rule,
fp16 skipped steps, and the checkpoint format."""

from __future__ import annotations

import copy

import pytest
import torch

from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig, Float16Module
from megadlms.optimizer import (
    DynamicGradScaler,
    OptimizerConfig,
    clip_grads_with_norm_,
    get_grad_norm_fp32,
    get_optimizer,
)

from .nets import SmallNet


def test_dynamic_scaler_hand_simulated():
    s = DynamicGradScaler(2.0**32, 1.0, growth_interval=3, hysteresis=2)
    # found_inf sequence and the scale after each update, worked out by hand:
    #  T: hysteresis 2->1, keep | T: 1->0, halve | F F F: third clean step grows, hysteresis
    #  refilled | T: 2->1 keep | T: 1->0 halve | T: -1, halve again | F: keep
    seq = [True, True, False, False, False, True, True, True, False]
    want = [2**32, 2**31, 2**31, 2**31, 2**32, 2**32, 2**31, 2**30, 2**30]
    got = []
    for f in seq:
        s.update(f)
        got.append(s.scale)
    assert got == want
    assert s.state_dict() == {"scale": 2.0**30, "growth_tracker": 1, "hysteresis_tracker": -1}
    low = DynamicGradScaler(2.0, 1.0, hysteresis=1)
    for _ in range(3):
        low.update(True)
    assert low.scale == 1.0  # never below min_loss_scale
    assert DynamicGradScaler().scale == 2.0**32 and DynamicGradScaler().growth_interval == 1000


@pytest.mark.parametrize("max_norm", [0.3, 1e6])
def test_clip_matches_torch(max_norm):
    torch.manual_seed(0)
    grads = [torch.randn(7, 5), torch.randn(3), torch.randn(1)]
    ref_params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ref_params, grads):
        p.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
    ours = [g.clone() for g in grads]
    norm = get_grad_norm_fp32(ours)
    clip_grads_with_norm_(ours, max_norm, norm)
    assert abs(norm - ref_norm.item()) <= 1e-6 * ref_norm.item()
    for o, p in zip(ours, ref_params):
        torch.testing.assert_close(o, p.grad, rtol=1e-6, atol=1e-7)


def _reference_adamw(model, lr, wd):
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in model.named_parameters() if p.dim() == 1 or n.endswith(".bias")]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}], lr=lr
    )


def test_adamw_steps_match_torch_and_weight_decay_groups():
    torch.manual_seed(0)
    model = SmallNet()
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(
        model, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=50)
    )
    opt = get_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5), ddp)
    ref_opt = _reference_adamw(ref, 1e-2, 0.1)
    groups = {g["weight_decay"]: g["params"] for g in opt.state_dict()["param_groups"]}
    assert groups == {
        0.1: ["fc1.weight", "fc2.weight"],
        0.0: ["fc1.bias", "norm.weight", "norm.bias", "fc2.bias"],
    }
    for step in range(5):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        ddp.finish_grad_sync()
        ok, norm = opt.step()
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item()
        ref_opt.step()
        assert ok and abs(norm - ref_norm) <= 1e-5 * ref_norm
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    opt.param_groups[0]["lr"] = 0.123  # the LR scheduler writes here
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.123


@pytest.mark.parametrize("distopt", [False, True])
def test_fp16_skips_overflow_and_backs_off(distopt):
    torch.manual_seed(0)
    base = SmallNet()
    model = Float16Module(copy.deepcopy(base), dtype=torch.float16)
    ddp = DistributedDataParallel(
        model, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distopt)
    )
    cfg = OptimizerConfig(
        lr=1e-2, fp16=True, clip_grad=0.0, initial_loss_scale=2.0**10, use_distributed_optimizer=distopt
    )
    opt = get_optimizer(cfg, ddp)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))

    captured = {}

    def run(poison: bool):
        opt.zero_grad()
        loss = ddp(x).pow(2).mean()
        if poison:
            loss = loss * float("inf")
        opt.scale_loss(loss).backward()
        ddp.finish_grad_sync()
        captured.update({n: p.main_grad.clone() for n, p in model.module.named_parameters()})
        return opt.step()

    before = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    assert run(True) == (False, float("inf")) and opt.get_loss_scale() == 2.0**10  # hysteresis 2
    assert run(True)[0] is False and opt.get_loss_scale() == 2.0**9  # backoff x0.5
    for n, p in model.module.named_parameters():
        assert torch.equal(p, before[n])  # skipped: untouched
    # A clean step: fp32 master = fp16 params, grad = fp16 model grad / scale, one AdamW step.
    master = {n: p.detach().float().clone().requires_grad_() for n, p in model.module.named_parameters()}
    ok, _ = run(False)
    assert ok
    fp32_grads = {n: g / 2.0**9 for n, g in captured.items()}
    for n, m in master.items():
        m.grad = fp32_grads[n]
    ref = _reference_adamw(_named(master), 1e-2, cfg.weight_decay)
    ref.step()
    sd = opt.state_dict()
    for n, m in master.items():
        torch.testing.assert_close(sd["state"][n]["fp32_param"], m.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(
            dict(model.module.named_parameters())[n].float(), m.detach().half().float()
        )
    assert sd["grad_scaler"]["scale"] == 2.0**9 and sd["step"] == 1


class _named(torch.nn.Module):
    """Wrap a name -> tensor dict as a module so the reference groups can use names."""

    def __init__(self, tensors) -> None:
        super().__init__()
        self._t = tensors

    def named_parameters(self, *a, **k):
        return iter(self._t.items())


def test_state_dict_round_trip_and_mismatch_message():
    torch.manual_seed(0)
    model = Float16Module(SmallNet(), dtype=torch.bfloat16)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    cfg = OptimizerConfig(lr=1e-2, bf16=True)
    opt = get_optimizer(cfg, ddp)
    for _step in range(2):
        opt.zero_grad()
        ddp(torch.randn(4, 6)).sum().backward()
        ddp.finish_grad_sync()
        assert opt.step()[0]
    sd = opt.state_dict()
    assert set(sd) == {"state", "step", "param_groups", "grad_scaler"} and sd["grad_scaler"] is None
    assert set(sd["state"]) == set(model.module.state_dict())  # unwrapped names
    for fqn, st in sd["state"].items():
        assert set(st) == {"exp_avg", "exp_avg_sq", "fp32_param"}
        assert st["exp_avg"].shape == dict(model.module.named_parameters())[fqn].shape
    model2 = Float16Module(SmallNet(), dtype=torch.bfloat16)
    model2.load_state_dict(model.state_dict())
    ddp2 = DistributedDataParallel(model2, DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    opt2 = get_optimizer(cfg, ddp2)
    opt2.load_state_dict(copy.deepcopy(sd))
    sd2 = opt2.state_dict()
    assert sd2["step"] == 2
    for fqn in sd["state"]:
        for k in sd["state"][fqn]:
            assert torch.equal(sd["state"][fqn][k], sd2["state"][fqn][k])
    x = torch.randn(4, 6)
    for o, d in ((opt, ddp), (opt2, ddp2)):
        o.zero_grad()
        d(x).sum().backward()
        d.finish_grad_sync()
        o.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)  # bitwise resume
    bad = copy.deepcopy(sd)
    del bad["state"]["fc1.weight"]
    with pytest.raises(RuntimeError, match="fc1.weight"):
        opt2.load_state_dict(bad)


def test_get_optimizer_validation():
    ddp = DistributedDataParallel(SmallNet())
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        get_optimizer(OptimizerConfig(lr=1.0, use_distributed_optimizer=True), ddp)
    frozen = SmallNet().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        get_optimizer(OptimizerConfig(lr=1.0), frozen)


def test_distributed_optimizer_single_rank_matches_torch():
    """No process group: the distributed optimizer's shard is the whole model."""
    torch.manual_seed(0)
    model = SmallNet()
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(
        model,
        DistributedDataParallelConfig(
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            bucket_size=100,
        ),
    )
    opt = get_optimizer(
        OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0, use_distributed_optimizer=True), ddp
    )
    ref_opt = _reference_adamw(ref, 1e-2, 0.1)
    assert len(ddp.buckets) > 1
    for step in range(3):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        ddp.finish_grad_sync()
        assert opt.step()[0]
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
    for (n, p), q in zip(model.state_dict().items(), ref.parameters()):
        torch.testing.assert_close(p, q.detach(), rtol=0, atol=1e-6, msg=n)
    assert opt.state_bytes() == 8 * sum(p.numel() for p in ref.parameters())


def test_reload_model_params_refreshes_fp32_main():
    model = Float16Module(SmallNet(), dtype=torch.bfloat16)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    opt = get_optimizer(OptimizerConfig(lr=1e-2, bf16=True), ddp)
    new = SmallNet()
    model.load_state_dict(new.state_dict())  # weights loaded after the optimizer
    opt.reload_model_params()
    for fqn, st in opt.state_dict()["state"].items():
        torch.testing.assert_close(st["fp32_param"], new.state_dict()[fqn].bfloat16().float(), rtol=0, atol=0)
