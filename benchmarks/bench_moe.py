"""Benchmark: expert parallelism on CPU ranks -- step time and bytes per rank of an MoE
GPTModel (E=8 experts, top-2) at ep=1 vs ep=2 vs ep=4 on 4 gloo ranks (dp=4 each: the
experts are split over ep ranks, their gradients reduced over expert_dp = 4 / ep).

    OMP_NUM_THREADS=1 PYTHONPATH=python:. python benchmarks/bench_moe.py [--distopt] [--dispatcher alltoall]

Step = zero grads + forward (router, dispatch, grouped-GEMM experts, combine) + masked-token
loss + aux loss + backward + gradient sync (dense buckets over dp, expert buckets over
expert_dp) + AdamW (the distributed optimizer with ``--distopt``). All layouts live in the same
4-rank world and run round-robin (a few steps each per round), so background load hits them
alike; the table reports the median step time of the slowest rank, its ratio to ep=1, and per
rank: parameter bytes, gradient-buffer bytes and optimizer-state bytes.
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

EPS = (1, 2, 4)


def _build(ep: int, args):
    from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megadlms.models import GPTModel, TransformerConfig
    from megadlms.models.moe import set_moe_aux_loss_scale
    from megadlms.optimizer import OptimizerConfig, get_optimizer
    from megadlms.parallel import ParallelGroups, TensorParallelContext, model_parallel_manual_seed

    groups = ParallelGroups.build(ep=ep)
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
        num_moe_experts=args.experts,
        moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.moe_ffn,
        moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type=args.dispatcher,
    )
    ctx = TensorParallelContext(
        gradient_accumulation_fusion=True,
        rng_tracker=tracker,
        expert_group=groups.ep.group if ep > 1 else None,
    )
    torch.manual_seed(0)
    model = GPTModel(cfg, tp=ctx)
    set_moe_aux_loss_scale(model, 1.0)
    ddp_cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=args.distopt, calculate_per_token_loss=True, bucket_size=40_000_000
    )
    ddp = DistributedDataParallel(model, ddp_cfg, parallel=groups)
    opt = get_optimizer(OptimizerConfig(lr=1e-4, use_distributed_optimizer=args.distopt), ddp)
    return groups, model, ddp, opt


def _batch(groups, args, step):
    """This rank's share of the step's global batch (the same global batch for every layout)."""
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


def _bytes(model, ddp, opt) -> tuple:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.buffers_)
    return params, grads, opt.state_bytes()


def _worker(rank, world, args):
    torch.set_num_threads(1)
    layouts = {ep: _build(ep, args) for ep in EPS}
    times = {ep: [] for ep in layouts}
    for step in range(args.warmup):
        for groups, model, ddp, opt in layouts.values():
            _step(model, ddp, opt, _batch(groups, args, step))
    for r in range(args.rounds):
        for ep, (groups, model, ddp, opt) in layouts.items():
            for s in range(args.steps):
                tokens = _batch(groups, args, 1000 + r * args.steps + s)
                dist.barrier()
                t0 = time.perf_counter()
                _step(model, ddp, opt, tokens)
                dt = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
                times[ep].append(dt.item())
    return {ep: (times[ep], _bytes(lay[1], lay[2], lay[3])) for ep, lay in layouts.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--moe-ffn", type=int, default=512)
    p.add_argument("--dispatcher", choices=["allgather", "alltoall"], default="alltoall")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--distopt", action="store_true", help="the distributed optimizer in every layout")
    args = p.parse_args()
    res = run_distributed(_worker, 4, args=(args,), timeout=3600)
    base = statistics.median(res[0][1][0])
    print(
        f"MoE GPTModel {args.layers} layers, hidden {args.hidden}, E={args.experts} top-{args.topk}, "
        f"expert ffn {args.moe_ffn}, vocab {args.vocab}, seq {args.seq}, global batch {args.global_batch}, "
        f"{args.dispatcher} dispatcher, 4 gloo ranks (dp=4), fp32, "
        f"{'distributed optimizer' if args.distopt else 'replicated optimizer'}; median of "
        f"{args.rounds * args.steps} steps"
    )
    print(
        "| layout | step ms (median) | vs ep1 | param MiB / rank | grad buffer MiB / rank "
        "| optimizer MiB / rank |"
    )
    print("|---|---|---|---|---|---|")
    for ep in EPS:
        t, (pb, gb, ob) = res[0][ep]
        med = statistics.median(t)
        print(
            f"| ep{ep} x dp4 (expert_dp {4 // ep}) | {1e3 * med:.0f} | {med / base:.2f}x | "
            f"{pb / 2**20:.2f} | {gb / 2**20:.2f} | {ob / 2**20:.2f} |"
        )


if __name__ == "__main__":
    main()
