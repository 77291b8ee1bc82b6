"""The CUDA kernels' device code, run on CPU by a host emulation (tests/ext/cuda_emu.cpp).

csrc/cuda/multi_tensor_kernels.cuh is compiled with g++ behind a few shims (blocks and
threads become loops) and fed real segment tables over torch CPU tensors; the results
must equal torch expressions. This covers the chunk partition, the segment walk, the
scalar heads/tails and the 16-byte vector paths on machines without a GPU (the GPU
tests in test_cuda.py run the real kernels where a device exists).
"""

import ctypes
import math

import numpy as np
import pytest
import torch

from .conftest import CXX
from .helpers import expect_accumulate, expect_flatten, expect_norm, packed_offsets, random_list

CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
OPS = dict(copy=0, accumulate=1, scale=2, sum_squares=3, nonfinite=4)
SEG = np.dtype([("src", "<u8"), ("dst", "<u8"), ("start", "<i8"), ("sd", "<i4"), ("dd", "<i4")])


@pytest.fixture(scope="module")
def emu(shims):
    if CXX is None:
        pytest.skip("no C++ compiler to build the CUDA-kernel emulation")
    lib = shims.path("cuda_emu.so")  # built by tests/ext/conftest.py, in the background
    so = ctypes.CDLL(str(lib))
    so.emu_run.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_double),
        ctypes.POINTER(ctypes.c_int),
    ]
    so.emu_uniform_pair.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    i64p = ctypes.POINTER(ctypes.c_int64)
    so.emu_block_chunks.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, i64p, i64p]
    so.emu_grid_size.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    so.emu_chunk.restype = ctypes.c_int64
    return so


def table(srcs, dsts):
    """Segment table (non-empty tensors only) as the bindings build it."""
    rows, start = [], 0
    for s, d in zip(srcs, dsts):
        if s.numel():
            rows.append(
                (
                    s.data_ptr(),
                    0 if d is None else d.data_ptr(),
                    start,
                    CODE[s.dtype],
                    CODE[(d if d is not None else s).dtype],
                )
            )
            start += s.numel()
    return np.array(rows, dtype=SEG), start


def run(emu, op, srcs, dsts, scale=1.0, grid=5, mixed=False):
    """Run the kernel the launcher picks (typed on the list's dtype pair), or with
    ``mixed`` the per-segment dispatching kernel, on ``grid`` emulated blocks."""
    segs, total = table(srcs, dsts)
    s, f = ctypes.c_double(), ctypes.c_int()
    rc = emu.emu_run(
        OPS[op], segs.ctypes.data, len(segs), total, scale, grid, int(mixed), ctypes.byref(s), ctypes.byref(f)
    )
    assert rc == 0
    return s.value, bool(f.value)


@pytest.mark.parametrize("flat_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grid", [1, 7, 64])
def test_emulated_cuda_kernels(emu, flat_dtype, grid):
    g = torch.Generator().manual_seed(grid)
    ts = random_list(g, 1500, 300) + [torch.randn(70_001, generator=g)]  # one spans chunks
    offs, numel = packed_offsets(ts, [i % 3 for i in range(len(ts))])  # misaligned starts
    flat = torch.zeros(numel, dtype=flat_dtype)
    views = [flat[o : o + t.numel()] for o, t in zip(offs, ts)]

    run(emu, "copy", ts, views, scale=0.25, grid=grid)
    assert torch.equal(flat, expect_flatten(ts, offs, numel, flat_dtype, 0.25))
    want = expect_accumulate(flat, ts, offs, -1.5)
    run(emu, "accumulate", ts, views, scale=-1.5, grid=grid)
    assert torch.equal(flat, want)
    outs = [torch.empty_like(t) for t in ts]
    run(emu, "copy", views, [o.view(-1) for o in outs], scale=3.0, grid=grid)  # unflatten
    for v, o in zip(views, outs):
        assert torch.equal(o.reshape(-1), (v.float() * 3.0).to(o.dtype))
    before = [o.clone() for o in outs]
    run(emu, "scale", outs, outs, scale=0.5, grid=grid)
    for b, o in zip(before, outs):
        assert torch.equal(o, (b.float() * 0.5).to(o.dtype))
    total, _ = run(emu, "sum_squares", ts, [None] * len(ts), grid=grid)
    assert math.isclose(math.sqrt(total), expect_norm(ts), rel_tol=1e-5)
    assert run(emu, "nonfinite", ts, [None] * len(ts), grid=grid)[1] is False
    ts[-1][-1] = float("nan")
    assert run(emu, "nonfinite", ts, [None] * len(ts), grid=grid)[1] is True


def test_emulated_same_dtype_raw_copy(emu):
    """Aligned same-dtype unscaled copies take the raw 16-byte path."""
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        ts = [torch.randn(n, generator=g).to(dt) for n in (8, 16, 1024, 4099, 33)]
        out = torch.full((sum(t.numel() for t in ts) + 64,), -1.0, dtype=dt)
        offs, _ = packed_offsets(ts, [0, 8, 16, 5, 0])
        run(emu, "copy", ts, [out[o : o + t.numel()] for o, t in zip(offs, ts)], grid=3)
        for o, t in zip(offs, ts):
            assert torch.equal(out[o : o + t.numel()], t)


