"""Benchmark: the three issue-44 ratios against PyTorch's own in one invocation.

    OMP_NUM_THREADS=1 PYTHONPATH=python:. python benchmarks/bench_vs_torch.py

1. DDP step (bench_ddp.py's 25M-parameter MLP, 2 gloo ranks, 25 MB buckets): megadlms DDP
   (overlap on) against ``torch.nn.parallel.DistributedDataParallel`` (its defaults;
   ``zero_grad(set_to_none=True)``). Each wrapper runs in a pair of processes of its own (a
   4-rank world, fresh processes), the pairs taking turns: each round runs a few steps of
   each, the order alternating per round; per round the median wall time (slower rank) and
   CPU time (process time, mean over ranks) per step; the ratio is the median over rounds of
   the same-round ratio (CPU time is the one other jobs on a shared machine disturb least).
2. Flatten of 20,000 separately allocated fp32 tensors of 512-4096 elements
   (``megadlm_ext.flatten``) against ``torch._foreach_copy_`` (speed-up) and against one
   contiguous ``dst.copy_(src)`` of the same bytes (fraction of the copy ceiling); ops
   interleaved, per-round ratios, medians; at 1 thread and at 2 (``--flatten-threads``), every
   op given the same count.
3. pp=2 1F1B at micro-batch 2 x 64 tokens against ``torch.distributed.pipelining``:
   ``benchmarks/bench_pipeline_vs_torch.py``'s ``run(args)`` (its options are accepted here).

The CPU model is printed from /proc/cpuinfo. Nothing here is asserted: CI times nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), ROOT, os.path.join(ROOT, "benchmarks")]

import torch  # noqa: E402
from bench_ddp import _time_steps, build_model  # noqa: E402
from bench_ext import make_case  # noqa: E402

import megadlm_ext  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402

PIPELINE_BENCH = os.path.join(ROOT, "benchmarks", "bench_pipeline_vs_torch.py")


def cpu_name() -> str:
    """The processor's model name (/proc/cpuinfo), else what platform reports."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


WRAPPERS = ("torch", "ours")


