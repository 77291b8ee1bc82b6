"""Benchmark: context parallelism on CPU gloo ranks -- step time and activation memory per
rank of one long sequence at cp = 1, 2, 4 (bidirectional and causal attention).

    OMP_NUM_THREADS=1 PYTHONPATH=python:. python benchmarks/bench_context_parallel.py [--seq 4096]

Step = forward + loss + backward of one [1, seq] sequence, split over the cp ranks
(``shard_sequence``: contiguous for bidirectional, the 2C-chunk split for causal), attention
all-gathering K/V (``gather_kv``). No optimizer and no gradient all-reduce (the same work at
every cp). "activations" is the bytes of the tensors autograd saves for backward during the
forward (distinct storages, ``saved_tensors_hooks``): the activation memory of a rank,
which is what context parallelism divides. "kv comm" is the time inside the K/V all-gathers
and the dK/dV reduce-scatters. Each cp size runs in its own world of cp ranks; the table
reports the median of the slowest rank and the ratios against cp = 1 measured in this run.
On a machine with fewer cores than ranks the step times measure contention, not scaling:
compare the memory column there.
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


def _model(cp_group, causal: bool, args):
    from megadlms.models import GPTModel, TransformerConfig
    from megadlms.parallel import TensorParallelContext

    cfg = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        vocab_size=args.vocab,
        seq_length=args.seq,
        max_position_embeddings=args.seq,
        swiglu=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        attention="causal" if causal else "bidirectional",
    )
    torch.manual_seed(0)
    return GPTModel(cfg, tp=TensorParallelContext(cp_group=cp_group))


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves during ``fn()`` (its activations)."""
    seen = {}

    def pack(t):
        if t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _rank(rank, world, args, causal):
    import megadlms.parallel.context_parallel as cpmod

    group = dist.group.WORLD if world > 1 else None
    model = _model(group, causal, args)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (1, args.seq), generator=g)
    pos = torch.arange(args.seq).expand(1, args.seq)
    part = cpmod.shard_sequence(
        {"tokens": tokens, "position_ids": pos}, {}, cp=world, rank=rank, load_balance=causal
    )
    comm = [0.0]
    gather, scatter = cpmod._all_gather, cpmod._reduce_scatter

    def timed(f):
        def run(*a):
            t0 = time.perf_counter()
            out = f(*a)
            comm[0] += time.perf_counter() - t0
            return out

        return run

    cpmod._all_gather, cpmod._reduce_scatter = timed(gather), timed(scatter)
    times, comms, act = [], [], 0
    try:
        for i in range(args.warmup + args.steps):
            model.zero_grad(set_to_none=True)
            if world > 1:
                dist.barrier()
            comm[0] = 0.0
            t0 = time.perf_counter()
            logits, act = _saved_bytes(lambda: model(part["tokens"], part["position_ids"]))
            logits.float().logsumexp(-1).sum().backward()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
                comms.append(comm[0])
    finally:
        cpmod._all_gather, cpmod._reduce_scatter = gather, scatter
    return statistics.median(times), statistics.median(comms), act


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    print(
        f"seq {args.seq}, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
        f"vocab {args.vocab}; median of {args.steps} steps, slowest rank"
    )
    head = ("attention", "cp", "step ms", "x cp1", "kv comm ms", "activations MiB", "x cp1")
    print("".join(f"{h:{w}}" for h, w in zip(head, ("<14", ">3", ">10", ">7", ">12", ">17", ">7"))))
    for causal in (False, True):
        base = None
        for cp in args.cp:
            res = run_distributed(_rank, cp, args=(args, causal), timeout=1800)
            step = max(r[0] for r in res)
            comm = max(r[1] for r in res)
            act = max(r[2] for r in res) / 2**20
            base = base or (step, act)
            name = "causal" if causal else "bidirectional"
            print(
                f"{name:<14}{cp:>3}{step * 1e3:>10.1f}{step / base[0]:>7.2f}{comm * 1e3:>12.1f}"
                f"{act:>17.1f}{act / base[1]:>7.2f}"
            )


if __name__ == "__main__":
    main()
