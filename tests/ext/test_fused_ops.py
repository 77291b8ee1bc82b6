"""megadlm_ext's fused transformer ops (rope, swiglu, add_rmsnorm and their backwards) on CPU,
through the compiled route and the reference route, against the unfused torch expressions the
model runs (tests/ext/fused_helpers.py): forward outputs and every gradient, fp32 within 1e-6,
bf16/fp16 within a tolerance from the dtype's epsilon. Strided (non-contiguous) q/k views,
sizes that are not a whole number of 16-byte vectors, batch-broadcast angles, angles whose
halves differ, empty inputs, thread-count independence of the weight gradient, and every
refused input with its message, on both routes."""

from __future__ import annotations

import pytest
import torch

import megadlm_ext as ext

from .fused_helpers import (
    check_fused,
    grads_of,
    rope_angles,
    unfused_add_rmsnorm,
    unfused_rope,
    unfused_swiglu,
)
from .helpers import DTYPES, ROUTES, route


def _qkv_view(B, S, G, per_group, D, dtype, seed=0):
    """q (a reshape: contiguous when G > 1) and k (a strided view) of a grouped qkv output, as
    SelfAttention splits it."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, S, G, (per_group + 2) * D, generator=g).to(dtype)
    q, k, _ = torch.split(qkv, [per_group * D, D, D], dim=-1)
    return q.reshape(B, S, G * per_group, D), k


ROPE_SHAPES = [  # B, S, G, per_group, D: vector path (D/2 % 8 == 0), odd half (scalar), MHA views
    (2, 5, 2, 2, 16),
    (1, 7, 3, 1, 6),
    (2, 3, 4, 1, 32),
]


@pytest.mark.parametrize("route_name", ROUTES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=str)
@pytest.mark.parametrize("angles", ["rotary", "general", "batch1"])
def test_rope_matches_unfused(route_name, dtype, shape, angles):
    B, S, G, per, D = shape
    q, k = _qkv_view(B, S, G, per, D, dtype)
    cos, sin = rope_angles(B, S, D, general=angles == "general", batch1=angles == "batch1")
    for x in (q, k):  # k is never contiguous; its strides are read as they are
        g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        (want,), (want_dx,) = grads_of(lambda t: unfused_rope(t, cos, sin), [x], [g])
        (truth,), (truth_dx,) = grads_of(
            lambda t: unfused_rope(t, cos.double(), sin.double()), [x.double()], [g.double()]
        )
        with route(route_name):
            got = ext.rope(x, cos, sin)
            got_dx = ext.rope(g, cos, sin, backward=True)
        assert got.is_contiguous()
        check_fused(got, want, truth, "rope forward")
        check_fused(got_dx, want_dx, truth_dx, "rope backward")


@pytest.mark.parametrize("route_name", ROUTES)
def test_rope_backward_is_the_inverse_rotation(route_name):
    """With RotaryEmbedding's angles (halves repeated) the backward undoes the forward."""
    x = torch.randn(2, 4, 3, 16, dtype=torch.float64).float()
    cos, sin = rope_angles(2, 4, 16)
    with route(route_name):
        back = ext.rope(ext.rope(x, cos, sin), cos, sin, backward=True)
    assert (back - x).abs().max() < 1e-6


