"""Profile one DDP step phase by phase: torch DDP against megadlms DDP (bench_ddp.py's model).

    OMP_NUM_THREADS=1 PYTHONPATH=python:. python benchmarks/profile_ddp.py [torch] [ours]

Two gloo ranks, 1 thread each, 25 MB buckets; 3 warm-up steps, then 6 profiled steps
(zero grads, forward, backward, gradient sync) under the torch profiler. Prints rank 0's ops
by self CPU time; divide by 6 for the time per step. Our grad-buffer ops show up as
``aten::fill_`` (zeroing), ``aten::add_`` / ``aten::add`` (the accumulation into main_grad),
``torch::autograd::AccumulateGrad`` (the hooks; self time includes Python and freeing) and
``grad-sync bucket N`` (launches); torch DDP's as ``aten::copy_`` and ``aten::mul`` (the
reducer's bucket copies and 1/dp), ``c10d::allreduce_``.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), ROOT, os.path.join(ROOT, "benchmarks")]

import torch  # noqa: E402
from bench_ddp import build_model  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from tests.dist_utils import run_distributed  # noqa: E402

WRAPPERS = ("torch", "ours")


def _worker(rank, ws, which):
    torch.set_num_threads(1)
    from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig

    x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(rank))
    if which == WRAPPERS[0]:
        m = torch.nn.parallel.DistributedDataParallel(build_model(1024, 3), bucket_cap_mb=25)
        zero, sync = (lambda: m.zero_grad(set_to_none=True)), (lambda: None)
    else:
        cfg = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=25 * 2**20 // 4)
        m = DistributedDataParallel(build_model(1024, 3), cfg)
        zero, sync = m.zero_grad_buffer, m.finish_grad_sync

    def step():
        zero()
        m(x).float().pow(2).mean().backward()
        sync()

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(6):
            step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14) if rank == 0 else None


def main() -> None:
    for which in sys.argv[1:] or WRAPPERS:
        if which not in WRAPPERS:
            raise SystemExit(f"unknown wrapper {which!r}: pick from {WRAPPERS}")
        print(f"===== {which}")
        print(run_distributed(_worker, 2, (which,), timeout=600)[0])


if __name__ == "__main__":
    main()
