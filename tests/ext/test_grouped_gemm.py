"""megadlm_ext.grouped_gemm and megadlms.ops.grouped_matmul (the MoE experts' grouped GEMM)
against a loop of per-expert torch matmuls: both routes, fp32/bf16/fp16, experts with no
tokens, the three GEMMs of forward and backward, autograd, gradient-accumulation fusion,
argument errors; the cuBLAS argument mapping of csrc/cuda/grouped_gemm.cu through a host
emulation of cublasGemmEx; the CUDA route against the CPU one (GPU only)."""

import ctypes

import pytest
import torch

import megadlm_ext
from megadlms.ops import grouped_matmul

from .conftest import CXX, cublas_headers
from .helpers import DTYPES, ROUTES, route

SIZES = ([5, 0, 7, 1], [0, 0, 3], [4], [0, 0], [2, 9, 0, 0, 6])


def _loop(a, b, sizes, trans_a=False, trans_b=False):
    """The per-group loop in float64 (the expectation)."""
    outs, row = [], 0
    for g, rows in enumerate(sizes):
        ag = a[row : row + rows].double()
        if trans_a:
            outs.append(ag.t() @ b[row : row + rows].double())
        else:
            bg = b[g].double()
            outs.append(ag @ (bg.t() if trans_b else bg))
        row += rows
    return torch.stack(outs) if trans_a else torch.cat(outs)


def _tol(dtype, k):
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-5 * k**0.5)
    # fp32 accumulation, one rounding into the 16-bit output
    eps = 2**-8 if dtype == torch.bfloat16 else 2**-11
    return dict(rtol=eps, atol=eps * k**0.5)


def _ab(sizes, k, n, dtype, trans_a=False, trans_b=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(sizes)
    a = torch.randn(t, k, generator=g).to(dtype)
    if trans_a:
        b = torch.randn(t, n, generator=g).to(dtype)
    else:
        b = torch.randn(len(sizes), *((n, k) if trans_b else (k, n)), generator=g).to(dtype)
    return a, b, torch.tensor(sizes, dtype=torch.int64)


@pytest.mark.parametrize("route_name", ROUTES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("mode", ["fwd", "dgrad", "wgrad"])
def test_matches_per_expert_loop(route_name, dtype, sizes, mode):
    trans_a, trans_b = mode == "wgrad", mode == "fwd"
    a, b, bs = _ab(sizes, 13, 6, dtype, trans_a, trans_b)
    with route(route_name):
        out = megadlm_ext.grouped_gemm(a, b, bs, trans_a=trans_a, trans_b=trans_b)
    assert out.dtype == dtype
    want = _loop(a, b, sizes, trans_a, trans_b)
    assert out.shape == want.shape
    torch.testing.assert_close(out.double(), want, **_tol(dtype, max(sizes + [13]) if trans_a else 13))
    if trans_a:  # experts with no token: exact zeros, not uninitialised memory
        for g, rows in enumerate(sizes):
            if rows == 0:
                assert torch.equal(out[g], torch.zeros_like(out[g]))


@pytest.mark.parametrize("route_name", ROUTES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_wgrad_accumulates_into_fp32_out_with_alpha(route_name, dtype):
    sizes = [3, 0, 8]
    a, b, bs = _ab(sizes, 5, 4, dtype, trans_a=True, seed=3)
    base = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(4))
    out = base.clone()
    with route(route_name):
        res = megadlm_ext.grouped_gemm(a, b, bs, trans_a=True, out=out, accumulate=True, alpha=0.25)
    assert res is out or res.data_ptr() == out.data_ptr()
    want = base.double() + 0.25 * _loop(a, b, sizes, trans_a=True)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[1], base[1])  # no token: main_grad untouched


def test_compiled_equals_reference_fp32_bitwise_shape_and_zero_rows():
    a, b, bs = _ab([0, 0, 0], 4, 3, torch.float32, trans_b=True)
    out = megadlm_ext.grouped_gemm(a, b, bs, trans_b=True)
    assert out.shape == (0, 3)
    a, b, bs = _ab([0, 0], 4, 3, torch.float32, trans_a=True)
    for name in ROUTES:
        with route(name):
            assert torch.equal(megadlm_ext.grouped_gemm(a, b, bs, trans_a=True), torch.zeros(2, 4, 3))


@pytest.mark.parametrize("route_name", ROUTES)
@pytest.mark.parametrize(
    "call,match",
    [
        (lambda a, b, bs: megadlm_ext.grouped_gemm(a, b, bs[:2], trans_b=True), "batch_sizes sum to|b \\["),
        (lambda a, b, bs: megadlm_ext.grouped_gemm(a, b, bs.int(), trans_b=True), "int64 cpu tensor"),
        (lambda a, b, bs: megadlm_ext.grouped_gemm(a, b.bfloat16(), bs, trans_b=True), "same dtype"),
        (lambda a, b, bs: megadlm_ext.grouped_gemm(a, b, bs), "must be \\[3, 4, n\\]"),
        (lambda a, b, bs: megadlm_ext.grouped_gemm(a.t(), b, bs, trans_b=True), "must be 2-D|contiguous"),
        (lambda a, b, bs: megadlm_ext.grouped_gemm(a, b, -bs, trans_b=True), "negative"),
        (lambda a, b, bs: megadlm_ext.grouped_gemm(a, b, bs, trans_b=True, accumulate=True), "needs out"),
        (
            lambda a, b, bs: megadlm_ext.grouped_gemm(a, b, bs, trans_b=True, out=torch.empty(2, 2)),
            "out must be a contiguous",
        ),
    ],
)
def test_errors_name_the_argument(route_name, call, match):
    a, b, bs = _ab([2, 1, 3], 4, 5, torch.float32, trans_b=True)
    with route(route_name), pytest.raises(ValueError, match=match):
        call(a, b, bs)


def _loop_matmul(x, w, sizes):
    return torch.cat([xe @ w[e].t() for e, xe in enumerate(torch.split(x, sizes))])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", [[5, 0, 7, 1], [0, 6, 0]])
def test_grouped_matmul_autograd_matches_loop(dtype, sizes):
    g = torch.Generator().manual_seed(7)
    x0 = torch.randn(sum(sizes), 12, generator=g)
    w0 = torch.randn(len(sizes), 10, 12, generator=g) * 0.3
    dy = torch.randn(sum(sizes), 10, generator=g)
    x, w = x0.to(dtype).clone().requires_grad_(), w0.to(dtype).clone().requires_grad_()
    y = grouped_matmul(x, w, torch.tensor(sizes))
    y.backward(dy.to(dtype))
    xr, wr = x0.to(dtype).double().detach().requires_grad_(), w0.to(dtype).double().detach().requires_grad_()
    yr = _loop_matmul(xr, wr, sizes)
    yr.backward(dy.to(dtype).double())
    tol = _tol(dtype, 12)
    torch.testing.assert_close(y.double(), yr, **tol)
    torch.testing.assert_close(x.grad.double(), xr.grad, **_tol(dtype, 10))
    torch.testing.assert_close(w.grad.double(), wr.grad, **_tol(dtype, max(sizes)))
    assert w.grad.dtype == dtype and x.grad.dtype == dtype
    for e, n in enumerate(sizes):
        if n == 0:
            assert torch.equal(w.grad[e], torch.zeros_like(w.grad[e]))


def test_grouped_matmul_fp32_equals_torch_loop_closely_and_gradcheck_style():
    sizes = [3, 0, 4]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 5, generator=g, requires_grad=True)
    w = torch.randn(3, 4, 5, generator=g, requires_grad=True)
    # directional derivative check against central differences in fp32 of the loop
    y = grouped_matmul(x, w, torch.tensor(sizes))
    v = torch.randn_like(y)
    (y * v).sum().backward()
    dx, dw = torch.randn_like(x), torch.randn_like(w)
    eps = 1e-2
    with torch.no_grad():
        f = lambda xx, ww: float((_loop_matmul(xx.double(), ww.double(), sizes) * v.double()).sum())  # noqa: E731
        num = (f(x + eps * dx, w + eps * dw) - f(x - eps * dx, w - eps * dw)) / (2 * eps)
    ana = float((x.grad * dx).sum() + (w.grad * dw).sum())
    assert abs(num - ana) < 1e-4 * max(1.0, abs(num))


