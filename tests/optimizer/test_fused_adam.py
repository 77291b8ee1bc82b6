"""torch's fused AdamW kernel inside the mixed-precision optimizer (OptimizerConfig.fused_adam):
chosen on CUDA by default and never on CPU (CPU numbers unchanged); forced on CPU it follows the
default step within float tolerance, keeps its step counters where torch's fused kernel wants
them (fp32, on the param's device) through a checkpoint round trip, and resumes bitwise."""

from __future__ import annotations

import copy

import pytest
import torch

from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig, Float16Module
from megadlms.optimizer import OptimizerConfig, get_optimizer

from .nets import SmallNet


def _build(fused, distopt, device="cpu", seed=0):
    torch.manual_seed(seed)
    model = Float16Module(SmallNet().to(device), dtype=torch.bfloat16)
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distopt, bucket_size=40
    )
    ddp = DistributedDataParallel(model, ddp_cfg)
    cfg = OptimizerConfig(
        lr=1e-2, weight_decay=0.1, bf16=True, use_distributed_optimizer=distopt, fused_adam=fused
    )
    return model, ddp, get_optimizer(cfg, ddp)


def _steps(ddp, opt, seeds, device="cpu"):
    norms = []
    for s in seeds:
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(s)).to(device)
        opt.zero_grad()
        ddp(x).float().pow(2).mean().backward()
        ddp.finish_grad_sync()
        ok, norm = opt.step()
        assert ok
        norms.append(norm)
    return norms


def _fused_flags(opt):
    return {bool(g.get("fused")) for g in opt.inner.param_groups}


def test_cpu_default_keeps_torchs_default_step():
    _, _, opt = _build(None, distopt=False)
    assert _fused_flags(opt) == {False}


@pytest.mark.parametrize("distopt", [False, True])
def test_forced_fused_on_cpu_follows_default_and_resumes_bitwise(distopt):
    model_ref, ddp_ref, opt_ref = _build(None, distopt)
    model, ddp, opt = _build(True, distopt)
    assert _fused_flags(opt) == {True}
    norms_ref, norms = _steps(ddp_ref, opt_ref, range(3)), _steps(ddp, opt, range(3))
    assert norms == pytest.approx(norms_ref, rel=1e-5)
    fp32 = {k: v["fp32_param"] for k, v in opt.state_dict()["state"].items()}
    for k, v in opt_ref.state_dict()["state"].items():
        torch.testing.assert_close(fp32[k], v["fp32_param"], rtol=0, atol=1e-6)

    # A checkpoint round trip: the rebuilt step counters are what torch's fused kernel makes.
    sd = copy.deepcopy(opt.state_dict())
    model2, ddp2, opt2 = _build(True, distopt, seed=1)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(sd)
    steps = [st["step"] for st in opt2.inner.state.values()]
    assert steps and all(s.dtype == torch.float32 and s.device.type == "cpu" and float(s) == 3 for s in steps)
    _steps(ddp, opt, [7]), _steps(ddp2, opt2, [7])
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)  # bitwise resume

    # A checkpoint written by the default step loads into the fused one (and continues close).
    model3, ddp3, opt3 = _build(True, distopt, seed=2)
    model3.load_state_dict(model_ref.state_dict())
    opt3.load_state_dict(copy.deepcopy(opt_ref.state_dict()))
    assert _steps(ddp3, opt3, [7]) == pytest.approx(_steps(ddp_ref, opt_ref, [7]), rel=1e-5)


@pytest.mark.gpu
def test_cuda_default_is_fused_and_close_to_foreach():
    _, ddp_f, opt_f = _build(None, distopt=True, device="cuda")
    _, ddp_e, opt_e = _build(False, distopt=True, device="cuda")
    assert _fused_flags(opt_f) == {True} and _fused_flags(opt_e) == {False}
    norms_f = _steps(ddp_f, opt_f, range(3), "cuda")
    norms_e = _steps(ddp_e, opt_e, range(3), "cuda")
    assert norms_f == pytest.approx(norms_e, rel=1e-5)
    sd_f, sd_e = opt_f.state_dict()["state"], opt_e.state_dict()["state"]
    for k in sd_f:
        torch.testing.assert_close(sd_f[k]["fp32_param"], sd_e[k]["fp32_param"], rtol=0, atol=1e-6)
    opt_f.load_state_dict(copy.deepcopy(opt_f.state_dict()))
    assert all(st["step"].is_cuda for st in opt_f.inner.state.values())
