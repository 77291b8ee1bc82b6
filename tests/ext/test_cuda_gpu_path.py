"""The CUDA kernels on the paths DDP and CUDA graphs use -- GPU only.

Lists of more than 2^31 elements (64-bit indexing), a non-default stream, CUDA-graph
capture and replay, the device segment-table cache, and the refusal of an op the GPU
does not run.
"""

import pytest
import torch

import megadlm_ext
from megadlm_ext import _C

from .helpers import eagerly, route

pytestmark = pytest.mark.gpu


def _cache():
    return _C._cuda_table_cache_stats()  # (hits, misses, entries)


@pytest.mark.slow
def test_more_than_2_31_elements():
    """Two bf16 tensors totalling 2^31 + 2^20 elements: offsets and the global range are
    64-bit; the last element is reached."""
    n0, n1 = 1 << 30, (1 << 30) + (1 << 20)
    a = torch.full((n0,), 1.0, device="cuda", dtype=torch.bfloat16)
    b = torch.full((n1,), 2.0, device="cuda", dtype=torch.bfloat16)
    b[-1] = 3.0
    with route("compiled"):
        flat = megadlm_ext.flatten([a, b])
        assert flat.numel() == n0 + n1 > 2**31
        assert float(flat[n0 - 1]) == 1.0 and float(flat[n0]) == 2.0 and float(flat[-1]) == 3.0
        assert int((flat == 2.0).sum()) == n1 - 1
        norm = float(megadlm_ext.l2_norm([a, b]))
        want = (n0 * 1.0 + (n1 - 1) * 4.0 + 9.0) ** 0.5
        assert abs(norm - want) / want < 1e-4
        assert megadlm_ext.has_nonfinite([a, b]) is False
        b[-1] = float("inf")
        assert megadlm_ext.has_nonfinite([a, b]) is True
    del a, b, flat
    torch.cuda.empty_cache()


def test_non_default_stream_orders_after_producer():
    """Ops run on the current (side) stream, after the work queued there before them."""
    side = torch.cuda.Stream()
    ts = [torch.zeros(4096, device="cuda") for _ in range(64)]
    out = torch.empty(64 * 4096, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side), route("compiled"):
        torch.cuda._sleep(50_000_000)  # a slow producer on the side stream
        for t in ts:
            t.fill_(1.5)
        megadlm_ext.flatten(ts, out)
        megadlm_ext.scale_(ts, 2.0)
        norm = megadlm_ext.l2_norm(ts)
    side.synchronize()
    assert torch.equal(out, torch.full_like(out, 1.5))
    assert all(torch.equal(t, torch.full_like(t, 3.0)) for t in ts)
    assert abs(float(norm) - (64 * 4096 * 9.0) ** 0.5) < 1e-2


@pytest.mark.cuda_graph
def test_cuda_graph_capture_and_replay():
    """flatten / accumulate_into / l2_norm captured once, replayed on new values."""
    g = torch.Generator(device="cuda").manual_seed(0)
    ts = [torch.randn(n, device="cuda", generator=g).bfloat16() for n in (7, 1000, 4099, 65_536)]
    numel = sum(t.numel() for t in ts)
    flat, acc = torch.empty(numel, device="cuda"), torch.zeros(numel, device="cuda")
    with eagerly(), route("compiled"):  # every captured op once outside capture (acc is zeroed below)
        megadlm_ext.flatten(ts, flat)
        megadlm_ext.accumulate_into(acc, ts)
        megadlm_ext.l2_norm(ts)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), route("compiled"):
        megadlm_ext.flatten(ts, flat, scale=2.0)
        megadlm_ext.accumulate_into(acc, ts, scale=0.5)
        norm = megadlm_ext.l2_norm(ts)
    for step in range(3):
        for t in ts:
            t.copy_(torch.randn(t.shape, device="cuda", generator=g))
        acc.zero_()
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.cat([t.float() for t in ts])
        assert torch.equal(flat, ref * 2.0), step
        assert torch.equal(acc, ref * 0.5), step
        assert abs(float(norm) - float(ref.double().norm())) < 1e-3 * float(ref.norm())
    _C._cuda_clear_table_cache()  # entries captured by the graph are kept
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(flat, torch.cat([t.float() for t in ts]) * 2.0)


@pytest.mark.cuda_graph
def test_table_first_seen_under_capture_is_filled_for_eager_calls():
    """A table first uploaded while a graph is captured is filled outside the graph: an
    eager call that hits it before any replay reads the right segments."""
    ts = [torch.randn(n, device="cuda") for n in (5, 300, 4099)]
    numel = sum(t.numel() for t in ts)
    flat = torch.zeros(numel, device="cuda")
    with eagerly(), route("compiled"):  # the kernel loaded on other tensors: the capture still misses
        megadlm_ext.accumulate_into(torch.zeros_like(flat), [t.clone() for t in ts])
    _C._cuda_clear_table_cache()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), route("compiled"):
        megadlm_ext.accumulate_into(flat, ts)  # a miss under capture
    torch.cuda.synchronize()
    with route("compiled"):
        h0 = _cache()[0]
        megadlm_ext.accumulate_into(flat, ts)  # eager hit on that entry, no replay yet
        assert _cache()[0] == h0 + 1
    torch.cuda.synchronize()
    assert torch.equal(flat, torch.cat(ts))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(flat, torch.cat(ts) * 2)


def test_segment_table_uploaded_once_per_bucket():
    ts = [torch.randn(n, device="cuda") for n in range(1, 2000)]
    out = torch.empty(sum(t.numel() for t in ts), device="cuda")
    _C._cuda_clear_table_cache()
    with route("compiled"):
        megadlm_ext.flatten(ts, out)
        h0, m0, _ = _cache()
        for _ in range(5):
            megadlm_ext.flatten(ts, out)
            megadlm_ext.accumulate_into(out, ts)  # the same table (list -> flat)
        h1, m1, _ = _cache()
        assert (m1 - m0, h1 - h0) == (0, 10)
        ts[3] = torch.randn(4, device="cuda")  # another tensor: another table
        megadlm_ext.flatten(ts, out)
        assert _cache()[1] == m1 + 1
    torch.cuda.synchronize()
    assert torch.equal(out, torch.cat([t.reshape(-1) for t in ts]))


def test_mixed_list_matches_typed_lists():
    """The per-segment dispatch kernel (mixed dtypes) equals the typed kernels."""
    g = torch.Generator(device="cuda").manual_seed(3)
    dts = (torch.float32, torch.bfloat16, torch.float16)
    ts = [torch.randn(100 + 37 * i, device="cuda", generator=g).to(dts[i % 3]) for i in range(60)]
    with route("compiled"):
        mixed = megadlm_ext.flatten(ts, dtype=torch.float32)
        typed = torch.cat([megadlm_ext.flatten([t], dtype=torch.float32) for t in ts])
    assert torch.equal(mixed, typed)