def test_grouped_matmul_gradient_accumulation_fusion_writes_main_grad():
    sizes = [2, 0, 5]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 6, generator=g).bfloat16().requires_grad_()
    w = torch.randn(3, 4, 6, generator=g).bfloat16().requires_grad_()
    w.main_grad = torch.randn(3, 4, 6, generator=g)
    base = w.main_grad.clone()
    dy = torch.randn(7, 4, generator=g).bfloat16()
    y = grouped_matmul(x, w, torch.tensor(sizes), gradient_accumulation_fusion=True, layer_name="experts.fc1")
    y.backward(dy)
    assert w.grad_added_to_main_grad is True
    want = base.double() + _loop(dy, x, sizes, trans_a=True)
    torch.testing.assert_close(w.main_grad.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(w.main_grad[1], base[1])
    torch.testing.assert_close(x.grad.double(), _loop(dy, w, sizes), **_tol(torch.bfloat16, 4))
    w2 = torch.randn(3, 4, 6).requires_grad_()
    with pytest.raises(RuntimeError, match="experts.fc2.*--gradient-accumulation-fusion"):
        grouped_matmul(
            x.detach().float(),
            w2,
            torch.tensor(sizes),
            gradient_accumulation_fusion=True,
            layer_name="experts.fc2",
        )


def test_grouped_matmul_checks_tokens_per_expert():
    x, w = torch.randn(4, 3), torch.randn(2, 5, 3)
    with pytest.raises(ValueError, match="w has 2 experts"):
        grouped_matmul(x, w, torch.tensor([4]))
    with pytest.raises(ValueError, match="int64"):
        grouped_matmul(x, w, torch.tensor([2.0, 2.0]))
    with pytest.raises(ValueError, match="sum to 3 but a has 4 rows"):
        grouped_matmul(x, w, torch.tensor([1, 2]))


@pytest.fixture(scope="module")
def cublas_emu(shims):
    if CXX is None or not cublas_headers():
        pytest.skip("needs a C++ compiler and the CUDA runtime headers (library_types.h)")
    lib = shims.path("cublas_emu.so")  # built by tests/ext/conftest.py, in the background
    so = ctypes.CDLL(str(lib))
    p = ctypes.c_void_p
    so.emu_grouped.argtypes = [p, p, p, p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    so.emu_grouped.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_float]
    return so


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("mode", ["fwd", "dgrad", "wgrad"])
def test_cuda_host_code_argument_mapping_emulated(cublas_emu, sizes, mode):
    """csrc/cuda/grouped_gemm.cu's cublasGemmEx calls (m, n, k, ops, leading dims, offsets)
    against the per-expert loop, run through a host cublasGemmEx with cuBLAS's semantics."""
    trans_a, trans_b = mode == "wgrad", mode == "fwd"
    a, b, bs = _ab(sizes, 7, 5, torch.float32, trans_a, trans_b, seed=5)
    want = _loop(a, b, sizes, trans_a, trans_b)
    out = torch.full(want.shape, 3.0)
    if trans_a:  # the glue zeroes a group without rows (beta 0); the kernel skips it
        for g, rows in enumerate(sizes):
            if rows == 0:
                out[g] = 0.0
    n = 5 if trans_a else want.shape[1]
    k = a.shape[1]
    rc = cublas_emu.emu_grouped(
        a.data_ptr(),
        b.data_ptr(),
        out.data_ptr(),
        bs.data_ptr(),
        len(sizes),
        k,
        n,
        int(trans_a),
        int(trans_b),
        1.0,
        0.0,
    )
    assert rc == 0
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    base = out.clone()
    cublas_emu.emu_grouped(
        a.data_ptr(),
        b.data_ptr(),
        out.data_ptr(),
        bs.data_ptr(),
        len(sizes),
        k,
        n,
        int(trans_a),
        int(trans_b),
        0.5,
        1.0,
    )
    torch.testing.assert_close(out.double(), base.double() + 0.5 * want, rtol=1e-5, atol=1e-5)


# Unit roundoff (half an ulp, relative) of each output dtype.
_UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _error_bound(a, b, sizes, dtype, k, trans_a, trans_b):
    """(exact, bound): the fp64 result and, per element, the worst-case error of fp32
    accumulation over ``k`` products (k * u32 * sum |a_i b_i|) plus one rounding into ``dtype``
    (u * |value|). Any correct order of accumulation lands inside it: two correct results
    may then differ by one ulp near a rounding boundary, which a fixed rtol against each
    other cannot allow for."""
    exact = _loop(a, b, sizes, trans_a, trans_b)
    magnitude = _loop(a.abs(), b.abs(), sizes, trans_a, trans_b)
    accumulation = k * _UNIT_ROUNDOFF[torch.float32] * magnitude
    u = _UNIT_ROUNDOFF[dtype]
    return exact, u * exact.abs() + (1 + u) * accumulation


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["fwd", "dgrad", "wgrad"])
def test_cuda_matches_cpu(dtype, mode):
    """The CUDA and CPU routes each within the error bound of fp32 accumulation and one
    rounding of an fp64 reference (so within two such bounds of each other)."""
    trans_a, trans_b = mode == "wgrad", mode == "fwd"
    sizes = [17, 0, 64, 3]
    a, b, bs = _ab(sizes, 96, 80, dtype, trans_a, trans_b, seed=9)
    with route("compiled"):
        cpu = megadlm_ext.grouped_gemm(a, b, bs, trans_a=trans_a, trans_b=trans_b)
        gpu = megadlm_ext.grouped_gemm(a.cuda(), b.cuda(), bs, trans_a=trans_a, trans_b=trans_b)
        torch.cuda.synchronize()
    k = max(sizes) if trans_a else a.shape[1]  # the accumulation length of each output
    exact, bound = _error_bound(a, b, sizes, dtype, k, trans_a, trans_b)
    for name, out in (("cpu", cpu), ("cuda", gpu.cpu())):
        excess = (out.double() - exact).abs() - bound
        assert excess.max().item() <= 0, f"{name}: {int((excess > 0).sum())} elements beyond the bound"


@pytest.mark.gpu
def test_cuda_grouped_matmul_fusion_on_a_side_stream():
    sizes = [5, 0, 9]
    x = torch.randn(14, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(3, 16, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w.main_grad = torch.zeros(3, 16, 32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # x, w and main_grad were made on the default stream
    with torch.cuda.stream(s):
        y = grouped_matmul(x, w, torch.tensor(sizes), gradient_accumulation_fusion=True)
        y.float().sum().backward()
    torch.cuda.synchronize()
    want = _loop(torch.ones(14, 16).bfloat16(), x.detach().cpu(), sizes, trans_a=True)
    torch.testing.assert_close(w.main_grad.cpu().double(), want, rtol=1e-5, atol=1e-4)
    assert float(w.main_grad[1].abs().sum()) == 0.0
