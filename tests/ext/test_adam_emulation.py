"""The fused AdamW step's device code, run on CPU by a host emulation (tests/ext/adam_emu.cpp).

csrc/cuda/adam_kernels.cuh is compiled with g++ behind the CUDA shims (blocks and threads
become loops) and fed real AdamTensor tables over torch CPU tensors; every result must be
bitwise the compiled CPU kernel's (megadlm_ext.adamw_step on CPU), which the GPU tests in
test_adamw.py compare with the real CUDA kernel. Covers the chunk split over 1, 3 and 64
blocks, the walk over many tensors across chunk boundaries, the alignment heads, the
8-element vector path and the scalar fallback for streams that never align together.
"""

import ctypes
import itertools

import numpy as np
import pytest
import torch

import megadlm_ext

from .conftest import CXX
from .helpers import route

CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, None: -1}
ROW = np.dtype(
    [
        ("p", "<u8"),
        ("g", "<u8"),
        ("m", "<u8"),
        ("v", "<u8"),
        ("mp", "<u8"),
        ("start", "<i8"),
        ("numel", "<i8"),
        ("r", "<i8"),
    ]  # noqa: E501
)
HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, wd=0.1)


@pytest.fixture(scope="module")
def emu(shims):
    if CXX is None:
        pytest.skip("no C++ compiler to build the CUDA-kernel emulation")
    so = ctypes.CDLL(shims.path("adam_emu.so"))
    d, i64, vp = ctypes.c_double, ctypes.c_int64, ctypes.c_void_p
    so.emu_adam.argtypes = [vp, i64, i64, vp, d, d, d, d, d, i64, ctypes.c_int]
    so.emu_adam_head.argtypes = [vp, i64, vp]
    so.emu_adam_row_bytes.restype = i64
    assert so.emu_adam_row_bytes() == ROW.itemsize
    return so


def _table(ps, gs, ms, vs, mps):
    rows, start = [], 0
    for p, g, m, v, mp in zip(ps, gs, ms, vs, mps):
        if p.numel():
            ptrs = [t.data_ptr() for t in (p, g, m, v)] + [0 if mp is None else mp.data_ptr()]
            rows.append((*ptrs, start, p.numel(), 0))
            start += p.numel()
    return np.array(rows, dtype=ROW), start


def _codes(gs, ms, vs, mps):
    model = None if mps[0] is None else mps[0].dtype
    return np.array([CODE[gs[0].dtype], CODE[ms[0].dtype], CODE[vs[0].dtype], CODE[model]], np.int32)


def _views(sizes, dtype, shift, seed, scale):
    """Tensors as views into separate buffers, `shift` elements past a 64-byte boundary."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        buf = torch.zeros(n + 32, dtype=dtype)
        view = buf[shift : shift + n]
        view.copy_(torch.randn(n, generator=g) * scale)
        out.append(view)
    return out


def _lists(sizes, gdt, mdt, vdt, pdt, shifts=(0, 0, 0, 0, 0)):
    ps = _views(sizes, torch.float32, shifts[0], 1, 1.0)
    gs = _views(sizes, gdt, shifts[1], 2, 1e-2)
    ms = _views(sizes, mdt, shifts[2], 3, 1e-3)
    vs = [v.abs_() for v in _views(sizes, vdt, shifts[3], 4, 1e-4)]
    mps = [None] * len(sizes) if pdt is None else _views(sizes, pdt, shifts[4], 5, 0.0)
    return ps, gs, ms, vs, mps


def _clone(ts):
    return [t if t is None else t.clone() for t in ts]


def _emulated(emu, lists, grid, step=7):
    ps, gs, ms, vs, mps = lists
    tab, total = _table(ps, gs, ms, vs, mps)
    h = HYPER
    emu.emu_adam(
        tab.ctypes.data, len(tab), total, _codes(gs, ms, vs, mps).ctypes.data,
        h["lr"], h["beta1"], h["beta2"], h["eps"], h["wd"], step, grid,
    )  # fmt: skip


def _compiled(lists, step=7):
    ps, gs, ms, vs, mps = lists
    h = HYPER
    with route("compiled"):
        megadlm_ext.adamw_step(
            ps, gs, ms, vs, lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], eps=h["eps"],
            weight_decay=h["wd"], step=step, model_params=None if mps[0] is None else mps,
        )  # fmt: skip


def _check(emu, sizes, dts, shifts, grid):
    base = _lists(sizes, *dts, shifts=shifts)
    a = [_clone(x) if k != 1 else x for k, x in enumerate(base)]
    b = [_clone(x) if k != 1 else x for k, x in enumerate(base)]
    _emulated(emu, a, grid)
    _compiled(b)
    for k in (0, 2, 3, 4):
        for x, y in zip(a[k], b[k]):
            if x is not None:
                assert torch.equal(x, y), (dts, shifts, grid, k)
    assert not torch.equal(a[0][-1], base[0][-1])  # something moved


SIZES = [1, 7, 8, 9, 100, 8192, 8193, 20_000, 3]  # across the 8192-element chunks


@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "mdt,vdt", list(itertools.product((torch.float32, torch.bfloat16, torch.float16), repeat=2))
)
def test_every_typed_kernel_equals_the_cpu_kernel(emu, gdt, mdt, vdt):
    for pdt, grid in zip((None, torch.bfloat16, torch.float16), (1, 3, 64)):
        _check(emu, SIZES, (gdt, mdt, vdt, pdt), (0, 0, 0, 0, 0), grid)


@pytest.mark.parametrize(
    "shifts",
    [(0, 0, 0, 0, 0), (1, 1, 1, 1, 1), (3, 3, 3, 3, 3), (4, 0, 0, 0, 0), (0, 1, 0, 0, 0), (2, 2, 2, 2, 7)],
)
def test_heads_tails_and_misaligned_streams(emu, shifts):
    """Same shift everywhere: a scalar head, then vectors; streams shifted differently
    never line up (scalar path throughout); both give the CPU kernel's bits."""
    for dts in (
        (torch.float32,) * 3 + (None,),
        (torch.bfloat16, torch.bfloat16, torch.float16, torch.bfloat16),
    ):
        for grid in (1, 5):
            _check(emu, SIZES, dts, shifts, grid)


def test_head_is_where_every_stream_is_aligned(emu):
    """adam_head: 0 when aligned, the elements to the next common 16-byte line, or -1."""
    f32, bf16 = torch.float32, torch.bfloat16
    cases = [
        ((0, 0, 0, 0, 0), (f32, f32, f32, None), 0),
        ((1, 1, 1, 1, 1), (f32, f32, f32, None), 3),  # 4-byte elements: 3 more to a line
        ((1, 1, 1, 1, 1), (bf16, bf16, bf16, bf16), 7),  # 2-byte ones in bf16/fp16 streams
        ((0, 1, 0, 0, 0), (f32, f32, f32, None), -1),
        ((0, 0, 0, 0, 4), (f32, f32, f32, bf16), 4),  # the bf16 copy 4 elements past a line
        ((0, 0, 0, 0, 1), (f32, f32, f32, bf16), -1),
    ]
    for shifts, (g, m, v, p), want in cases:
        lists = _lists([64], g, m, v, p, shifts=shifts)
        tab, _ = _table(*lists)
        got = emu.emu_adam_head(tab.ctypes.data, 0, _codes(*lists[1:]).ctypes.data)
        assert got == want, (shifts, g, m, v, p)
