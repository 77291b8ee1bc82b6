"""Every megadlm_ext op against pure-PyTorch expectations, through both routes."""

import functools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megadlm_ext

from .helpers import (
    DTYPES,
    ROUTES,
    expect_accumulate,
    expect_flatten,
    expect_norm,
    packed_offsets,
    random_list,
    route,
)

SETTINGS = settings(
    max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)

dtype_st = st.sampled_from(DTYPES)
# Sizes stress the vector paths: 0, 1, odd, around the 8-lane and 32-lane boundaries.
size_st = st.one_of(st.sampled_from([0, 1, 7, 8, 9, 31, 33, 257]), st.integers(0, 3000))
list_st = st.lists(st.tuples(size_st, dtype_st), min_size=0, max_size=12)
scale_st = st.sampled_from([1.0, 0.5, -3.0, 1.0 / 3.0, 1e-3])


def make(spec, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 4).to(dt) for n, dt in spec]


def test_extension_is_compiled():
    """Fails (never skips) when the build did not produce megadlm_ext._C."""
    info = megadlm_ext.backend_info()
    assert info["compiled"] is True, f"megadlm_ext._C was not built: {info}"
    assert set(info) >= {"version", "compiled", "cuda", "nccl"}


@pytest.mark.parametrize("name", ROUTES)
@SETTINGS
@given(
    spec=list_st,
    out_dtype=dtype_st,
    scale=scale_st,
    gaps=st.booleans(),
    given_out=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_flatten(name, spec, out_dtype, scale, gaps, given_out, seed):
    ts = make(spec, seed)
    offs, numel = packed_offsets(ts, [i % 3 for i in range(len(ts))] if gaps else None)
    with route(name):
        if given_out:
            base = torch.full((numel + 5,), 7.0, dtype=out_dtype)
            out = base.clone()
            got = megadlm_ext.flatten(ts, out, offsets=offs if gaps else None, scale=scale)
            assert got.data_ptr() == out.data_ptr()
            want = expect_flatten(ts, offs, numel + 5, out_dtype, scale, base=base)
        else:
            got = megadlm_ext.flatten(ts, offsets=offs if gaps else None, scale=scale, dtype=out_dtype)
            want = expect_flatten(ts, offs, numel, out_dtype, scale)
    assert got.dtype == out_dtype and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ROUTES)
def test_flatten_dtype_inference(name):
    with route(name):
        assert megadlm_ext.flatten([torch.ones(3, dtype=torch.bfloat16)]).dtype == torch.bfloat16
        mixed = megadlm_ext.flatten([torch.ones(2, dtype=torch.half), torch.ones(1)])
        assert mixed.dtype == torch.float32 and torch.equal(mixed, torch.ones(3))
        assert megadlm_ext.flatten([]).numel() == 0


@pytest.mark.parametrize("name", ROUTES)
@SETTINGS
@given(spec=list_st, flat_dtype=dtype_st, scale=scale_st, gaps=st.booleans(), seed=st.integers(0, 2**16))
def test_unflatten(name, spec, flat_dtype, scale, gaps, seed):
    ts = make(spec, seed)
    offs, numel = packed_offsets(ts, [1 + i % 2 for i in range(len(ts))] if gaps else None)
    flat = (torch.randn(numel, generator=torch.Generator().manual_seed(seed + 1)) * 2).to(flat_dtype)
    with route(name):
        megadlm_ext.unflatten(flat, ts, offsets=offs if gaps else None, scale=scale)
    for o, t in zip(offs, ts):
        want = (flat[o : o + t.numel()].float() * scale).to(t.dtype).reshape(t.shape)
        assert torch.equal(t, want)


@pytest.mark.parametrize("name", ROUTES)
@SETTINGS
@given(spec=list_st, flat_dtype=dtype_st, scale=scale_st, gaps=st.booleans(), seed=st.integers(0, 2**16))
def test_accumulate_into(name, spec, flat_dtype, scale, gaps, seed):
    ts = make(spec, seed)
    offs, numel = packed_offsets(ts, [i % 4 for i in range(len(ts))] if gaps else None)
    flat = torch.randn(numel + 3, generator=torch.Generator().manual_seed(seed + 2)).to(flat_dtype)
    want = expect_accumulate(flat, ts, offs, scale)
    with route(name):
        megadlm_ext.accumulate_into(flat, ts, offsets=offs if gaps else None, scale=scale)
    assert torch.equal(flat, want)


@pytest.mark.parametrize("name", ROUTES)
@SETTINGS
@given(spec=list_st, factor=scale_st, seed=st.integers(0, 2**16))
def test_scale_(name, spec, factor, seed):
    ts = make(spec, seed)
    want = [(t.float() * factor).to(t.dtype) for t in ts]
    with route(name):
        megadlm_ext.scale_(ts, factor)
    for t, w in zip(ts, want):
        assert torch.equal(t, w)


