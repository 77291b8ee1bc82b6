"""Training throughput: ``pretrain_difflm.py`` (our DDP, 2 ranks) vs a plain PyTorch loop
(torch.nn.parallel.DistributedDataParallel + torch.optim.AdamW) on the same model, the
same data and the same masked-diffusion loss, measured in the same run.

    python benchmarks/bench_train.py                    # 2 gloo ranks on CPU (cuda: nccl)
    python benchmarks/bench_train.py --layers 6 --hidden 512 --iters 12 --repeats 3

Both sides run the same steps: fetch this rank's micro-batches, forward + masked-diffusion
loss (``megadlms.diffusion.compute_loss``), backward with gradient accumulation under
no_sync, gradient all-reduce, global-norm clipping, AdamW. Ours additionally does
everything the trainer does per step (global token count all-reduce, NaN/exit flag
all-reduce, LR schedule, metrics). The first ``--warmup`` steps of each run are not
timed; runs alternate ours/plain ``--repeats`` times and the table reports medians, so a
busy machine slows both alike. Prints tokens/s per side and the ratio (target >= 0.95).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), ROOT]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.dist_utils import run_distributed  # noqa: E402


def _argv(a, metrics):
    return [
        "--num-layers",
        str(a.layers),
        "--hidden-size",
        str(a.hidden),
        "--num-attention-heads",
        str(a.heads),
        "--seq-length",
        str(a.seq),
        "--position-embedding-type",
        "rope",
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--disable-bias-linear",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--micro-batch-size",
        str(a.mbs),
        "--global-batch-size",
        str(a.gbs),
        "--train-iters",
        str(a.warmup + a.iters),
        "--lr",
        "3e-4",
        "--lr-decay-style",
        "constant",
        "--clip-grad",
        "1.0",
        "--weight-decay",
        "0.1",
        "--seed",
        "1",
        "--mock-data",
        "--num-workers",
        "0",
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--difflm-varilen-prob",
        "0",
        "--metrics-jsonl",
        metrics,
    ]


def _ours(a, metrics):
    from megadlms.pretrain import run

    run(_argv(a, metrics))
    if dist.get_rank() != 0:
        return None
    with open(metrics) as f:
        recs = [json.loads(x) for x in f if '"train"' in x]
    timed = [r for r in recs if r["iteration"] > a.warmup]
    seconds = sum(r["ms_per_iter"] for r in timed) / 1e3
    return a.gbs * a.seq * len(timed) / seconds


def _plain(a):
    """The reference loop: torch DDP, torch AdamW, clip_grad_norm_, same data and loss."""
    from megadlms.config import parse_config
    from megadlms.diffusion import compute_loss
    from megadlms.training import builders

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = parse_config(_argv(a, os.devnull), world_size=world)
    device = builders.device_for_rank()
    tok = cfg.data.tokenizer.build()
    cfg = cfg.with_tokenizer(tok)
    dcfg = cfg.diffusion
    model = builders.build_model(cfg.model, seed=cfg.training.seed, device=device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-4
    )
    gbs, mbs, num_micro = (
        cfg.training.global_batch_size,
        cfg.training.micro_batch_size,
        cfg.training.num_micro_batches,
    )
    train_ds, _ = builders.build_datasets(
        cfg.data, tok, seq_length=cfg.model.seq_length, seed=cfg.training.seed,
        train_samples=cfg.training.train_iters * gbs, valid_samples=0,
    )  # fmt: skip
    loader = builders.build_loader(
        train_ds, consumed_samples=0, micro_batch_size=mbs, dp_rank=rank, dp_size=world
    )
    it = iter(loader)
    times = []
    for step in range(a.warmup + a.iters):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for i in range(num_micro):
            batch = {k: v.to(device) for k, v in next(it).items()}
            ctx = ddp.no_sync() if i < num_micro - 1 else torch.enable_grad()
            with ctx:
                loss_sum, n, _ = compute_loss(ddp, batch, dcfg, step)
                (loss_sum / (n * num_micro)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return a.gbs * a.seq * a.iters / sum(times[a.warmup :])


def _worker(rank, world, a, tmp):
    torch.set_num_threads(a.threads)
    out = {"ours": [], "plain": []}
    for r in range(a.repeats):
        out["ours"].append(_ours(a, os.path.join(tmp, f"m{r}.jsonl")))
        out["plain"].append(_plain(a))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--gbs", type=int, default=8, help="global batch (2 ranks: 2 micro-batches each)")
    p.add_argument("--iters", type=int, default=8, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    p.add_argument("--repeats", type=int, default=3, help="alternating ours/plain runs")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        res = run_distributed(_worker, a.ranks, (a, tmp), timeout=3600)[0]
    from megadlms.models import TransformerConfig

    n = TransformerConfig(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=a.heads,
        vocab_size=384,
        seq_length=a.seq,
        swiglu=True,
        add_bias_linear=False,
        position_embedding_type="rope",
    )
    params = (a.layers * (4 * a.hidden * a.hidden + 3 * a.hidden * n.ffn_hidden_size) + 384 * a.hidden) / 1e6
    ours, plain = statistics.median(res["ours"]), statistics.median(res["plain"])
    print(
        f"model ~{params:.1f}M params ({a.layers} layers, hidden {a.hidden}, seq {a.seq}), "
        f"{a.ranks} ranks, global batch {a.gbs} (micro {a.mbs}), {a.iters} timed steps x {a.repeats}"
    )
    print("| loop | tokens/s (median) | runs | ratio vs plain |")
    print("|---|---|---|---|")
    print(
        f"| plain torch DDP + AdamW | {plain:,.0f} | {', '.join(f'{x:,.0f}' for x in res['plain'])} | 1.00 |"
    )
    print(
        f"| pretrain_difflm.py (our DDP) | {ours:,.0f} | {', '.join(f'{x:,.0f}' for x in res['ours'])} "
        f"| {ours / plain:.3f} |"
    )


if __name__ == "__main__":
    main()
