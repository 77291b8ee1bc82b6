"""The fused ops' CUDA device code, run on CPU by a host emulation (tests/ext/fused_emu.cpp).

csrc/cuda/fused_kernels.cuh -- the per-thread work and the launch plans of the GPU kernels --
is compiled with g++ behind the shims of tests/ext/cuda_shims.h (blocks and threads become
loops; the block sum between a norm row's phases a plain sum) and run on torch CPU tensors.
Results must match the unfused torch expressions (fp32 within 1e-6, bf16/fp16 by the dtype's
epsilon, tests/ext/fused_helpers.py) for the 16-byte vector builds and the scalar builds
(strided q/k views, sizes that are not whole vectors, misaligned pointers), grids smaller than
the rows (grid-stride loops), rows longer than a block (several vectors per thread), and the
RMSNorm weight-gradient partials; the plans pick the vector build where they should.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from .conftest import CXX
from .fused_helpers import (
    check_fused,
    grads_of,
    rope_angles,
    unfused_add_rmsnorm,
    unfused_rope,
    unfused_swiglu,
)

CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DTYPES = list(CODE)
P = ctypes.c_void_p
I64 = ctypes.c_int64
I64x4 = ctypes.c_int64 * 4
I64x3 = ctypes.c_int64 * 3


@pytest.fixture(scope="module")
def emu(shims):
    if CXX is None:
        pytest.skip("no C++ compiler to build the fused-kernel emulation")
    so = ctypes.CDLL(shims.path("fused_emu.so"))  # built by tests/ext/conftest.py
    i = ctypes.c_int
    so.emu_rope.argtypes = [P, P, P, P, I64x4, I64x4, I64x3, I64x3, i, i, i, I64]
    so.emu_swiglu.argtypes = [P, P, P, I64, I64, i, i, i, I64]
    so.emu_add_rmsnorm.argtypes = [P, P, P, P, P, P, I64, I64, ctypes.c_float, i, i, I64]
    so.emu_add_rmsnorm_backward.argtypes = [P, P, P, P, P, P, P, P, I64, I64, i, i, I64, i]
    so.emu_add_rmsnorm_bwd_blocks.argtypes = [I64, I64, i]
    so.emu_add_rmsnorm_bwd_blocks.restype = I64
    so.emu_row_threads.argtypes = [I64]
    return so


def _angle_strides(t):
    """[b, s, d] strides as the bindings pass them (a size-1 dim broadcasts: stride 0)."""
    return I64x3(*[0 if t.shape[d] == 1 else t.stride(d) for d in (0, 1, 3)])


def emu_rope(emu, x, cos, sin, *, backward=False, scalar=False, grid=0):
    out = torch.empty(x.shape, dtype=x.dtype)
    vec = emu.emu_rope(
        x.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), I64x4(*x.shape), I64x4(*x.stride()),
        _angle_strides(cos), _angle_strides(sin), CODE[x.dtype], int(backward), int(scalar), grid,
    )  # fmt: skip
    return out, bool(vec)


def _kv(B, S, G, per, D, dtype, offset=0):
    """(q, k) of a grouped qkv output; ``offset`` elements shift the storage (misaligned)."""
    g = torch.Generator().manual_seed(D)
    buf = torch.randn(B * S * G * (per + 2) * D + offset, generator=g).to(dtype)
    qkv = buf[offset:].view(B, S, G, (per + 2) * D)
    q, k, _ = torch.split(qkv, [per * D, D, D], dim=-1)
    return q.reshape(B, S, G * per, D), k


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "D,offset,scalar,want_vec",
    [
        (16, 0, False, True),
        (80, 0, False, True),
        (16, 0, True, False),
        (6, 0, False, False),
        (16, 1, False, False),
    ],
    ids=["vec", "D80-vec", "forced-scalar", "odd-half", "misaligned"],
)
def test_emulated_rope(emu, dtype, D, offset, scalar, want_vec):
    B, S, G, per = 2, 5, 2, 2
    cos, sin = rope_angles(B, S, D, general=True)
    q, k = _kv(B, S, G, per, D, dtype, offset)
    for x in (q, k) if not offset else (k,):  # q is a reshape's copy (aligned); k the shifted view
        g = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
        (want,), (want_dx,) = grads_of(lambda t: unfused_rope(t, cos, sin), [x], [g])
        (truth,), (truth_dx,) = grads_of(
            lambda t: unfused_rope(t, cos.double(), sin.double()), [x.double()], [g.double()]
        )
        got, vec = emu_rope(emu, x, cos, sin, scalar=scalar, grid=3)  # 3 blocks stride over 10 positions
        got_dx, _ = emu_rope(emu, g, cos, sin, backward=True, scalar=scalar)
        assert vec == want_vec
        check_fused(got, want, truth, "emulated rope forward")
        check_fused(got_dx, want_dx, truth_dx, "emulated rope backward")


def test_emulated_rope_broadcast_angles_and_many_heads(emu):
    """Batch-1 angles (stride 0 over B), and heads * D/2 / 8 > 256 items per position (each
    thread loops)."""
    x = torch.randn(2, 3, 40, 128)
    cos, sin = rope_angles(2, 3, 128, batch1=True)
    got, vec = emu_rope(emu, x, cos, sin)
    assert vec and emu.emu_row_threads(40 * 8) == 256
    check_fused(got, unfused_rope(x, cos, sin), unfused_rope(x.double(), cos.double(), sin.double()), "rope")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "F,scalar,want_vec", [(24, False, True), (13, False, False), (24, True, False), (2056, False, True)]
)
def test_emulated_swiglu(emu, dtype, F, scalar, want_vec):
    gen = torch.Generator().manual_seed(F)
    M = 7
    h = (torch.randn(M, 2 * F, generator=gen) * 3).to(dtype)
    g = torch.randn(M, F, generator=gen).to(dtype)
    (want,), (want_dh,) = grads_of(unfused_swiglu, [h], [g])
    (truth,), (truth_dh,) = grads_of(unfused_swiglu, [h.double()], [g.double()])
    out, dh = torch.empty(M, F, dtype=dtype), torch.empty(M, 2 * F, dtype=dtype)
    vec = emu.emu_swiglu(h.data_ptr(), None, out.data_ptr(), M, F, CODE[dtype], 1, int(scalar), 2)
    emu.emu_swiglu(h.data_ptr(), g.data_ptr(), dh.data_ptr(), M, F, CODE[dtype], 0, int(scalar), 0)
    assert bool(vec) == want_vec
    check_fused(out, want, truth, "emulated swiglu forward")
    check_fused(dh, want_dh, truth_dh, "emulated swiglu backward")


def _norm_case(H, dtype, M=10):
    gen = torch.Generator().manual_seed(H)
    x, h, gs, gy = (torch.randn(M, H, generator=gen).to(dtype) for _ in range(4))
    w = (1 + 0.5 * torch.randn(H, generator=gen)).to(dtype)
    return x, h, w, gs, gy


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "H,scalar,want_vec,grid,blocks",
    [(64, False, True, 3, 3), (37, False, False, 0, 0), (64, True, False, 4, 1), (4104, False, True, 2, 4)],
    ids=["vec", "odd-hidden", "forced-scalar", "long-rows"],
)
def test_emulated_add_rmsnorm(emu, dtype, H, scalar, want_vec, grid, blocks):
    x, h, w, gs, gy = _norm_case(H, dtype)
    M, eps = x.shape[0], 1e-5
    fn = lambda a, b, c: unfused_add_rmsnorm(a, b, c, eps)  # noqa: E731
    want, want_grads = grads_of(fn, [x, h, w], [gs, gy])
    truth, truth_grads = grads_of(fn, [x.double(), h.double(), w.double()], [gs.double(), gy.double()])
    total, y, rstd = torch.empty_like(x), torch.empty_like(x), torch.empty(M)
    ptrs = [t.data_ptr() for t in (x, h, w, total, y, rstd)]
    vec = emu.emu_add_rmsnorm(*ptrs, M, H, eps, CODE[dtype], int(scalar), grid)
    assert bool(vec) == want_vec
    assert torch.equal(total, want[0])
    check_fused(y, want[1], truth[1], "emulated add_rmsnorm y")

    nblocks = blocks or emu.emu_add_rmsnorm_bwd_blocks(M, H, 132)
    partial = torch.full((nblocks, H), float("nan"))  # every block must write its whole row
    grad_x, grad_w = torch.empty_like(x), torch.empty(H, dtype=dtype)
    args = [t.data_ptr() for t in (gs, gy, total, w, rstd, grad_x, partial, grad_w)]
    emu.emu_add_rmsnorm_backward(*args, M, H, CODE[dtype], int(scalar), blocks, 132)
    assert torch.isfinite(partial).all()
    check_fused(grad_x, want_grads[0], truth_grads[0], "emulated add_rmsnorm grad x")
    check_fused(grad_w, want_grads[2], truth_grads[2], "emulated add_rmsnorm grad weight")


def test_launch_plans(emu):
    assert [emu.emu_row_threads(v) for v in (1, 32, 33, 256, 1000)] == [32, 32, 64, 256, 256]
    # H100/H200: 132 SMs, 256 threads per row of a 2048-wide bf16 norm -> 8 blocks per SM
    assert emu.emu_add_rmsnorm_bwd_blocks(16384, 2048, 132) == 132 * 8
    assert emu.emu_add_rmsnorm_bwd_blocks(10, 2048, 132) == 10  # never more blocks than rows
    assert emu.emu_add_rmsnorm_bwd_blocks(0, 2048, 132) == 1