@pytest.mark.parametrize("name", ROUTES)
@SETTINGS
@given(spec=list_st, seed=st.integers(0, 2**16))
def test_l2_norm(name, spec, seed):
    ts = make(spec, seed)
    with route(name):
        got = megadlm_ext.l2_norm(ts)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert math.isclose(float(got), expect_norm(ts), rel_tol=2e-6, abs_tol=1e-30)


@pytest.mark.parametrize("name", ROUTES)
def test_l2_norm_accumulates_in_fp32(name):
    # 2**20 bf16 ones: a bf16 accumulator would stall at 256; fp32 gives exactly 1024.
    ts = [torch.ones(2**19, dtype=torch.bfloat16), torch.ones(2**19, dtype=torch.float16)]
    with route(name):
        assert float(megadlm_ext.l2_norm(ts)) == 1024.0
        assert float(megadlm_ext.l2_norm([])) == 0.0


@functools.cache
def _long_list(n, max_numel, seed, dtypes=None):
    """The random list of a seed, built once (~0.5 s) for both routes' cases; a tuple: a case
    that changes an element copies the list and that element first."""
    kw = {} if dtypes is None else {"dtypes": dtypes}
    return tuple(random_list(torch.Generator().manual_seed(seed), n, max_numel, **kw))


@pytest.mark.parametrize("name", ROUTES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_has_nonfinite_last_of_long_list(name, dtype):
    g = torch.Generator().manual_seed(0)
    ts = list(_long_list(10_500, 40, 0, (dtype,)))
    ts[-1] = torch.randn(37, generator=g).to(dtype)  # a fresh last tensor: the case writes into it
    with route(name):
        assert megadlm_ext.has_nonfinite(ts) is False
        assert megadlm_ext.has_nonfinite([]) is False
        for bad in (float("nan"), float("inf"), float("-inf")):
            ts[-1][-1] = bad
            assert megadlm_ext.has_nonfinite(ts) is True
        ts[-1][-1] = 0.0
        ts[0] = torch.tensor([65504.0, -0.0], dtype=dtype)  # fp16 max is still finite
        assert megadlm_ext.has_nonfinite(ts) is False


@pytest.mark.parametrize("name", ROUTES)
def test_ten_thousand_tensors_round_trip(name):
    """12k mixed tensors (many 0/1-element): flatten, accumulate, unflatten, norm."""
    ts = list(_long_list(12_000, 50, 1))
    offs, numel = packed_offsets(ts, [(-t.numel()) % 4 for t in ts])  # 4-aligned layout
    with route(name):
        flat = megadlm_ext.flatten(ts, offsets=offs, scale=0.5, dtype=torch.float32)
        assert torch.equal(flat, expect_flatten(ts, offs, numel, torch.float32, 0.5))
        want = expect_accumulate(flat, ts, offs, 2.0)
        megadlm_ext.accumulate_into(flat, ts, offsets=torch.tensor(offs), scale=2.0)
        assert torch.equal(flat, want)
        outs = [torch.empty_like(t) for t in ts]
        megadlm_ext.unflatten(flat, outs, offsets=offs)
        for o, t, r in zip(offs, ts, outs):
            assert torch.equal(r.reshape(-1), flat[o : o + t.numel()].to(t.dtype))
        assert math.isclose(float(megadlm_ext.l2_norm(ts)), expect_norm(ts), rel_tol=2e-6)


def _special_fp32():
    vals = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        65504.0,
        65519.99,
        65520.0,
        65536.0,
        1e30,
        -1e30,
        3.4e38,
        6.1e-5,
        6.0e-5,
        5.96e-8,
        2.98e-8,
        2.99e-8,
        1e-40,
        -1e-45,
        float("inf"),
        float("-inf"),
        1.00390625,
        1.01171875,
        1.0009765625,
        1.0029296875,
    ]  # bf16 / fp16 ties
    g = torch.Generator().manual_seed(3)
    rnd = torch.cat([torch.randn(4000, generator=g) * 10.0**e for e in (-9, -6, -3, 0, 3, 6)])
    bits = torch.randint(0, 2**31 - 1, (4000,), generator=g, dtype=torch.int64).to(torch.int32)
    return torch.cat([torch.tensor(vals), rnd, bits.view(torch.float32).nan_to_num(0.0)])


