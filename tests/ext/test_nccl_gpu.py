"""nccl_ext on real GPUs: overlap, clear errors instead of hangs, multi-rank collectives.

GPU only. The two-ranks-on-one-GPU case must end in an error (NCCL refuses duplicate
GPUs) within the timeout, never hang; the multi-rank tests need 2+ GPUs.
"""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from megadlm_ext import nccl

pytestmark = pytest.mark.gpu


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, device_of_rank, scenario, results):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)  # only ships the unique id
    dev = device_of_rank(rank)
    torch.cuda.set_device(dev)
    try:
        comm = nccl.Communicator.from_process_group(None, device=dev, timeout=60.0)
        x = torch.full((1 << 20,), float(rank + 1), device="cuda")
        if scenario == "skip" and rank == 1:
            results[rank] = "skipped"
            dist.barrier()
            return
        comm.all_reduce(x, op="sum").wait()
        torch.cuda.synchronize()
        out = torch.empty(x.numel() // world, device="cuda")
        comm.reduce_scatter(out, x, op="avg").wait()
        g = torch.empty(x.numel() * world, device="cuda")
        comm.all_gather(g, x).wait()
        torch.cuda.synchronize()
        total = world * (world + 1) / 2
        ok = bool((x == total).all() and (out == total / world).all() and (g == total).all())
        results[rank] = "ok" if ok else "wrong values"
        comm.close()
    except nccl.NcclError as exc:
        results[rank] = f"NcclError: {exc}"
    if scenario == "skip":
        dist.barrier()
    dist.destroy_process_group()


def _same_gpu(rank):
    return 0


def _own_gpu(rank):
    return rank


def _run(world, device_of_rank, scenario="collectives", timeout=180):
    ctx = mp.get_context("spawn")
    results, port = ctx.Manager().dict(), _port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, device_of_rank, scenario, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} hung for {timeout} s: {dict(results)}"
    return dict(results)


def test_two_ranks_on_one_gpu_fail_clearly():
    res = _run(2, _same_gpu)
    assert set(res) == {0, 1}, res
    for r, msg in res.items():
        assert msg.startswith("NcclError") and f"rank {r} of 2" in msg, res


def test_single_rank_overlap_on_own_stream():
    dev = torch.cuda.current_device()
    with nccl.Communicator(nccl.unique_id(), 0, 1, dev, timeout=30.0) as comm:
        x = torch.randn(1 << 22, device="cuda")
        y = x.clone()
        assert comm._comm.stream_id != torch.cuda.current_stream().cuda_stream
        work = comm.all_reduce(y, op="avg")
        work.wait()  # device-side: the current stream waits; no host sync needed
        z = y * 1.0  # queued after the collective on the current stream
        torch.cuda.synchronize()
        assert work.is_completed() and torch.equal(z, x)


@pytest.mark.cuda_graph
def test_collective_captured_into_a_cuda_graph_replays_without_a_watchdog_abort():
    """The watchdog (bound to this device) skips the captured work: no failed event query
    and no abort across several poll periods; replays redo the collective."""
    import time

    dev = torch.cuda.current_device()
    with nccl.Communicator(nccl.unique_id(), 0, 1, dev, timeout=30.0) as comm:
        x = torch.ones(1 << 16, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up outside capture
            comm.all_reduce(x, op="sum").wait()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            work = comm.all_reduce(x, op="sum")
            work.wait()
            y = x * 2.0
        time.sleep(0.5)  # > the watchdog's poll period
        assert comm.error() == ""
        with pytest.raises(nccl.NcclError, match="captured into a CUDA graph"):
            work.is_completed()
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, torch.full_like(x, 2.0)) and comm.error() == ""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_multi_rank_collectives():
    world = torch.cuda.device_count()
    res = _run(world, _own_gpu)
    assert all(v == "ok" for v in res.values()), res


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_rank_that_skips_a_collective_gives_an_error_not_a_hang():
    res = _run(2, _own_gpu, scenario="skip", timeout=240)
    assert res[1] == "skipped"
    assert "did not complete within" in res[0] and "rank 0 of 2" in res[0], res
