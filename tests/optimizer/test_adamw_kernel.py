"""The fused AdamW step (megadlm_ext.adamw_step) inside the optimizers: PrecisionAwareAdamW's
fused route against its per-parameter Python step for every unscaled storage combination
(bounds from the dtype's epsilon), CPU left on the Python step by default (bitwise), the
scaled codecs left on it always, state and checkpoints unchanged, and
``OptimizerConfig.fused_adam="megadlm"`` for fp32 state (close to torch's AdamW, bitwise
resume). GPU: the default CUDA route is the fused one, one call per param group."""

from __future__ import annotations

import copy

import pytest
import torch

import megadlm_ext
from megadlms.optimizer import OptimizerConfig, PrecisionAwareAdamW, get_optimizer

from .nets import SmallNet

LR, WD, BETAS, EPS, STEPS = 1e-2, 0.1, (0.9, 0.999), 1e-8, 6
SHAPES = [(64, 33), (33,), (7,), (0,), (1000,)]


def _grads(dtype, device="cpu"):
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(s, generator=g) * 1e-3).to(dtype).to(device) for s in SHAPES] for _ in range(STEPS)]


def _run(kernel, mdt, vdt, gdt, device="cpu"):
    """STEPS steps of PrecisionAwareAdamW; bf16 grads handed over as ``decoupled_grad`` (what
    the layouts do for --main-grads-dtype bf16)."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s).to(device)) for s in SHAPES]
    groups = [{"params": ps[:3]}, {"params": ps[3:], "weight_decay": 0.0}]
    opt = PrecisionAwareAdamW(
        groups,
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
        exp_avg_dtype=mdt,
        exp_avg_sq_dtype=vdt,
        kernel=kernel,
    )
    for grads in _grads(gdt, device):
        for p, g in zip(ps, grads):
            if gdt == torch.float32:
                p.grad = g.clone()
            else:
                p.decoupled_grad = g.clone()
        opt.step()
    return ps, opt


@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "mdt,vdt", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float32, torch.bfloat16)]
)
def test_fused_route_follows_the_python_step(gdt, mdt, vdt):
    fused_ps, fused = _run("megadlm", mdt, vdt, gdt)
    ref_ps, ref = _run("python", mdt, vdt, gdt)
    # The two steps order their fp32 operations differently (torch's single-tensor step uses
    # lerp and addcdiv): a few fp32 ulps per step, which may flip a rounding of a stored
    # moment by one ulp of its dtype; a moment keeps a flip at most decayed by beta per step.
    # So a stored moment is within STEPS ulps (eps * |x|) of the other, and the param's update
    # (lr / bc1 * m / denom, |m / denom| ~ 1 after bias correction) within lr * STEPS * eps.
    for p, q in zip(fused_ps, ref_ps):
        sp, sq = fused.state[p], ref.state[q]
        assert sp.keys() == sq.keys() and float(sp["step"]) == float(sq["step"]) == STEPS
        for key, dt in (("exp_avg", mdt), ("exp_avg_sq", vdt)):
            a, b = sp[key], sq[key]
            assert a.dtype == b.dtype == dt
            eps = torch.finfo(dt).eps if dt != torch.float32 else 1e-6
            scale = float(b.float().abs().max()) if b.numel() else 0.0
            assert bool(((a.float() - b.float()).abs() <= STEPS * eps * (b.float().abs() + scale)).all()), key
        eps = max(torch.finfo(mdt).eps, torch.finfo(vdt).eps) if mdt != vdt or mdt != torch.float32 else 1e-6
        assert bool(((p - q).abs() <= 1e-6 * q.abs() + LR * STEPS * eps).all())


def test_default_keeps_cpu_on_the_python_step(monkeypatch):
    """kernel="auto" on CPU: never the fused step, so CPU curves stay bitwise."""
    want, _ = _run("python", torch.bfloat16, torch.bfloat16, torch.bfloat16)

    def refuse(*a, **k):
        raise AssertionError("the fused step ran on CPU by default")

    monkeypatch.setattr(megadlm_ext, "adamw_step", refuse)
    got, opt = _run("auto", torch.bfloat16, torch.bfloat16, torch.bfloat16)
    assert opt.kernel == "auto" and all(torch.equal(a, b) for a, b in zip(got, want))


def test_scaled_codecs_keep_the_python_step():
    for kw in (
        dict(exp_avg_dtype=torch.float16),
        dict(exp_avg_sq_dtype=torch.uint8),
        dict(master_dtype=torch.float16),
    ):
        opt = PrecisionAwareAdamW(
            [torch.nn.Parameter(torch.ones(3))],
            lr=LR,
            betas=BETAS,
            eps=EPS,
            weight_decay=0.0,
            kernel="megadlm",
            **kw,
        )  # noqa: E501
        assert opt.kernel == "python", kw
    with pytest.raises(ValueError, match="kernel must be one of auto, megadlm, python"):
        PrecisionAwareAdamW(
            [torch.nn.Parameter(torch.ones(3))], lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, kernel="x"
        )  # noqa: E501


def test_state_access_is_unchanged_by_the_fused_route():
    ps, opt = _run("megadlm", torch.bfloat16, torch.float32, torch.float32)
    p = ps[0]
    assert (
        opt.stored(p, "exp_avg").dtype == torch.bfloat16 and opt.export_dtype("exp_avg_sq") == torch.float32
    )
    opt.load_value(p, "exp_avg", torch.full(p.shape, 1 / 3))
    assert torch.equal(opt.state[p]["exp_avg"], torch.full(p.shape, 1 / 3).to(torch.bfloat16))


# ------------------------------------------------------------------ fused_adam="megadlm", fp32 state


def _build(fused, seed=0, distopt=False):
    from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig, Float16Module

    torch.manual_seed(seed)
    model = Float16Module(SmallNet(), dtype=torch.bfloat16)
    ddp = DistributedDataParallel(
        model,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=distopt, bucket_size=40
        ),
    )
    cfg = OptimizerConfig(
        lr=1e-2, weight_decay=0.1, bf16=True, use_distributed_optimizer=distopt, fused_adam=fused
    )
    return model, ddp, get_optimizer(cfg, ddp)


def _steps(ddp, opt, seeds):
    norms = []
    for s in seeds:
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(s))
        opt.zero_grad()
        ddp(x).float().pow(2).mean().backward()
        ddp.finish_grad_sync()
        ok, norm = opt.step()
        assert ok
        norms.append(norm)
    return norms


@pytest.mark.parametrize("distopt", [False, True])
def test_fused_adam_megadlm_with_fp32_state(distopt):
    model_ref, ddp_ref, opt_ref = _build(None, distopt=distopt)
    model, ddp, opt = _build("megadlm", distopt=distopt)
    assert isinstance(opt.inner, PrecisionAwareAdamW) and opt.inner.kernel == "megadlm"
    assert _steps(ddp, opt, range(3)) == pytest.approx(_steps(ddp_ref, opt_ref, range(3)), rel=1e-5)
    sd, sd_ref = opt.state_dict(), opt_ref.state_dict()
    for fqn, st in sd_ref["state"].items():  # the same checkpoint format: keys, dtypes
        assert {k: v.dtype for k, v in sd["state"][fqn].items()} == {k: v.dtype for k, v in st.items()}
        torch.testing.assert_close(sd["state"][fqn]["fp32_param"], st["fp32_param"], rtol=0, atol=1e-6)

    sd = copy.deepcopy(sd)  # a round trip resumes bitwise
    model2, ddp2, opt2 = _build("megadlm", seed=1, distopt=distopt)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(sd)
    _steps(ddp, opt, [7]), _steps(ddp2, opt2, [7])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))

    model3, ddp3, opt3 = _build("megadlm", seed=2, distopt=distopt)  # torch's checkpoint loads
    model3.load_state_dict(model_ref.state_dict())
    opt3.load_state_dict(copy.deepcopy(opt_ref.state_dict()))
    assert _steps(ddp3, opt3, [7]) == pytest.approx(_steps(ddp_ref, opt_ref, [7]), rel=1e-5)


def test_fused_adam_values_are_checked():
    with pytest.raises(ValueError, match="fused_adam must be None, True, False or 'megadlm', got 'apex'"):
        OptimizerConfig(lr=1e-3, fused_adam="apex")
    with pytest.raises(ValueError, match="fused_adam=True is torch's fused AdamW"):
        OptimizerConfig(lr=1e-3, use_precision_aware_optimizer=True, exp_avg_dtype="bf16", fused_adam=True)
    cfg = OptimizerConfig(lr=1e-3, use_precision_aware_optimizer=True, exp_avg_dtype="bf16", fused_adam=False)
    assert cfg.fused_adam is False
    from megadlms.optimizer import dtensor_problems  # FSDP2's DTensors: our kernel steps plain tensors

    assert "fused_adam='megadlm'" in dtensor_problems(OptimizerConfig(lr=1e-3, fused_adam="megadlm"))[0]


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16])
def test_cuda_default_is_the_fused_step(monkeypatch, gdt):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    calls = []
    real = megadlm_ext.adamw_step
    monkeypatch.setattr(megadlm_ext, "adamw_step", lambda *a, **k: (calls.append(len(a[0])), real(*a, **k)))
    got, opt = _run("auto", torch.bfloat16, torch.bfloat16, gdt, device="cuda")
    assert calls == [3, 2] * STEPS  # one call per param group and step
    want, ref = _run("python", torch.bfloat16, torch.bfloat16, gdt)
    eps = torch.finfo(torch.bfloat16).eps
    for p, q in zip(got, want):
        assert bool(((p.cpu() - q).abs() <= 1e-6 * q.abs() + LR * STEPS * eps).all())
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16 and opt.state[p]["exp_avg"].is_cuda
