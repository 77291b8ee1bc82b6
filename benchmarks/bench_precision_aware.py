"""Optimizer-state memory and step time of the precision-aware optimizer, per rank, on the
layer shapes of MegaDLMs' dlm_pretrain_1.7b.sh (hidden 2048, ffn 6144, 16 heads, SwiGLU,
RMSNorm, qk-layernorm, untied, vocab 50289; --layers of them, 28 in the script), 2 gloo ranks.

    python benchmarks/bench_precision_aware.py                 # 1 layer, seq 256
    python benchmarks/bench_precision_aware.py --layers 2 --steps 4

Per variant (replicated DDP / distributed optimizer x fp32 state / bf16 moments / bf16 moments
and bf16 main grads, all with --bf16 params): the bytes of the optimizer state on rank 0,
counted from the tensors the optimizer holds (main params, moments: ``state_bytes()``), the
DDP grad buffer (main grads) counted from its tensors, and the median time of a training
step and of ``optimizer.step()`` alone, as ratios against the fp32 variant of the same layout
measured in the same run. The baseline is the first row of each layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), ROOT]

import torch  # noqa: E402

from tests.dist_utils import run_distributed  # noqa: E402

VARIANTS = {  # name -> extra flags (over --bf16)
    "fp32 state": [],
    "bf16 moments": ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"],
    "bf16 moments+grads": [
        "--exp-avg-dtype",
        "bf16",
        "--exp-avg-sq-dtype",
        "bf16",
        "--main-grads-dtype",
        "bf16",
    ],
}


def _argv(a, dist_opt, extra):
    argv = (
        f"--num-layers {a.layers} --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 16 "
        f"--seq-length {a.seq} --max-position-embeddings {a.seq} --swiglu --normalization RMSNorm "
        "--qk-layernorm --disable-bias-linear --position-embedding-type rope "
        "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 "
        "--micro-batch-size 1 --global-batch-size 2 --train-iters 10 "
        "--lr 2e-4 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --mock-data "
        "--use-precision-aware-optimizer --no-gradient-accumulation-fusion"
    ).split()
    return argv + (["--use-distributed-optimizer"] if dist_opt else []) + extra


def _measure(rank, ws, argv, steps, vocab):
    from megadlms.config import parse_config
    from megadlms.config.run_config import padded_vocab_size
    from megadlms.distributed import unwrap_model
    from megadlms.optimizer import get_optimizer
    from megadlms.training.builders import build_model, build_parallel, wrap_model

    config = parse_config(argv, world_size=ws)
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, vocab_size=padded_vocab_size(vocab))
    )
    device = torch.device("cpu")
    groups, tp = build_parallel(config, device, seed=1234)
    model = wrap_model(build_model(config.model, seed=1234, device=device, tp=tp), config, groups)
    opt = get_optimizer(config.optimizer, model)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, vocab, (1, config.model.max_position_embeddings), generator=g)
    step_t, opt_t = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten()).backward()
        model.finish_grad_sync()
        t1 = time.perf_counter()
        ok, _ = opt.step()
        t2 = time.perf_counter()
        assert ok
        step_t.append(t2 - t0)
        opt_t.append(t2 - t1)
    params = sum(p.numel() for p in unwrap_model(model).parameters())
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in _buffers(model))
    # the first step builds the state: it is not timed
    return {
        "params": params,
        "state": opt.state_bytes(),
        "grads": grads,
        "step": statistics.median(step_t[1:]),
        "opt": statistics.median(opt_t[1:]),
    }


def _buffers(model):
    """The DDP grad buffers (each bucket's grad_data views one of them: count buckets once)."""
    seen = {}
    for bucket in model.grad_buckets:
        seen[id(bucket)] = bucket
    return list(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=50289)
    ap.add_argument("--layouts", default="replicated,distributed", help="comma list (a subset to rerun)")
    a = ap.parse_args()
    print(f"MegaDLMs 1.7B layer shapes, {a.layers} layer(s), seq {a.seq}, 2 gloo ranks, --bf16; rank 0")
    cols = ("state MB", 9), ("B/param", 8), ("grads MB", 9), ("step x", 7), ("opt.step x", 10)
    print(f"{'layout':<12} {'variant':<20} " + " ".join(f"{c:>{w}}" for c, w in cols))
    for dist_opt in (False, True):
        if ("distributed" if dist_opt else "replicated") not in a.layouts.split(","):
            continue
        base = None
        for name, extra in VARIANTS.items():
            r = run_distributed(_measure, 2, (_argv(a, dist_opt, extra), a.steps, a.vocab), timeout=1800)[0]
            base = base or r
            layout = "distributed" if dist_opt else "replicated"
            print(
                f"{layout:<12} {name:<20} {r['state'] / 2**20:9.1f} {r['state'] / r['params']:8.2f} "
                f"{r['grads'] / 2**20:9.1f} {r['step'] / base['step']:7.3f} {r['opt'] / base['opt']:10.3f}"
                + (
                    f"   (baseline: step {base['step']:.2f} s, opt.step {base['opt']:.3f} s)"
                    if r is base
                    else ""
                )
            )


if __name__ == "__main__":
    main()
