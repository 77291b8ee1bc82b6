"""megadlm_ext.TensorTable on CUDA -- GPU only.

Table ops equal list ops bitwise; the table's own device copy is used (no lookup in the
content cache of lists, one upload per flat buffer); one kernel launch per eager call;
CUDA-graph capture and replay, also after the table is gone; a table first used under
capture; a non-default stream; a table in a module global at interpreter exit.
"""

import subprocess
import sys

import pytest
import torch

import megadlm_ext
from megadlm_ext import _C

from .helpers import eagerly, packed_offsets, random_list, route

pytestmark = pytest.mark.gpu


def _global_cache():
    return _C._cuda_table_cache_stats()  # (hits, misses, entries) of the lists' cache


def _lists(seed=0, n=3000, max_numel=300):
    g = torch.Generator().manual_seed(seed)
    return [t.cuda() for t in random_list(g, n, max_numel)]


@pytest.mark.parametrize("flat_dtype", [torch.float32, torch.bfloat16])
def test_table_equals_list_on_cuda(flat_dtype):
    ts = _lists()
    offs, numel = packed_offsets(ts, [i % 3 for i in range(len(ts))])  # misaligned starts
    with route("compiled"):
        table = megadlm_ext.TensorTable(ts, offsets=offs)
        fl = megadlm_ext.flatten(ts, offsets=offs, scale=0.25, dtype=flat_dtype)
        ft = megadlm_ext.flatten(table, scale=0.25, dtype=flat_dtype)
        assert torch.equal(fl, ft)
        al, at = fl.clone(), ft.clone()
        megadlm_ext.accumulate_into(al, ts, offsets=offs, scale=-1.5)
        megadlm_ext.accumulate_into(at, table, scale=-1.5)
        assert torch.equal(al, at)
        assert torch.equal(megadlm_ext.l2_norm(ts), megadlm_ext.l2_norm(table))
        assert torch.equal(megadlm_ext.nonfinite_flag(ts), megadlm_ext.nonfinite_flag(table))
        work = [t.clone() for t in ts]
        wtable = megadlm_ext.TensorTable(work, offsets=offs)
        megadlm_ext.unflatten(al, ts, offsets=offs, scale=3.0)
        megadlm_ext.unflatten(al, wtable, scale=3.0)
        megadlm_ext.scale_(ts, 0.5)
        megadlm_ext.scale_(wtable, 0.5)
        assert all(torch.equal(a, b) for a, b in zip(ts, work))
        assert megadlm_ext.has_nonfinite(wtable) is False
        max(work, key=lambda t: t.numel()).view(-1)[-1] = float("nan")
        assert megadlm_ext.has_nonfinite(wtable) is True


def test_table_uses_its_own_device_copy():
    """After the first call on a flat buffer nothing is built, uploaded or looked up."""
    ts = [torch.randn(n, device="cuda") for n in range(1, 2000)]
    out = torch.empty(sum(t.numel() for t in ts), device="cuda")
    with route("compiled"):
        table = megadlm_ext.TensorTable(ts)
        g0 = _global_cache()
        for _ in range(5):
            megadlm_ext.flatten(table, out)
            megadlm_ext.accumulate_into(out, table)
            megadlm_ext.l2_norm(table)
        assert _global_cache()[:2] == g0[:2]  # the lists' cache was not consulted
        assert table._cache_stats() == (13, 2, 2)  # (list -> out) and read-only, once each
    torch.cuda.synchronize()
    assert torch.equal(out, torch.cat(ts) * 2)


@pytest.mark.profiler
def test_one_launch_per_eager_call():
    ts = [torch.randn(int(n), device="cuda") for n in torch.randint(1, 4097, (10_000,))]
    out = torch.empty(sum(t.numel() for t in ts), device="cuda")
    with route("compiled"):
        table = megadlm_ext.TensorTable(ts)
        megadlm_ext.flatten(table, out)  # warm-up: the upload
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            megadlm_ext.flatten(table, out)
            torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len([n for n in names if "megadlm" in n]) == 1, names
    assert not [n for n in names if "Memcpy" in n or "memcpy" in n], names  # nothing uploaded
    assert torch.equal(out, torch.cat(ts))


