"""Benchmark: the pipeline bubble of 1F1B and interleaved 1F1B on CPU gloo ranks, measured
from the schedule's timeline, against theory; and the step time of pp=2 vs pp=1 on the same
global batch.

    OMP_NUM_THREADS=1 PYTHONPATH=python:. python benchmarks/bench_pipeline.py

Bubble of a stage = idle time / step time, idle = step time - the sum of its forward and
backward compute intervals (``forward_backward_pipelining(..., timeline=...)``); the table
gives the mean over stages (and the worst stage) of the median of ``--steps`` steps.
Theory (equal stages, no communication cost): 1F1B (P-1)/(m+P-1), interleaved with v chunks
per rank (P-1)/(v*m+P-1). Plain modules (no data parallelism), fp32, tiny GPTModel layers.
With more ranks than cores (P=4 on a 2-core machine) the ranks time-share the cores: a
stage's "compute" interval then includes time it was descheduled, so P=4 numbers are
indicative only.
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


def _config(args):
    from megadlms.models import TransformerConfig

    return TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=4,
        vocab_size=args.vocab,
        seq_length=args.seq,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        untie_embeddings_and_output_weights=True,
    )


def _chunks(cfg, pp, pp_rank, vp):
    from megadlms.models import GPTModel
    from megadlms.pipeline import model_chunks, stage_layers

    ranges = stage_layers(cfg.num_layers, pp, vp=vp)[pp_rank]
    out = []
    for chunk in model_chunks(ranges, pp_rank, pp, cfg.num_layers):
        torch.manual_seed(0)
        out.append(GPTModel(cfg, pipeline=chunk))
    return out


def _batches(args, m):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g) for _ in range(m)]


def _step(chunks, batches, pp_group):
    from megadlms.pipeline import forward_backward_pipelining

    norm = float(sum(b.numel() for b in batches))

    def forward_step(c, i, x):
        model = chunks[c]
        out = model(batches[i]) if model.pipeline.pre_process else model(hidden_states=x)
        if not model.pipeline.post_process:
            return out
        loss = model.token_cross_entropy(out, batches[i]).sum() / norm
        return loss, loss.detach()

    timeline = []
    dist.barrier(group=pp_group.group)
    t0 = time.perf_counter()
    forward_backward_pipelining(chunks, batches, forward_step, pp_group=pp_group, timeline=timeline)
    t1 = time.perf_counter()
    busy = sum(e["end"] - e["start"] for e in timeline)
    return t1 - t0, (t1 - t0 - busy) / (t1 - t0)


def _single_step(model, batches) -> float:
    """pp = 1: the whole model, the same micro-batches accumulated one after the other."""
    norm = float(sum(b.numel() for b in batches))
    t0 = time.perf_counter()
    for b in batches:
        (model.token_cross_entropy(model(b), b).sum() / norm).backward()
    elapsed = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return elapsed


def _pipelined(rank, world, args):
    """Every (schedule, m) on this P-rank pipeline, round-robin (``--steps`` rounds after a
    warm-up round, so background load hits all alike): per rank the median step time and
    bubble. With P = 2, rank 0 also times the pp = 1 step in each round (rank 1 waits)."""
    from megadlms.models import GPTModel
    from megadlms.parallel import ParallelGroups

    groups = ParallelGroups.build(pp=world)
    cfg = _config(args)
    chunks = {vp: _chunks(cfg, world, groups.pp.rank, vp) for vp in (1, 2)}
    batches = {m: _batches(args, m) for m in args.micro_batches}
    whole = None
    if world == 2 and rank == 0:
        torch.manual_seed(0)
        whole = GPTModel(cfg)
    runs = {}
    for round_ in range(args.steps + 1):
        for vp in (1, 2):
            for m in args.micro_batches:
                result = _step(chunks[vp], batches[m], groups.pp)
                for c in chunks[vp]:
                    c.zero_grad(set_to_none=True)
                if round_:
                    runs.setdefault((vp, m), []).append(result)
        dist.barrier()
        if whole is not None:
            for m in args.micro_batches:
                elapsed = _single_step(whole, batches[m])
                if round_:
                    runs.setdefault(("pp1", m), []).append((elapsed, 0.0))
        dist.barrier()
    return {
        k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in runs.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    print(
        f"GPTModel {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
        f"micro-batch {args.micro_batch}, "
        f"fp32, gloo, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, {os.cpu_count()} CPUs"
    )
    print("\n| P | schedule | m | bubble measured (mean / worst stage) | theory | step s |")
    print("|---|---|---|---|---|---|")
    steps = {}
    for pp in args.stages:
        per_rank = run_distributed(_pipelined, pp, args=(args,), timeout=1800)
        if pp == 2:
            single = {m: per_rank[0][("pp1", m)][0] for m in args.micro_batches}
        for vp in (1, 2):
            for m in args.micro_batches:
                bubbles = [r[(vp, m)][1] for r in per_rank]
                step = max(r[(vp, m)][0] for r in per_rank)
                steps[(pp, vp, m)] = step
                theory = (pp - 1) / (vp * m + pp - 1)
                name = "1F1B" if vp == 1 else f"interleaved v={vp}"
                print(
                    f"| {pp} | {name} | {m} | {statistics.mean(bubbles):.3f} / {max(bubbles):.3f} | "
                    f"{theory:.3f} | {step:.3f} |"
                )
    if 2 in args.stages:
        print("\n| m | pp=1 step s | pp=2 1F1B step s | pp=2 interleaved step s | speed-up 1F1B |")
        print("|---|---|---|---|---|")
        for m in args.micro_batches:
            s1, s2, s2i = single[m], steps[(2, 1, m)], steps[(2, 2, m)]
            print(f"| {m} | {s1:.3f} | {s2:.3f} | {s2i:.3f} | {s1 / s2:.2f}x |")


if __name__ == "__main__":
    main()