PAIRS = [(s, d) for s in CODE for d in CODE]


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("mixed", [False, True], ids=["typed", "mixed-kernel"])
def test_emulated_typed_kernels_every_pair(emu, src_dtype, dst_dtype, mixed):
    """Each (src, dst) template instance, and the per-segment dispatch kernel on the same
    list, equals torch; the list is uniform so the launcher picks the typed kernel."""
    g = torch.Generator().manual_seed(hash((str(src_dtype), str(dst_dtype))) % 2**31)
    ts = [(torch.randn(n, generator=g) * 3).to(src_dtype) for n in (1, 7, 8, 33, 1000, 4099, 20_000)]
    segs, _ = table(ts, [None] * len(ts))
    assert emu.emu_uniform_pair(segs.ctypes.data, len(segs)) == CODE[src_dtype] * 3 + CODE[src_dtype]
    offs, numel = packed_offsets(ts, [i % 3 for i in range(len(ts))])
    flat = torch.zeros(numel, dtype=dst_dtype)
    views = [flat[o : o + t.numel()] for o, t in zip(offs, ts)]
    run(emu, "copy", ts, views, scale=0.5, grid=6, mixed=mixed)
    assert torch.equal(flat, expect_flatten(ts, offs, numel, dst_dtype, 0.5))
    run(emu, "copy", ts, views, grid=6, mixed=mixed)  # scale 1: the raw path when types match
    assert torch.equal(flat, expect_flatten(ts, offs, numel, dst_dtype, 1.0))
    want = expect_accumulate(flat, ts, offs, 0.75)
    run(emu, "accumulate", ts, views, scale=0.75, grid=6, mixed=mixed)
    assert torch.equal(flat, want)
    total, _ = run(emu, "sum_squares", ts, [None] * len(ts), grid=6, mixed=mixed)
    assert math.isclose(math.sqrt(total), expect_norm(ts), rel_tol=1e-5)


def test_emulated_mixed_list_uses_the_dispatching_kernel(emu):
    g = torch.Generator().manual_seed(5)
    ts = random_list(g, 200, 500)
    segs, _ = table(ts, [None] * len(ts))
    assert emu.emu_uniform_pair(segs.ctypes.data, len(segs)) == -1
    offs, numel = packed_offsets(ts)
    flat = torch.zeros(numel, dtype=torch.bfloat16)
    run(emu, "copy", ts, [flat[o : o + t.numel()] for o, t in zip(offs, ts)], scale=2.0, grid=3)
    assert torch.equal(flat, expect_flatten(ts, offs, numel, torch.bfloat16, 2.0))


@pytest.mark.parametrize("chunks", [0, 1, 7, 64, 65, 131, 1000, 10_007])
@pytest.mark.parametrize("grid", [1, 3, 64, 528, 1056])
def test_even_grid_split(emu, chunks, grid):
    """Chunks are split over blocks in order, without gaps, and evenly: block loads
    differ by at most one chunk (ceil-division left whole blocks idle)."""
    c0, c1 = ctypes.c_int64(), ctypes.c_int64()
    ranges = []
    for b in range(grid):
        emu.emu_block_chunks(chunks, grid, b, ctypes.byref(c0), ctypes.byref(c1))
        ranges.append((c0.value, c1.value))
    assert ranges[0][0] == 0 and ranges[-1][1] == chunks
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1
    if chunks >= grid:
        assert min(sizes) >= 1  # no idle block


def test_grid_is_one_resident_wave(emu):
    chunk = emu.emu_chunk()
    # H100-like: 132 SMs, 4 resident blocks/SM from the occupancy query -> 528 blocks.
    assert emu.emu_grid_size(chunk * 100_000, 4, 132, 1 << 30) == 528
    assert emu.emu_grid_size(chunk * 10, 4, 132, 1 << 30) == 10  # never more blocks than chunks
    assert emu.emu_grid_size(1, 4, 132, 1 << 30) == 1
    assert emu.emu_grid_size(chunk * 100_000, 8, 132, 1024) == 1024  # l2_norm partials cap
    assert emu.emu_grid_size(chunk * 100_000, 0, 132, 1 << 30) == 132  # occupancy 0: still launches


def test_emulated_uneven_split_covers_every_element(emu):
    """A grid that does not divide the chunk count: every element copied exactly once."""
    chunk = emu.emu_chunk()
    ts = [torch.arange(chunk * 5 + 3, dtype=torch.float32), torch.ones(chunk * 2 - 1)]
    offs, numel = packed_offsets(ts)
    flat = torch.zeros(numel)
    views = [flat[o : o + t.numel()] for o, t in zip(offs, ts)]
    run(emu, "accumulate", ts, views, grid=3)  # accumulate: a double visit would show
    assert torch.equal(flat, torch.cat(ts))
