"""FSDP2 vs our DDP vs our DDP + distributed optimizer: step time and per-rank model-state memory.

    python benchmarks/bench_fsdp.py                      # 2 ranks, gloo, CPU
    python benchmarks/bench_fsdp.py --hidden-size 512 --steps 20
    python benchmarks/bench_fsdp.py --bf16            # bf16 compute, fp32 main params

Same GPTModel, same data, same optimizer (megadlms.optimizer.get_optimizer, AdamW),
run one after the other on the same ranks. Baseline: our DDP.

Model-state memory per rank = every tensor storage the wrapper and the optimizer hold
after a step (parameters or their local shards, gradient buffers/shards, fp32 main copies,
Adam moments), each storage counted once. Activations are not model state and are not
counted. Target (issue 5): FSDP2 <= DDP / dp + 5%.
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
import torch.nn.functional as F  # noqa: E402

from tests.dist_utils import run_distributed  # noqa: E402


def _storages(obj, seen_objs, out, depth=0):
    """Collect {storage_ptr: nbytes} of every tensor reachable from obj (bounded walk)."""
    if depth > 6 or id(obj) in seen_objs:
        return
    seen_objs.add(id(obj))
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        if local.device.type != "meta" and local.numel() > 0:
            storage = local.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
        grad = getattr(obj, "grad", None)
        if grad is not None:
            _storages(grad, seen_objs, out, depth + 1)
        main_grad = getattr(obj, "main_grad", None)
        if main_grad is not None:
            _storages(main_grad, seen_objs, out, depth + 1)
        return
    if isinstance(obj, torch.nn.Module):
        for t in list(obj.parameters()) + list(obj.buffers()):
            _storages(t, seen_objs, out, depth + 1)
    if isinstance(obj, dict):
        items = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    elif (
        hasattr(obj, "__dict__")
        and not isinstance(obj, (type, torch.nn.Module))
        and type(obj).__module__.startswith(("megadlms", "torch.optim"))
    ):
        items = list(vars(obj).values())
    elif isinstance(obj, torch.nn.Module):
        items = [v for k, v in vars(obj).items() if k not in ("_modules", "_parameters", "_buffers")]
    else:
        return
    for item in items:
        _storages(item, seen_objs, out, depth + 1)


def model_state_bytes(wrapper, optimizer) -> int:
    out = {}
    _storages(wrapper, set(), out)
    _storages(optimizer, set(), out)
    return sum(out.values())


def _build(kind, cfg, args):
    from megadlms.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        Float16Module,
        TorchFullyShardedDataParallel,
    )
    from megadlms.distributed.fsdp2 import mixed_precision_policy
    from megadlms.models import GPTModel
    from megadlms.optimizer import OptimizerConfig, get_optimizer

    torch.manual_seed(args.seed)
    model = GPTModel(cfg, attention="bidirectional")
    distopt = kind == "ddp+distopt"
    if kind == "fsdp2":
        wrapper = TorchFullyShardedDataParallel(model, mixed_precision=mixed_precision_policy(args.bf16))
    else:
        if args.bf16:  # what the trainer does: bf16 model, fp32 grad buffer and main params
            model = Float16Module(model, dtype=torch.bfloat16)
        wrapper = DistributedDataParallel(
            model,
            DistributedDataParallelConfig(
                use_distributed_optimizer=distopt,
                overlap_grad_reduce=True,
                bucket_size=args.bucket_size,
                grad_reduce_in_fp32=args.bf16,
            ),
        )
    opt = get_optimizer(OptimizerConfig(lr=1e-4, bf16=args.bf16, use_distributed_optimizer=distopt), wrapper)
    return wrapper, opt


def _worker(rank, world, args):
    torch.set_num_threads(args.threads)
    from megadlms.models import TransformerConfig

    cfg = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.hidden_size // 64,
        vocab_size=args.vocab_size,
        seq_length=args.seq_length,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    g = torch.Generator().manual_seed(args.seed + rank)
    data = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length), generator=g)
    results = {}
    for kind in ("ddp", "ddp+distopt", "fsdp2"):
        wrapper, opt = _build(kind, cfg, args)
        times = []
        for _step in range(args.warmup + args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            wrapper.zero_grad_buffer()
            opt.zero_grad()
            logits = wrapper(data)
            F.cross_entropy(logits.float().reshape(-1, args.vocab_size), data.reshape(-1)).backward()
            wrapper.finish_grad_sync()
            opt.step()
            times.append(time.perf_counter() - t0)
        n_params = sum(p.numel() for p in wrapper.parameters())  # global numel (DTensor too)
        results[kind] = dict(
            step_s=statistics.median(times[args.warmup :]),
            state_bytes=model_state_bytes(wrapper, opt),
            params=n_params,
        )
        del wrapper, opt
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="Ranks (gloo, CPU).")
    p.add_argument("--num-layers", type=int, default=4, help="Transformer layers.")
    p.add_argument("--hidden-size", type=int, default=384, help="Hidden size (heads = hidden / 64).")
    p.add_argument("--vocab-size", type=int, default=8192, help="Vocabulary size.")
    p.add_argument("--seq-length", type=int, default=128, help="Tokens per sequence.")
    p.add_argument("--micro-batch-size", type=int, default=4, help="Sequences per rank per step.")
    p.add_argument("--bucket-size", type=int, default=None, help="DDP bucket size (elements).")
    p.add_argument("--steps", type=int, default=10, help="Timed steps (median reported).")
    p.add_argument("--warmup", type=int, default=2, help="Untimed warmup steps.")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank.")
    p.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 compute: Float16Module + fp32 main params for DDP, MixedPrecisionPolicy for FSDP2.",
    )
    p.add_argument("--seed", type=int, default=1234, help="Init and data seed.")
    args = p.parse_args(argv)

    per_rank = dict(enumerate(run_distributed(_worker, args.world_size, (args,), timeout=1800)))

    dp = args.world_size
    kinds = ("ddp", "ddp+distopt", "fsdp2")
    step = {k: max(per_rank[r][k]["step_s"] for r in per_rank) for k in kinds}  # slowest rank
    mem = {k: max(per_rank[r][k]["state_bytes"] for r in per_rank) for k in kinds}  # largest rank
    n = per_rank[0]["ddp"]["params"]
    print(
        f"model: {args.num_layers} layers, hidden {args.hidden_size}, vocab {args.vocab_size}, "
        f"{n / 1e6:.1f}M params; {dp} ranks gloo/CPU, micro-batch {args.micro_batch_size} x "
        f"seq {args.seq_length}, {'bf16' if args.bf16 else 'fp32'}, AdamW; median of {args.steps} steps"
    )
    print("| wrapper | step time (s) | vs DDP | model-state MiB / rank | vs DDP | vs DDP/dp |")
    print("|---|---|---|---|---|---|")
    for k in kinds:
        print(
            f"| {k} | {step[k]:.3f} | {step[k] / step['ddp']:.2f}x | {mem[k] / 2**20:.1f} | "
            f"{mem[k] / mem['ddp']:.3f} | {mem[k] / (mem['ddp'] / dp):.3f} |"
        )
    ok = mem["fsdp2"] <= mem["ddp"] / dp * 1.05
    print(
        f"target FSDP2 <= DDP/dp + 5%: {'met' if ok else 'NOT met'} "
        f"({mem['fsdp2'] / 2**20:.1f} MiB vs {mem['ddp'] / dp / 2**20:.1f} MiB)"
    )


if __name__ == "__main__":
    main()
