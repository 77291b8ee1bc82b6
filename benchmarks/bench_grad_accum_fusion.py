"""Benchmark: gradient-accumulation fusion on vs off (bf16 params, fp32 grads, CPU).

    PYTHONPATH=python:. python benchmarks/bench_grad_accum_fusion.py

A GPT-like stack of tensor-parallel linears (tp=1): per layer a fused-QKV and a projection
(column + row), and an MLP (column h->4h, row 4h->h), with LayerNorms and residuals, in
bf16 under our DistributedDataParallel(grad_reduce_in_fp32=True) on one process. Step =
zero_grad_buffer + M micro-batches (all but the last under no_sync) + finish_grad_sync.
Both models run round-robin in the same process, so background load hits them alike; the
table gives the median and best step time, the median CPU time of the process per step
(least sensitive to other jobs on a shared machine) and the ratio fused / unfused.

Peak memory is measured with torch's own CPU allocator accounting: the profiler with
``profile_memory=True`` records every allocation and free of the CPU allocator; the peak of
the running sum over one step (above what was live at its start) is the extra tensor memory
that step needed (activations, saved tensors, gradients). (tracemalloc does not see torch's
allocations; resident-set deltas are blurred by glibc's caching.)

The last table is the weight-gradient GEMM alone: torch's bf16 ``go.T @ x`` (what autograd
runs without fusion) vs ``megadlm_ext.wgrad_accumulate`` into an fp32 buffer.
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
import torch.nn.functional as F  # noqa: E402

import megadlm_ext  # noqa: E402
from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megadlms.parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402


class Layer(torch.nn.Module):
    def __init__(self, h, fusion, gen):
        super().__init__()
        kw = dict(tp_group=None, generator=gen, dtype=torch.bfloat16, gradient_accumulation_fusion=fusion)
        self.ln1 = torch.nn.LayerNorm(h, dtype=torch.bfloat16)
        self.qkv = ColumnParallelLinear(h, 3 * h, **kw)
        self.proj = RowParallelLinear(h, h, **kw)
        self.ln2 = torch.nn.LayerNorm(h, dtype=torch.bfloat16)
        self.fc1 = ColumnParallelLinear(h, 4 * h, **kw)
        self.fc2 = RowParallelLinear(4 * h, h, **kw)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def build(args, fusion):
    gen = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(*[Layer(args.hidden, fusion, gen) for _ in range(args.layers)])
    return DistributedDataParallel(net, DistributedDataParallelConfig(grad_reduce_in_fp32=True))


def step(model, xs):
    model.zero_grad_buffer()
    for i, x in enumerate(xs):
        if i < len(xs) - 1:
            with model.no_sync():
                model(x).float().pow(2).mean().backward()
        else:
            model(x).float().pow(2).mean().backward()
    model.finish_grad_sync()


def peak_step_bytes(model, xs) -> int:
    """Peak of (allocated - freed) during one step, from the CPU allocator's records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(model, xs)
    # The raw allocator records ("[memory]" events: +bytes on allocation, -bytes on free).
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(records, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def gemm_table(args):
    rows = args.batch * args.seq
    out = {}
    for o, i in (
        (3 * args.hidden, args.hidden),
        (4 * args.hidden, args.hidden),
        (args.hidden, 4 * args.hidden),
    ):
        go = torch.randn(rows, o).bfloat16()
        x = torch.randn(rows, i).bfloat16()
        mg = torch.zeros(o, i)
        fns = {
            "torch bf16 go.T @ x": lambda go=go, x=x: go.t() @ x,
            "wgrad_accumulate": lambda mg=mg, go=go, x=x: megadlm_ext.wgrad_accumulate(mg, go, x),
        }
        ts = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f()
                ts[k].append(time.perf_counter() - t0)
        out[(o, i)] = {k: statistics.median(v) for k, v in ts.items()}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7, help="timed steps per configuration (round-robin)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(1)
    xs = [
        torch.randn(args.batch, args.seq, args.hidden, generator=g).bfloat16()
        for _ in range(args.micro_batches)
    ]
    models = {"fusion off": build(args, False), "fusion on": build(args, True)}
    n_params = sum(p.numel() for p in models["fusion off"].parameters())
    for m in models.values():
        for _ in range(args.warmup):
            step(m, xs)
    times = {k: [] for k in models}
    cpu = {k: [] for k in models}  # process CPU time: the least sensitive to other jobs
    for _ in range(args.rounds):
        for k, m in models.items():
            t0, c0 = time.perf_counter(), time.process_time()
            step(m, xs)
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    peaks = {k: peak_step_bytes(m, xs) for k, m in models.items()}
    grads = {k: torch.cat([p.main_grad.reshape(-1) for p in m.param_names]) for k, m in models.items()}
    diff = ((grads["fusion on"] - grads["fusion off"]).norm() / grads["fusion off"].norm()).item()

    print(
        f"model: {args.layers} layers x hidden {args.hidden} "
        f"({n_params / 1e6:.1f}M bf16 params, fp32 grads), "
        f"{args.micro_batches} micro-batches of {args.batch}x{args.seq} tokens, {args.threads} thread(s), "
        f"{args.rounds} timed steps each"
    )
    base = "fusion off"
    cols = ("median ms", 10), ("ratio", 6), ("best ms", 8), ("ratio", 6), ("CPU ms", 8), ("ratio", 6)
    cols += ("peak MiB", 9), ("ratio", 6)
    print(f"{'configuration':14s} " + " ".join(f"{c:>{w}s}" for c, w in cols))
    for k in models:
        med, best, c = statistics.median(times[k]), min(times[k]), statistics.median(cpu[k])
        print(
            f"{k:14s} {med * 1e3:10.1f} {med / statistics.median(times[base]):5.2f}x {best * 1e3:8.1f} "
            f"{best / min(times[base]):5.2f}x {c * 1e3:8.1f} {c / statistics.median(cpu[base]):5.2f}x "
            f"{peaks[k] / 2**20:9.1f} {peaks[k] / peaks[base]:5.2f}x"
        )
    weight_bytes = sum(p.numel() * 2 for p in models[base].module.parameters() if p.dim() == 2)
    print(f"bf16 bytes of all linear weights: {weight_bytes / 2**20:.1f} MiB")
    print(f"|main_grad(on) - main_grad(off)| / |main_grad(off)| = {diff:.2e}")
    print()
    title = f"wgrad GEMM [out, in], rows={args.batch * args.seq}"
    print(f"{title:34s} {'torch bf16 ms':>14s} {'fused ms':>9s} {'ratio':>6s}")
    for (o, i), t in gemm_table(args).items():
        a, b = t["torch bf16 go.T @ x"], t["wgrad_accumulate"]
        print(f"{str([o, i]):34s} {a * 1e3:14.2f} {b * 1e3:9.2f} {b / a:5.2f}x")


if __name__ == "__main__":
    main()
