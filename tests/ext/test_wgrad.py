"""megadlm_ext.wgrad_accumulate (gradient-accumulation fusion's weight-gradient GEMM) against
plain torch ``main_grad + go.T.float() @ x.float()``, both routes; its argument errors."""

import pytest
import torch

import megadlm_ext

from .helpers import DTYPES, ROUTES, route


def _expect(main_grad, go, x, alpha=1.0):
    go2 = go.reshape(-1, go.shape[-1]).double()
    x2 = x.reshape(-1, x.shape[-1]).double()
    return (main_grad.double() + alpha * (go2.t() @ x2)).float()


def _inputs(lead, out, inp, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(*lead, out, generator=g).to(dtype)
    x = torch.randn(*lead, inp, generator=g).to(dtype)
    mg = torch.randn(out, inp, generator=g)
    return mg, go, x


def _tol(rows):
    # fp32 products of exactly representable inputs, summed in fp32 over `rows` terms of
    # magnitude ~1: the rounding error grows like sqrt(rows) * 2^-24 * |terms|.
    return dict(rtol=1e-5, atol=2e-6 * rows**0.5 * 4)


@pytest.mark.parametrize("route_name", ROUTES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "lead,out,inp",
    [((37,), 7, 13), ((2, 5), 16, 24), ((3, 4, 5), 1, 9), ((1,), 33, 1), ((130,), 64, 96)],
)
def test_matches_torch(route_name, dtype, lead, out, inp):
    mg, go, x = _inputs(lead, out, inp, dtype)
    expect = _expect(mg, go, x)
    with route(route_name):
        megadlm_ext.wgrad_accumulate(mg, go, x)
    rows = x.numel() // inp
    torch.testing.assert_close(mg, expect, **_tol(rows))


@pytest.mark.parametrize("route_name", ROUTES)
def test_accumulates_alpha_and_several_chunks(route_name):
    # rows > the CPU route's upcast chunk (2^22 / (out + in) = 1997 rows here): several chunks;
    # the other shapes above cover chunks capped by out * in / 2 and the 64-row minimum.
    mg, go, x = _inputs((3000,), 1000, 1100, torch.bfloat16, seed=1)
    expect = _expect(_expect(mg, go, x, alpha=0.5), go, x, alpha=0.5)
    with route(route_name):
        megadlm_ext.wgrad_accumulate(mg, go, x, alpha=0.5)
        megadlm_ext.wgrad_accumulate(mg, go, x, alpha=0.5)
    torch.testing.assert_close(mg, expect, **_tol(3000))


@pytest.mark.parametrize("route_name", ROUTES)
def test_fp32_equals_addmm_and_empty_is_noop(route_name):
    mg, go, x = _inputs((2, 9), 5, 6, torch.float32, seed=2)
    expect = mg.addmm(go.reshape(-1, 5).t(), x.reshape(-1, 6))
    with route(route_name):
        megadlm_ext.wgrad_accumulate(mg, go, x)
        before = mg.clone()
        megadlm_ext.wgrad_accumulate(mg, torch.empty(0, 5), torch.empty(0, 6))
    torch.testing.assert_close(mg, expect, rtol=1e-6, atol=1e-6)
    assert torch.equal(mg, before)


def _error_cases():
    mg, go, x = torch.zeros(4, 3), torch.ones(2, 4), torch.ones(2, 3)
    yield "main_grad bf16", (mg.bfloat16(), go, x), "main_grad must be float32"
    yield "main_grad 1-D", (torch.zeros(12), go, x), "main_grad must be a contiguous 2-D"
    yield "main_grad non-contiguous", (torch.zeros(3, 4).t(), go, x), r"main_grad .*not contiguous"
    yield "grad_output int", (mg, go.long(), x), "grad_output has dtype"
    yield "input f64", (mg, go, x.double()), "input has dtype"
    yield "mixed dtypes", (mg, go.bfloat16(), x), "grad_output is torch.bfloat16 but input is torch.float32"
    yield "grad_output non-contiguous", (mg, torch.ones(4, 2).t(), x), "grad_output is not contiguous"
    yield "input non-contiguous", (mg, go, torch.ones(3, 2).t()), "input is not contiguous"
    yield (
        "wrong out",
        (mg, torch.ones(2, 5), x),
        r"must be \[grad_output.shape\[-1\], input.shape\[-1\]\] = \[5, 3\]",
    )
    yield "wrong in", (mg, go, torch.ones(2, 2)), r"= \[4, 2\]"
    yield "leading dims", (mg, torch.ones(2, 1, 4), torch.ones(1, 2, 3)), "same leading dims"
    yield "device", (mg, go, torch.ones(2, 3, device="meta")), "input is on meta but main_grad is on cpu"
    yield "not a tensor", (mg, go, 3.0), "input must be a tensor"


@pytest.mark.parametrize("route_name", ROUTES)
@pytest.mark.parametrize("case", list(_error_cases()), ids=lambda c: c[0])
def test_errors_name_the_tensor(route_name, case):
    _, args, match = case
    with route(route_name), pytest.raises(ValueError, match=match):
        megadlm_ext.wgrad_accumulate(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(dtype):
    assert megadlm_ext.backend_info()["cuda"], "megadlm_ext was built without CUDA"
    mg, go, x = _inputs((3, 70), 48, 80, dtype, seed=3)
    ref = mg.clone()
    megadlm_ext.wgrad_accumulate(ref, go, x, alpha=0.25)
    mg_c, go_c, x_c = mg.cuda(), go.cuda(), x.cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the copies above
    with torch.cuda.stream(stream):  # the GEMM runs on torch's current stream: this one
        megadlm_ext.wgrad_accumulate(mg_c, go_c, x_c, alpha=0.25)
        torch.cuda.current_stream().synchronize()
    # 3-D activations, accumulating onto the result, on the default stream
    megadlm_ext.wgrad_accumulate(mg_c, go_c, x_c, alpha=0.25)
    megadlm_ext.wgrad_accumulate(ref, go, x, alpha=0.25)
    torch.cuda.synchronize()
    # cuBLAS may split K differently than the CPU GEMM; both accumulate exact products in fp32
    # (tf32 is not used: CUBLAS_COMPUTE_32F).
    torch.testing.assert_close(mg_c.cpu(), ref, **_tol(420))
