"""Benchmark: megadlms DDP vs torch.nn.parallel.DistributedDataParallel (same bucket bytes),
and optimizer-state bytes per rank with/without the distributed optimizer.

    PYTHONPATH=python:. python benchmarks/bench_ddp.py            # 2 ranks, gloo, CPU, ~25M params

Step = zero grads + forward + backward + gradient sync (finish_grad_sync for ours). The
configurations run round-robin in the same world (a few steps each per round), so
background load hits them alike; the table reports the median and the best step time of
each (slowest rank), and the median CPU time per step (process time, mean over ranks; the
least sensitive to other jobs on a shared machine), each with its ratio to torch DDP.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), ROOT]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.dist_utils import run_distributed  # noqa: E402


def build_model(hidden: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [
            torch.nn.Linear(hidden, 4 * hidden),
            torch.nn.GELU(),
            torch.nn.Linear(4 * hidden, hidden),
            torch.nn.LayerNorm(hidden),
        ]
    return torch.nn.Sequential(*blocks)


def _time_steps(model, sync, x, steps):
    """(wall seconds, CPU seconds of this process incl. its comm threads) per step."""
    times = []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        model.zero_grad(set_to_none=True) if not hasattr(
            model, "zero_grad_buffer"
        ) else model.zero_grad_buffer()
        model(x).float().pow(2).mean().backward()
        sync()
        times.append((time.perf_counter() - t0, time.process_time() - c0))
    return times


def _worker(rank, ws, args):
    torch.set_num_threads(args.threads)
    from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig, Float16Module
    from megadlms.optimizer import OptimizerConfig, get_optimizer

    bucket_elems = int(args.bucket_mb * 1024 * 1024 / 4)
    x = torch.randn(args.batch, args.hidden, generator=torch.Generator().manual_seed(rank))
    runs = {
        "torch DDP": lambda: (lambda m: (m, lambda: None))(
            torch.nn.parallel.DistributedDataParallel(
                build_model(args.hidden, args.layers), bucket_cap_mb=args.bucket_mb
            )
        ),
    }
    for overlap in (True, False):

        def make(overlap=overlap):
            m = DistributedDataParallel(
                build_model(args.hidden, args.layers),
                DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=bucket_elems),
            )
            return m, m.finish_grad_sync

        runs[f"megadlms DDP overlap={'on' if overlap else 'off'}"] = make
    built = {name: mk() for name, mk in runs.items()}
    for m, sync in built.values():
        _time_steps(m, sync, x, args.warmup)
    times = {name: [] for name in built}
    for _ in range(args.rounds):
        for name, (m, sync) in built.items():
            times[name] += _time_steps(m, sync, x, args.steps)
    n_params = sum(p.numel() for p in build_model(args.hidden, args.layers).parameters())
    del built

    # Optimizer-state bytes per rank after one step (state is created lazily).
    mem = {}
    for bf16 in (False, True):
        for distopt in (False, True):
            module = build_model(args.hidden, args.layers)
            if bf16:
                module = Float16Module(module, dtype=torch.bfloat16)
            m = DistributedDataParallel(
                module,
                DistributedDataParallelConfig(
                    use_distributed_optimizer=distopt, grad_reduce_in_fp32=bf16, bucket_size=bucket_elems
                ),
            )
            opt = get_optimizer(OptimizerConfig(lr=1e-4, bf16=bf16, use_distributed_optimizer=distopt), m)
            m(x).float().pow(2).mean().backward()
            m.finish_grad_sync()
            opt.step()
            mem[(bf16, distopt)] = opt.state_bytes()
            del m, opt, module
    dist.barrier()
    return (
        rank,
        {
            k: (statistics.median(w for w, _ in v), min(w for w, _ in v), statistics.median(c for _, c in v))
            for k, v in times.items()
        },
        mem,
        n_params,
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024, help="model width (4x MLP blocks)")
    ap.add_argument("--layers", type=int, default=3, help="MLP blocks; 3 x 1024 is ~25M params")
    ap.add_argument("--batch", type=int, default=32, help="rows per rank")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="bucket bytes (fp32) for both wrappers")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per config per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args(argv)
    results = run_distributed(_worker, args.world_size, (args,), timeout=1800)
    _, t0, mem0, n_params = results[0]
    ws = args.world_size
    # wall: the slowest rank sets the pace; CPU: mean over ranks (insensitive to other load)
    med = {k: max(r[1][k][0] for r in results) for k in t0}
    best = {k: max(r[1][k][1] for r in results) for k in t0}
    cpu = {k: statistics.mean(r[1][k][2] for r in results) for k in t0}
    print(
        f"model: {n_params / 1e6:.1f}M params, {ws} ranks (gloo, CPU, {args.threads} thread/rank), "
        f"batch {args.batch}/rank, buckets {args.bucket_mb} MB, {args.rounds * args.steps} timed steps each"
    )
    print(
        f"{'configuration':30s} {'median ms':>10s} {'ratio':>6s} {'best ms':>8s} {'ratio':>6s} "
        f"{'CPU ms':>7s} {'ratio':>6s}"
    )
    ref = "torch DDP"
    for k in t0:
        print(
            f"{k:30s} {med[k] * 1e3:10.1f} {med[k] / med[ref]:5.2f}x {best[k] * 1e3:8.1f} "
            f"{best[k] / best[ref]:5.2f}x {cpu[k] * 1e3:7.1f} {cpu[k] / cpu[ref]:5.2f}x"
        )
    print()
    print(f"{'optimizer state per rank':34s} {'MiB':>9s} {'vs total/dp':>13s}")
    for (bf16, distopt), b in mem0.items():
        full = mem0[(bf16, False)]
        name = f"{'bf16' if bf16 else 'fp32'} {'distributed optimizer' if distopt else 'replicated'}"
        ratio = b / (full / ws) if distopt else b / full
        print(f"{name:34s} {b / 2**20:9.2f} {ratio:12.3f}{'' if distopt else ' (= total)'}")


if __name__ == "__main__":
    main()