@pytest.fixture(params=["auto", "generic"])
def cpu_isa(request):
    """Run a test with the detected CPU kernels and with the portable ones (whose scalar
    conversions are the same code the CUDA kernels use)."""
    from megadlm_ext import _C

    _C._set_cpu_isa(request.param)
    yield request.param
    _C._set_cpu_isa("auto")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_conversions_bitwise_match_torch(dtype, cpu_isa):
    """fp32 -> 16-bit rounding (vector and scalar tails) and back, compiled route."""
    x = _special_fp32()
    with route("compiled"):
        if cpu_isa == "generic":
            assert megadlm_ext.backend_info()["cpu_isa"] == "generic"
        for n in (x.numel(), x.numel() - 5):  # a length that leaves a scalar tail
            got = megadlm_ext.flatten([x[:n]], dtype=dtype)
            assert torch.equal(got.view(torch.int16), x[:n].to(dtype).view(torch.int16))
            back = megadlm_ext.flatten([got], dtype=torch.float32)
            assert torch.equal(back, got.float())
        nan = megadlm_ext.flatten([torch.full((9,), float("nan"))], dtype=dtype)
        assert torch.isnan(nan).all()


def test_thread_count_does_not_change_results():
    g = torch.Generator().manual_seed(5)
    ts = random_list(g, 3000, 2000)
    prev = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with route("compiled"):
                results.append((megadlm_ext.l2_norm(ts), megadlm_ext.flatten(ts, dtype=torch.bfloat16)))
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_copy_uses_streaming_path_correctly(dtype):
    """>= 16M elements in few tensors: the CPU non-temporal-store path (unaligned start)."""
    g = torch.Generator().manual_seed(7)
    ts = [torch.randn(8_400_001, generator=g), torch.randn(8_000_003, generator=g).to(torch.bfloat16)]
    offs = [3, 8_400_011]
    with route("compiled"):
        flat = megadlm_ext.flatten(ts, offsets=offs, scale=0.5, dtype=dtype)
    assert torch.equal(flat, expect_flatten(ts, offs, flat.numel(), dtype, 0.5))


@pytest.mark.parametrize("threads", [1, 2])
def test_large_flatten_of_small_tensors_streams_across_boundaries(threads):
    """>= 16M fp32 elements in ~8k small tensors flattened back to back: the CPU kernel streams
    whole 32-byte chunks of the output, assembling those that straddle tensors (odd sizes, a
    misaligned output start, 2 threads splitting mid-tensor); a gap or another dtype is the
    per-tensor path. Bitwise against torch.cat."""
    g = torch.Generator().manual_seed(11)
    sizes = torch.randint(1, 4097, (8200,), generator=g).tolist()
    ts = [torch.randn(n, generator=g) for n in sizes]
    n = sum(sizes)
    assert n >= 1 << 24
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with route("compiled"):
            out = torch.full((n + 1,), float("nan"))
            megadlm_ext.flatten(ts, out[1:])  # out[1:] starts 4 bytes past a 32-byte boundary
            assert torch.equal(out[1:], torch.cat(ts))
            half = len(ts) // 2
            starts = torch.tensor([0] + sizes[:-1]).cumsum(0)
            starts[half:] += 1  # one zero element between the halves
            gapped = megadlm_ext.flatten(ts, offsets=starts.tolist())
            assert torch.equal(gapped, torch.cat(ts[:half] + [torch.zeros(1)] + ts[half:]))
            mixed = ts[:-1] + [ts[-1].to(torch.bfloat16)]
            assert torch.equal(megadlm_ext.flatten(mixed), torch.cat(mixed[:-1] + [mixed[-1].float()]))
    finally:
        torch.set_num_threads(prev)


def test_generic_kernels_all_ops(cpu_isa):
    """Every op through the selected CPU kernel build, mixed dtypes, against torch."""
    g = torch.Generator().manual_seed(11)
    ts = random_list(g, 300, 700)
    offs, numel = packed_offsets(ts, [i % 5 for i in range(len(ts))])
    with route("compiled"):
        for dt in DTYPES:
            flat = megadlm_ext.flatten(ts, offsets=offs, scale=0.75, dtype=dt)
            assert torch.equal(flat, expect_flatten(ts, offs, numel, dt, 0.75))
            want = expect_accumulate(flat, ts, offs, -2.0)
            megadlm_ext.accumulate_into(flat, ts, offsets=offs, scale=-2.0)
            assert torch.equal(flat, want)
            outs = [torch.empty_like(t) for t in ts]
            megadlm_ext.unflatten(flat, outs, offsets=offs, scale=3.0)
            for o, t, r in zip(offs, ts, outs):
                assert torch.equal(r.reshape(-1), (flat[o : o + t.numel()].float() * 3.0).to(t.dtype))
        assert math.isclose(float(megadlm_ext.l2_norm(ts)), expect_norm(ts), rel_tol=2e-6)
        assert megadlm_ext.has_nonfinite(ts) is False
        ts[-1].view(-1)[-1] = float("inf") if ts[-1].numel() else 0.0
        assert megadlm_ext.has_nonfinite(ts) is bool(ts[-1].numel())