def _ddp_worker(rank, ws, args):
    """Ranks 0-1 run torch DDP, ranks 2-3 ours, taking turns (world barriers between turns).

    Each wrapper lives in processes of its own, as in training: alternating both in the same
    processes let one wrapper's freed gradients shape the other's heap (rank 1, 8 rounds of 3
    steps: torch DDP 12.6k page faults per step instead of 24.8k alone, ours 11.4k instead of
    2.8k), which moved CPU time from torch's steps to ours."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    mine = WRAPPERS[rank // 2]
    x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(rank % 2))
    if mine == "torch":
        model = torch.nn.parallel.DistributedDataParallel(
            build_model(1024, 3), bucket_cap_mb=25.0, process_group=pairs[0]
        )
        sync = lambda: None  # noqa: E731
    else:
        cfg = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=25 * 2**20 // 4)
        model = DistributedDataParallel(build_model(1024, 3), cfg, process_group=pairs[1])
        sync = model.finish_grad_sync
    rounds = []
    for r in range(-1, args.ddp_rounds):  # round -1: warm-up, not kept
        for turn in WRAPPERS if r % 2 == 0 else WRAPPERS[::-1]:
            dist.barrier()  # the other pair waits, blocked, while this one runs
            if turn == mine:
                steps = _time_steps(model, sync, x, 2 if r < 0 else args.ddp_steps)
                if r >= 0:
                    wall, cpu = zip(*steps)
                    rounds.append((statistics.median(wall), statistics.median(cpu)))
    dist.barrier()
    return rounds


def ddp_ratios(args) -> dict:
    """Same-round ratios ours / torch of the DDP step (wall: slower rank; CPU: mean of ranks).
    A world of its own (fresh processes), so that the pipeline part starts from clean ones."""
    per_rank = run_distributed(_ddp_worker, 4, (args,), timeout=1800, fresh=True)
    by = {"torch": per_rank[:2], "ours": per_rank[2:]}
    wall, cpu, ms = [], [], {k: [] for k in WRAPPERS}
    for i in range(args.ddp_rounds):
        w = {k: max(r[i][0] for r in by[k]) for k in WRAPPERS}
        c = {k: statistics.mean(r[i][1] for r in by[k]) for k in WRAPPERS}
        wall.append(w["ours"] / w["torch"])
        cpu.append(c["ours"] / c["torch"])
        for k in WRAPPERS:
            ms[k].append(c[k] * 1e3)
    return {
        "wall": wall,
        "cpu": cpu,
        "cpu_ms": {k: statistics.median(v) for k, v in ms.items()},
    }


def flatten_ratios(args, threads: int) -> dict:
    """Per-round ratios of the 20k-tensor flatten: foreach / ours and copy / ours, every op
    given ``threads`` threads (``torch._foreach_copy_`` on CPU copies tensor by tensor, each
    too small to split, so it runs on one thread whatever the setting)."""
    torch.set_num_threads(threads)
    ts = make_case("b", torch.device("cpu"), torch.Generator().manual_seed(0))
    n = sum(t.numel() for t in ts)
    flat = torch.empty(n)
    views = list(torch.split(flat, [t.numel() for t in ts]))
    src, dst = torch.randn(n), torch.empty(n)
    fns = {
        "flatten": lambda: megadlm_ext.flatten(ts, flat),
        "foreach": lambda: torch._foreach_copy_(views, ts),
        "copy": lambda: dst.copy_(src),
    }
    for fn in fns.values():
        fn()
    vs_foreach, vs_copy = [], []
    for _ in range(args.flatten_rounds):
        t = {}
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            t[k] = time.perf_counter() - t0
        vs_foreach.append(t["foreach"] / t["flatten"])
        vs_copy.append(t["copy"] / t["flatten"])
    assert torch.equal(flat, torch.cat(ts))  # what was timed is a flatten
    return {"foreach": vs_foreach, "copy": vs_copy}


def _pipeline_module():
    """bench_pipeline_vs_torch.py as a module, or None when this checkout has none. Imported by
    name (benchmarks/ is on sys.path), so that its rank worker pickles for the process pool."""
    if not os.path.exists(PIPELINE_BENCH):
        return None
    return importlib.import_module("bench_pipeline_vs_torch")


def _row(name: str, ratios, target: str) -> str:
    med = statistics.median(ratios)
    return f"| {name} | {med:.3f} | {min(ratios):.2f}-{max(ratios):.2f} | {len(ratios)} | {target} |"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ddp-rounds", type=int, default=12)
    ap.add_argument("--ddp-steps", type=int, default=3, help="steps per configuration per round")
    ap.add_argument("--flatten-rounds", type=int, default=31)
    ap.add_argument(
        "--flatten-threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="thread counts to run the flatten rows at (1: every op single-threaded; 2: this "
        "machine's cores, given to every op)",
    )
    pipe = _pipeline_module()
    if pipe is not None:
        pipe.add_args(ap)
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, load avg {load:.2f} at start")
    ddp = ddp_ratios(args)
    flat = {n: flatten_ratios(args, n) for n in args.flatten_threads}
    print("\n| ratio | median | min-max | rounds | target |")
    print("|---|---|---|---|---|")
    print(_row("DDP step CPU time, ours / torch DDP", ddp["cpu"], "<= 0.95"))
    print(_row("DDP step wall time, ours / torch DDP", ddp["wall"], "<= 0.95"))
    for n, f in flat.items():
        t = f"{n} thread{'s' if n > 1 else ''}"
        print(_row(f"flatten 20k tensors, speed-up vs _foreach_copy_, {t}", f["foreach"], ">= 3"))
        print(_row(f"flatten 20k tensors, fraction of copy ceiling, {t}", f["copy"], ">= 0.8"))
    cpu_ms = ddp["cpu_ms"]
    print(f"\nDDP step CPU ms (median over rounds): torch {cpu_ms['torch']:.1f}, ours {cpu_ms['ours']:.1f}")
    if pipe is None:
        print(
            "\npp2 1F1B vs torch.distributed.pipelining: skipped, this checkout has no "
            "benchmarks/bench_pipeline_vs_torch.py"
        )
        return
    print("\npp2 1F1B vs torch.distributed.pipelining (bench_pipeline_vs_torch.py):")
    pipe.print_table(pipe.run(args))


if __name__ == "__main__":
    main()
