"""Benchmark: the MoE experts' grouped GEMM (``megadlms.ops.grouped_matmul``, one
``megadlm_ext.grouped_gemm`` call per GEMM) vs a per-expert loop of torch matmuls (what a
naive experts module runs: split, E matmuls, cat), forward + backward, CPU.

    PYTHONPATH=python:. python benchmarks/bench_grouped_gemm.py [--dtype bf16] [--threads 1]

Tokens are routed unevenly (a fixed random skew, one expert gets none) as a top-k router
would. Both variants run round-robin in the same process, so background load hits them
alike; the table gives the median and best time of ``--repeats`` runs (each ``--iters``
forward+backward passes) and the ratio loop / grouped (> 1: grouped is faster).
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

from megadlms.ops import grouped_matmul  # noqa: E402


def _routing(tokens, experts, gen):
    w = torch.rand(experts, generator=gen) ** 2
    w[-1] = 0.0  # an expert without tokens
    counts = (w / w.sum() * tokens).floor().long()
    counts[0] += tokens - int(counts.sum())
    return counts


def _loop(x, w, counts):
    return torch.cat([xe @ w[e].t() for e, xe in enumerate(torch.split(x, counts.tolist()))])


def _time(fn, iters):
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def run_case(tokens, experts, hidden, ffn, dtype, iters, repeats):
    gen = torch.Generator().manual_seed(0)
    counts = _routing(tokens, experts, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(experts, ffn, hidden, generator=gen) * 0.02).to(dtype).requires_grad_()
    dy = torch.randn(tokens, ffn, generator=gen).to(dtype)

    def grouped():
        x.grad = w.grad = None
        grouped_matmul(x, w, counts).backward(dy)

    def loop():
        x.grad = w.grad = None
        _loop(x, w, counts).backward(dy)

    grouped(), loop()  # warm-up (allocator, threads)
    tg, tl = [], []
    for _ in range(repeats):
        tg.append(_time(grouped, iters))
        tl.append(_time(loop, iters))
    return dict(grouped=tg, loop=tl, counts=counts.tolist())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cases = [(512, 8, 128, 256), (2048, 8, 256, 512), (2048, 32, 128, 256), (4096, 64, 64, 128)]
    print(
        f"dtype {args.dtype}, {args.threads} thread(s), "
        f"median (best) of {args.repeats} x {args.iters} fwd+bwd"
    )
    print("| tokens | experts | hidden | ffn | grouped ms | per-expert loop ms | loop / grouped |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for tokens, experts, hidden, ffn in cases:
        r = run_case(tokens, experts, hidden, ffn, dtype, args.iters, args.repeats)
        g, lp = statistics.median(r["grouped"]), statistics.median(r["loop"])
        print(
            f"| {tokens} | {experts} | {hidden} | {ffn} | {g * 1e3:.2f} ({min(r['grouped']) * 1e3:.2f}) | "
            f"{lp * 1e3:.2f} ({min(r['loop']) * 1e3:.2f}) | {lp / g:.2f} |"
        )


if __name__ == "__main__":
    main()
