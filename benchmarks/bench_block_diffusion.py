"""Block diffusion's cost on CPU: training step time and activation memory of the [x_t ; x_0]
pass for block sizes B in {S, S/4, 16} against the full-sequence objective at the same S, and
generation tokens/s of a block-diffusion model with the exact prefix cache against recomputing
everything and against the full-attention (LLaDA) sampler.

    PYTHONPATH=python:. OMP_NUM_THREADS=1 python benchmarks/bench_block_diffusion.py \
        --seq 256 --hidden 256 --layers 4 --reps 5

Training: ``compute_loss`` + backward of one micro-batch, the settings round-robin in one
process (the same background load), median of ``--reps`` process CPU times (one thread:
CPU time is compute time, which a shared machine's load disturbs far less than wall time).
Activation memory: the bytes autograd saves for backward in one training forward
(``saved_tensors_hooks``, each storage once, parameters left out). Generation: ``--gen``
tokens after a ``--prompt``-token prompt, one denoising step per token, median of ``--reps``
(CPU time); B = 16 for the block model.
Prints a markdown table (numbers in README "Block diffusion" and docs/block_diffusion.md).
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

from megadlms.diffusion import DiffusionConfig, compute_loss, generate  # noqa: E402
from megadlms.models import GPTModel, TransformerConfig  # noqa: E402

MASK = 255


def _model(args, block_size=None) -> GPTModel:
    torch.manual_seed(0)
    cfg = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, vocab_size=256,
        seq_length=args.seq, max_position_embeddings=max(args.seq, args.prompt + args.gen),
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        attention_dropout=0.0, hidden_dropout=0.0, difflm_block_size=block_size,
    )  # fmt: skip
    return GPTModel(cfg, attention="bidirectional")


def _batch(args):
    g = torch.Generator().manual_seed(1)
    text = torch.randint(0, MASK, (args.batch, args.seq + 1), generator=g)
    return {"tokens": text[:, :-1], "labels": text[:, 1:], "sample_idx": torch.arange(args.batch)}


def _saved_bytes(model, batch, cfg) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compute_loss(model, batch, cfg, 0, crop=None)
    return sum(seen.values())


def _step(model, batch, cfg) -> float:
    t0 = time.process_time()
    loss = compute_loss(model, batch, cfg, 0, crop=None)
    loss.loss_sum.backward()
    model.zero_grad(set_to_none=True)
    return time.process_time() - t0


def training(args) -> list:
    S = args.seq
    settings = [("full-sequence objective", None), (f"B = S = {S}", S), (f"B = S/4 = {S // 4}", S // 4)]
    settings.append(("B = 16", 16))
    model, batch = _model(args), _batch(args)
    cfgs = [DiffusionConfig(mask_token_id=MASK, objective="llada", block_size=B) for _, B in settings]
    times = {name: [] for name, _ in settings}
    for _ in range(args.reps + 1):  # round 0 warms up
        for (name, _), cfg in zip(settings, cfgs):
            times[name].append(_step(model, batch, cfg))
    rows = []
    for (name, _), cfg in zip(settings, cfgs):
        rows.append((name, statistics.median(times[name][1:]), _saved_bytes(model, batch, cfg)))
    return rows


def generation(args) -> list:
    prompt = torch.randint(0, MASK, (1, args.prompt), generator=torch.Generator().manual_seed(2))
    block, plain = _model(args, block_size=16).eval(), _model(args).eval()
    kw = dict(mask_token_id=MASK, gen_length=args.gen, steps=args.gen)
    runs = [
        ("block model, exact prefix cache", block, dict(cache="prefix")),
        ("block model, recompute everything", block, dict(cache=None)),
        ("full-attention sampler (LLaDA), block_length 16", plain, dict(cache=None, block_length=16)),
    ]
    times = {name: [] for name, _, _ in runs}
    for _ in range(args.reps + 1):
        for name, model, extra in runs:
            t0 = time.process_time()
            generate(model, prompt, **kw, **extra)
            times[name].append(time.process_time() - t0)
    return [(name, args.gen / statistics.median(times[name][1:])) for name, _, _ in runs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--gen", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rows = training(args)
    base_t, base_m = rows[0][1], rows[0][2]
    shape = f"S={args.seq}, batch {args.batch}, {args.layers} layers x {args.hidden}"
    print(f"training, {shape} (CPU time, 1 thread, medians)\n")
    print("| objective | step time (ms) | x full | activations saved (MiB) | x full |")
    print("|---|---|---|---|---|")
    for name, t, m in rows:
        print(f"| {name} | {t * 1e3:.1f} | {t / base_t:.2f} | {m / 2**20:.1f} | {m / base_m:.2f} |")
    print(f"\ngeneration, {args.gen} tokens after a {args.prompt}-token prompt, one step per token\n")
    print("| sampler | tokens per CPU second |")
    print("|---|---|")
    for name, tps in generation(args):
        print(f"| {name} | {tps:.1f} |")


if __name__ == "__main__":
    main()
