"""The fused transformer ops' CUDA kernels against the unfused torch ops on CUDA (needs a GPU;
the CPU routes and the emulated device code are tested in test_fused_ops.py and
test_fused_emulation.py). fp32 within 1e-6, bf16 by the dtype's epsilon (fused_helpers.py);
non-contiguous q/k views of a qkv projection, head dims 64 / 128 / 80 (vector builds) and 72
(scalar), hidden and ffn sizes that are not a whole number of 16-byte vectors, more rows than
the grid (grid-stride), a hidden size past 48 KiB of shared memory, a side stream, and the
model: fused vs unfused losses and gradients, and no neg / fewer cat kernels per step."""

from __future__ import annotations

import pytest
import torch

import megadlm_ext as ext

from .fused_helpers import check_fused, grads_of, unfused_add_rmsnorm, unfused_rope, unfused_swiglu

pytestmark = pytest.mark.gpu
DTYPES = (torch.float32, torch.bfloat16)


def _angles(B, S, D, batch1=False):
    pos = torch.arange(S, device="cuda", dtype=torch.float32)[None].expand(1 if batch1 else B, S)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
    emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)
    return emb.cos()[:, :, None, :], emb.sin()[:, :, None, :]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [64, 128, 80, 72])
@pytest.mark.parametrize("groups", [4, 16], ids=["gqa", "mha"])
def test_rope_kernel_matches_unfused(dtype, D, groups):
    B, S, N = 2, 300, 16
    per = N // groups
    qkv = torch.randn(B, S, groups * (per + 2) * D, device="cuda").to(dtype)  # a linear's output
    q, k, _ = torch.split(qkv.view(B, S, groups, (per + 2) * D), [per * D, D, D], dim=-1)
    for batch1 in (False, True):
        cos, sin = _angles(B, S, D, batch1)
        for x in (q.reshape(B, S, N, D), k):  # mha: q is a strided view too
            g = torch.randn(x.shape, device="cuda").to(dtype)
            (want,), (want_dx,) = grads_of(lambda t, c=cos, s_=sin: unfused_rope(t, c, s_), [x], [g])
            (truth,), (truth_dx,) = grads_of(
                lambda t, c=cos, s_=sin: unfused_rope(t, c.double(), s_.double()), [x.double()], [g.double()]
            )
            check_fused(ext.rope(x, cos, sin), want, truth, "rope forward")
            check_fused(ext.rope(g, cos, sin, backward=True), want_dx, truth_dx, "rope backward")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("F", [1536, 100, 13])
def test_swiglu_kernel_matches_unfused(dtype, F):
    h = (torch.randn(4, 257, 2 * F, device="cuda") * 3).to(dtype)
    g = torch.randn(4, 257, F, device="cuda").to(dtype)
    (want,), (want_dh,) = grads_of(unfused_swiglu, [h], [g])
    (truth,), (truth_dh,) = grads_of(unfused_swiglu, [h.double()], [g.double()])
    check_fused(ext.swiglu(h), want, truth, "swiglu forward")
    check_fused(ext.swiglu_backward(h, g), want_dh, truth_dh, "swiglu backward")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,H", [(4096, 2048), (700, 1001), (70_000, 16), (64, 16_384)])
def test_add_rmsnorm_kernel_matches_unfused(dtype, M, H):
    x, h, gs, gy = (torch.randn(M, H, device="cuda").to(dtype) for _ in range(4))
    w = (1 + 0.3 * torch.randn(H, device="cuda")).to(dtype)
    fn = lambda a, b, c: unfused_add_rmsnorm(a, b, c, 1e-5)  # noqa: E731
    want, want_grads = grads_of(fn, [x, h, w], [gs, gy])
    truth, truth_grads = grads_of(fn, [x.double(), h.double(), w.double()], [gs.double(), gy.double()])
    total, y, rstd = ext.add_rmsnorm(x, h, w, 1e-5)
    grad_x, grad_w = ext.add_rmsnorm_backward(gs, gy, total, w, rstd)
    assert torch.equal(total, want[0])
    check_fused(y, want[1], truth[1], "add_rmsnorm y")
    check_fused(grad_x, want_grads[0], truth_grads[0], "add_rmsnorm grad x")
    # fp32: a sum over M rows in another order than torch's (1e-6 holds per element, not per sum)
    check_fused(grad_w, want_grads[2], truth_grads[2], "add_rmsnorm grad weight", fp32_tol=1e-5)
    again = ext.add_rmsnorm_backward(gs, gy, total, w, rstd)  # deterministic: no atomics
    assert torch.equal(again[0], grad_x) and torch.equal(again[1], grad_w)


def test_kernels_run_on_the_current_stream():
    x, h = (torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    want = ext.add_rmsnorm(x, h, w, 1e-6)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = ext.add_rmsnorm(x, h, w, 1e-6)
        grads = ext.add_rmsnorm_backward(got[0], got[1], got[0], w, got[2])
    torch.cuda.current_stream().wait_stream(side)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(grads[1], ext.add_rmsnorm_backward(want[0], want[1], want[0], w, want[2])[1])


def _model_step(fused: bool, dtype=torch.float32):
    from megadlms.models import GPTModel, TransformerConfig

    cfg = TransformerConfig(
        num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2, vocab_size=512,
        seq_length=128, position_embedding_type="rope", swiglu=True, normalization="RMSNorm",
        add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0, apply_rope_fusion=fused,
        bias_swiglu_fusion=fused, residual_rmsnorm_fusion=fused,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPTModel(cfg).cuda().to(dtype)
    ids = torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(1)).cuda()

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(ids).float().square().mean()
        loss.backward()
        return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}

    return step


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_model_fused_matches_unfused_on_cuda(dtype):
    loss_u, grads_u = _model_step(False, dtype)()
    loss_f, grads_f = _model_step(True, dtype)()
    tol = 1e-6 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    assert abs(loss_f.item() - loss_u.item()) <= tol * abs(loss_u.item())
    if dtype == torch.float32:
        for n, g in grads_u.items():
            assert (grads_f[n] - g).abs().max() <= 1e-5 * g.abs().max().clamp_min(1.0), n


def _kernel_counts(step):
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {
        "neg": sum("neg_kernel" in n for n in names),
        "cat": sum("CatArray" in n for n in names),
        "megadlm": sum("megadlm_" in n for n in names),
    }


@pytest.mark.profiler
def test_fused_step_launches_no_neg_and_fewer_cats():
    unfused, fused = _kernel_counts(_model_step(False)), _kernel_counts(_model_step(True))
    # the unfused rotary embedding of q and k, per layer: a neg each way (4) and a cat forward (2);
    # other kernels of these kinds (if torch's own ops launch any) are the same in both steps
    assert unfused["neg"] - fused["neg"] >= 2 * 4
    assert unfused["cat"] - fused["cat"] >= 2 * 2
    # per layer: rope of q and k each way (4), swiglu each way (2), add_rmsnorm forward (1) and
    # backward (2: the rows, then the weight-gradient partials summed)
    assert fused["megadlm"] >= 2 * 9