@pytest.mark.cuda_graph
def test_graph_capture_and_replay_outlive_the_table():
    """Ops on a table captured once, replayed on new values; the graph keeps working after
    the table is deleted and the lists' cache is cleared (its device copies are kept)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    ts = [torch.randn(n, device="cuda", generator=g).bfloat16() for n in (7, 1000, 4099, 65_536)]
    numel = sum(t.numel() for t in ts)
    flat, acc = torch.empty(numel, device="cuda"), torch.zeros(numel, device="cuda")
    table = megadlm_ext.TensorTable(ts)
    with eagerly(), route("compiled"):  # every captured op once outside capture (uploads; acc zeroed below)
        megadlm_ext.flatten(table, flat)
        megadlm_ext.accumulate_into(acc, table)
        megadlm_ext.l2_norm(table)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), route("compiled"):
        megadlm_ext.flatten(table, flat, scale=2.0)
        megadlm_ext.accumulate_into(acc, table, scale=0.5)
        norm = megadlm_ext.l2_norm(table)
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
    del table
    _C._cuda_clear_table_cache()
    junk = [torch.full((1 << 16,), 7.0, device="cuda") for _ in range(8)]  # reuse freed blocks
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(flat, torch.cat([t.float() for t in ts]) * 2.0)
    del junk


@pytest.mark.cuda_graph
def test_table_first_used_under_capture():
    """A table whose first call is captured is uploaded outside the graph: an eager call
    before any replay reads the right segments."""
    ts = [torch.randn(n, device="cuda") for n in (5, 300, 4099)]
    flat = torch.zeros(sum(t.numel() for t in ts), device="cuda")
    table = megadlm_ext.TensorTable(ts)
    with (
        eagerly(),
        route("compiled"),
    ):  # the kernel loaded through another table: this one's first use is captured
        megadlm_ext.accumulate_into(torch.zeros_like(flat), megadlm_ext.TensorTable([t.clone() for t in ts]))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), route("compiled"):
        megadlm_ext.accumulate_into(flat, table)
    torch.cuda.synchronize()
    with route("compiled"):
        megadlm_ext.accumulate_into(flat, table)  # eager, on the copy made at capture
    torch.cuda.synchronize()
    assert torch.equal(flat, torch.cat(ts))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(flat, torch.cat(ts) * 2)


def test_non_default_stream_orders_after_producer():
    side = torch.cuda.Stream()
    ts = [torch.zeros(4096, device="cuda") for _ in range(64)]
    out = torch.empty(64 * 4096, device="cuda")
    table = megadlm_ext.TensorTable(ts)
    with route("compiled"):
        megadlm_ext.flatten(table, out)  # uploaded on the default stream
    torch.cuda.synchronize()
    with torch.cuda.stream(side), route("compiled"):
        torch.cuda._sleep(50_000_000)  # a slow producer on the side stream
        for t in ts:
            t.fill_(1.5)
        megadlm_ext.flatten(table, out)
        megadlm_ext.scale_(table, 2.0)
        norm = megadlm_ext.l2_norm(table)
    side.synchronize()
    assert torch.equal(out, torch.full_like(out, 1.5))
    assert all(torch.equal(t, torch.full_like(t, 3.0)) for t in ts)
    assert abs(float(norm) - (64 * 4096 * 9.0) ** 0.5) < 1e-2


@pytest.mark.cuda_graph
def test_cuda_table_in_a_module_global_at_exit():
    """Freed during interpreter finalization, before the CUDA runtime unloads: exit 0."""
    code = (
        "import torch, megadlm_ext\n"
        "T = megadlm_ext.TensorTable([torch.ones(5, device='cuda') for _ in range(3)])\n"
        "F = torch.empty(15, device='cuda')\n"
        "megadlm_ext.flatten(T, F); megadlm_ext.scale_(T, 2.0)\n"
        "megadlm_ext.accumulate_into(F, T)\n"  # the captured op's kernel loaded outside capture
        "G = torch.cuda.CUDAGraph()\n"
        "with torch.cuda.graph(G):\n"
        "    megadlm_ext.accumulate_into(F, T)\n"
        "print(float(megadlm_ext.l2_norm(T)))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert abs(float(r.stdout.split()[-1]) - (15 * 4.0) ** 0.5) < 1e-4
