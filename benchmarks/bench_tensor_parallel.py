"""Benchmark: tensor parallelism on CPU ranks -- step time of (tp=2, dp=2) vs (tp=1, dp=4)
on the same global batch, and parameter + optimizer bytes per rank of each layout.

    OMP_NUM_THREADS=1 PYTHONPATH=python:. python benchmarks/bench_tensor_parallel.py   # 4 gloo ranks

Step = zero grads + forward + masked-token loss (vocab-parallel cross-entropy at tp 2) +
backward + gradient sync (DDP over each layout's data-parallel group) + AdamW step (the
distributed optimizer with ``--distopt``). Both layouts live in the same 4-rank world and
run round-robin (a few steps each per round), so background load hits them alike; the
table reports the median step time of the slowest rank with its ratio to (tp=1, dp=4).
On CPU a TP step pays its all-reduces in gloo over shared memory with no compute to hide
them behind; the point of TP is the memory column (params 1/tp), not CPU speed.
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


def _build(tp: int, args):
    from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megadlms.models import GPTModel, TransformerConfig
    from megadlms.optimizer import OptimizerConfig, get_optimizer
    from megadlms.parallel import ParallelGroups, TensorParallelContext, model_parallel_manual_seed

    groups = ParallelGroups.build(tp=tp)
    tracker = model_parallel_manual_seed(0, groups.tp.rank)
    cfg = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        vocab_size=args.vocab,
        seq_length=args.seq,
        swiglu=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    ctx = TensorParallelContext(
        group=groups.tp.group if tp > 1 else None, gradient_accumulation_fusion=True, rng_tracker=tracker
    )
    model = GPTModel(cfg, tp=ctx)
    ddp_cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=args.distopt, calculate_per_token_loss=True, bucket_size=40_000_000
    )
    ddp = DistributedDataParallel(model, ddp_cfg, parallel=groups)
    opt = get_optimizer(OptimizerConfig(lr=1e-4, use_distributed_optimizer=args.distopt), ddp)
    return groups, model, ddp, opt


def _batch(groups, args, step):
    """This rank's share of the step's global batch (the same global batch for both layouts)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, args.vocab, (args.global_batch, args.seq), generator=g)
    per = args.global_batch // groups.dp.size
    return tokens[groups.dp.rank * per : (groups.dp.rank + 1) * per]


def _step(model, ddp, opt, tokens):
    opt.zero_grad()
    logits = ddp(tokens)
    loss = model.token_cross_entropy(logits, tokens).sum() / tokens.numel()
    loss.backward()
    ddp.finish_grad_sync()
    opt.step()


def _bytes(model, opt) -> tuple:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params, opt.state_bytes()


def _worker(rank, world, args):
    torch.set_num_threads(1)
    layouts = {"tp1 x dp4": _build(1, args), "tp2 x dp2": _build(2, args)}
    times = {name: [] for name in layouts}
    for step in range(args.warmup):
        for groups, model, ddp, opt in layouts.values():
            _step(model, ddp, opt, _batch(groups, args, step))
    for r in range(args.rounds):
        for name, (groups, model, ddp, opt) in layouts.items():
            for s in range(args.steps):
                tokens = _batch(groups, args, 1000 + r * args.steps + s)
                dist.barrier()
                t0 = time.perf_counter()
                _step(model, ddp, opt, tokens)
                dt = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
                times[name].append(dt.item())
    return {name: (times[name], _bytes(lay[1], lay[3])) for name, lay in layouts.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--distopt", action="store_true", help="the distributed optimizer in both layouts")
    args = p.parse_args()
    res = run_distributed(_worker, 4, args=(args,), timeout=3600)
    base = statistics.median(res[0]["tp1 x dp4"][0])
    print(
        f"GPTModel {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, seq {args.seq}, "
        f"global batch {args.global_batch}, 4 gloo ranks, fp32, "
        f"{'distributed optimizer' if args.distopt else 'replicated optimizer'}; "
        f"median of {args.rounds * args.steps} steps"
    )
    print("| layout | step ms (median) | vs tp1 x dp4 | param MiB / rank | optimizer MiB / rank |")
    print("|---|---|---|---|---|")
    for name in ("tp1 x dp4", "tp2 x dp2"):
        t, (pb, ob) = res[0][name]
        med = statistics.median(t)
        print(f"| {name} | {1e3 * med:.0f} | {med / base:.2f}x | {pb / 2**20:.1f} | {ob / 2**20:.1f} |")


if __name__ == "__main__":
    main()