@pytest.mark.parametrize("route_name", ROUTES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("F", [16, 13])  # a whole number of vectors, and not
def test_swiglu_matches_unfused(route_name, dtype, F):
    gen = torch.Generator().manual_seed(F)
    h = (torch.randn(3, 5, 2 * F, generator=gen) * 3).to(dtype)
    g = torch.randn(3, 5, F, generator=gen).to(dtype)
    (want,), (want_dh,) = grads_of(unfused_swiglu, [h], [g])
    (truth,), (truth_dh,) = grads_of(unfused_swiglu, [h.double()], [g.double()])
    with route(route_name):
        got, got_dh = ext.swiglu(h), ext.swiglu_backward(h, g)
    check_fused(got, want, truth, "swiglu forward")
    check_fused(got_dh, want_dh, truth_dh, "swiglu backward")


@pytest.mark.parametrize("route_name", ROUTES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("H", [64, 37])
def test_add_rmsnorm_matches_unfused(route_name, dtype, H):
    gen = torch.Generator().manual_seed(H)
    x, h = (torch.randn(2, 70, H, generator=gen).to(dtype) for _ in range(2))  # 140 rows: > one CPU block
    w = (1 + 0.5 * torch.randn(H, generator=gen)).to(dtype)
    g_sum, g_y = (torch.randn(2, 70, H, generator=gen).to(dtype) for _ in range(2))
    eps = 1e-5
    fn = lambda a, b, c: unfused_add_rmsnorm(a, b, c, eps)  # noqa: E731
    want, want_grads = grads_of(fn, [x, h, w], [g_sum, g_y])
    truth, truth_grads = grads_of(fn, [x.double(), h.double(), w.double()], [g_sum.double(), g_y.double()])
    with route(route_name):
        total, y, rstd = ext.add_rmsnorm(x, h, w, eps)
        grad_x, grad_w = ext.add_rmsnorm_backward(g_sum, g_y, total, w, rstd)
    assert torch.equal(total, want[0])  # the residual stream is bitwise x + h
    assert rstd.dtype == torch.float32 and rstd.shape == (2, 70)
    check_fused(y, want[1], truth[1], "add_rmsnorm y")
    check_fused(grad_x, want_grads[0], truth_grads[0], "add_rmsnorm grad x")
    check_fused(grad_x, want_grads[1], truth_grads[1], "add_rmsnorm grad h")
    check_fused(grad_w, want_grads[2], truth_grads[2], "add_rmsnorm grad weight")


def test_add_rmsnorm_weight_grad_does_not_depend_on_threads():
    gen = torch.Generator().manual_seed(3)
    s, gs, gy = (torch.randn(300, 48, generator=gen) for _ in range(3))
    w = torch.randn(48, generator=gen)
    _, _, rstd = ext.add_rmsnorm(s, torch.zeros_like(s), w, 1e-6)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext.add_rmsnorm_backward(gs, gy, s, w, rstd)
        torch.set_num_threads(2)
        two = ext.add_rmsnorm_backward(gs, gy, s, w, rstd)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@pytest.mark.parametrize("route_name", ROUTES)
def test_empty_inputs(route_name):
    with route(route_name):
        assert ext.rope(torch.zeros(0, 3, 2, 8), *rope_angles(0, 3, 8)).shape == (0, 3, 2, 8)
        assert ext.swiglu(torch.zeros(0, 8)).shape == (0, 4)
        assert ext.swiglu_backward(torch.zeros(0, 8), torch.zeros(0, 4)).shape == (0, 8)
        w = torch.randn(5)
        total, y, rstd = ext.add_rmsnorm(torch.zeros(0, 5), torch.zeros(0, 5), w, 1e-5)
        assert total.shape == y.shape == (0, 5) and rstd.shape == (0,)
        gx, gw = ext.add_rmsnorm_backward(total, total, total, w, rstd)
        assert gx.shape == (0, 5) and torch.equal(gw, torch.zeros(5))


def _bad_cases():
    x = torch.randn(2, 3, 4, 8)
    cos, sin = rope_angles(2, 3, 8)
    h = torch.randn(6, 8)
    w = torch.randn(8)
    r = torch.ones(6)
    t = torch.randn(6, 8)
    return {
        "rope x not a tensor": (lambda: ext.rope([1.0], cos, sin), "rope: x must be a tensor"),
        "rope int x": (lambda: ext.rope(x.long(), cos, sin), "rope: x has dtype"),
        "rope odd D": (lambda: ext.rope(x[..., :7], cos[..., :7], sin[..., :7]), "even D"),
        "rope 3-D x": (lambda: ext.rope(x[0], cos, sin), r"\[B, S, heads, D\]"),
        "rope bf16 cos": (lambda: ext.rope(x, cos.bfloat16(), sin), "rope: cos must be float32"),
        "rope cos shape": (lambda: ext.rope(x, cos[:, :2], sin), "rope: cos has shape"),
        "rope sin heads": (lambda: ext.rope(x, cos, sin.expand(2, 3, 4, 8)), "rope: sin has shape"),
        "swiglu odd": (lambda: ext.swiglu(torch.randn(3, 7)), "even last dim"),
        "swiglu strided": (lambda: ext.swiglu(h.t()), r"swiglu: h is not contiguous.*h.contiguous\(\)"),
        "swiglu grad shape": (lambda: ext.swiglu_backward(h, torch.randn(6, 8)), "grad_out has shape"),
        "swiglu grad dtype": (lambda: ext.swiglu_backward(h, torch.randn(6, 4).double()), "same dtype"),
        "norm h shape": (lambda: ext.add_rmsnorm(t, t[:3], w, 1e-5), "add_rmsnorm: h has shape"),
        "norm weight dtype": (lambda: ext.add_rmsnorm(t, t, w.bfloat16(), 1e-5), "weight is .*same dtype"),
        "norm weight size": (lambda: ext.add_rmsnorm(t, t, w[:5], 1e-5), "add_rmsnorm: weight has shape"),
        "norm eps": (lambda: ext.add_rmsnorm(t, t, w, 0.0), "eps must be a positive finite number"),
        "norm strided x": (lambda: ext.add_rmsnorm(t.t(), t.t(), w[:6], 1e-5), "x is not contiguous"),
        "norm bwd rstd": (lambda: ext.add_rmsnorm_backward(t, t, t, w, r.double()), "rstd must be the contiguous"),
        "norm bwd grad": (lambda: ext.add_rmsnorm_backward(t, t[:2], t, w, r), "grad_y has shape"),
    }  # fmt: skip


BAD = _bad_cases()


@pytest.mark.parametrize("route_name", ROUTES)
@pytest.mark.parametrize("case", list(BAD))
def test_refused_inputs_name_the_argument(route_name, case):
    call, message = BAD[case]
    with route(route_name), pytest.raises(ValueError, match=message):
        call()
