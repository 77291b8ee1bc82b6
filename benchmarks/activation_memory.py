"""Benchmark: activation bytes saved for backward per transformer layer, and step time, under
--recompute-granularity none / selective / full (CPU; numbers in docs/memory.md).

    PYTHONPATH=python:. python benchmarks/activation_memory.py bytes --hidden 2048 --heads 16 \
        --ffn 6144 --seq 2048 --dtype bf16
    PYTHONPATH=python:. python benchmarks/activation_memory.py time --hidden 512 --heads 8 \
        --ffn 1536 --seq 512 --layers 4 --reps 7
    PYTHONPATH=python:. python benchmarks/activation_memory.py fit --seq 2048 [--dropout 0]

``bytes``: the tensors autograd saves during one training forward of a TransformerBlock are
seen by ``torch.autograd.graph.saved_tensors_hooks``; they are counted once per storage (a
view of a stored tensor costs nothing extra) and parameters are left out (they are weights,
not activations). Per layer = blocks of 2 layers minus 1 layer, which cancels what every
layer shares (the rotary cos/sin). The model is the 1.7B example's layer (RMSNorm, SwiGLU,
rope, qk-layernorm, no biases), micro-batch 1. :func:`fit_formula` fits the per-layer
count as a combination of s*b*h, s*b*f, a*s^2*b, a*s*b, s*b and s*b*h/a on small layers; ``bytes``
prints the fitted coefficients, the full-size measurement and the formula's prediction.

``time``: forward + backward of an L-layer block, the three settings round-robin in one
process (the same background load), median of ``--reps`` of the wall time and of the
process CPU time (run with OMP_NUM_THREADS=1: one thread, so CPU time is compute time);
ratios to none.
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

from megadlms.models import TransformerConfig  # noqa: E402
from megadlms.models.transformer import RotaryEmbedding, TransformerBlock  # noqa: E402
from megadlms.parallel import TensorParallelContext, model_parallel_manual_seed  # noqa: E402

LEVERS = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def layer_config(
    hidden, heads, ffn, seq, layers, lever, dtype=torch.bfloat16, dropout=0.1
) -> TransformerConfig:
    """The 1.7B example's layer shape (examples/dlm_pretrain_1.7b.sh) at the given sizes."""
    return TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=ffn,
        vocab_size=8,
        seq_length=seq,
        swiglu=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        qk_layernorm=True,
        add_bias_linear=False,
        attention_dropout=dropout,
        hidden_dropout=dropout,
        params_dtype=dtype,
        **LEVERS[lever],
    )


def _block(config, seed=0):
    torch.manual_seed(seed)
    tp = TensorParallelContext(rng_tracker=model_parallel_manual_seed(seed, 0))
    block = TransformerBlock(config, "bidirectional", tp=tp, post_process=False).train()
    rotary = RotaryEmbedding(config.kv_channels)(torch.arange(config.seq_length)[None])
    return block, rotary


def saved_bytes(config, batch: int = 1) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward."""
    block, rotary = _block(config)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(batch, config.seq_length, config.hidden_size, dtype=config.params_dtype)
    x.requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, rotary)
    return sum(seen.values())


def per_layer_bytes(hidden, heads, ffn, seq, lever, dtype, dropout, batch=1) -> int:
    """Saved bytes of one layer: a 2-layer block minus a 1-layer block."""
    two, one = (
        saved_bytes(layer_config(hidden, heads, ffn, seq, n, lever, dtype, dropout), batch) for n in (2, 1)
    )
    return two - one


MONOMIALS = ("s*b*h", "s*b*f", "a*s^2*b", "a*s*b", "s*b", "s*b*h/a")


def _monomials(hidden, heads, ffn, seq, batch=1):
    sb = seq * batch
    return [sb * hidden, sb * ffn, heads * seq * sb, heads * sb, sb, sb * hidden // heads]


SHAPES = [
    (64, 4, 96, 32),
    (64, 4, 160, 48),
    (96, 2, 96, 64),
    (128, 8, 256, 32),
    (64, 8, 192, 80),
    (160, 4, 64, 40),
    (128, 2, 128, 16),
    (96, 6, 32, 24),
]


def fit_formula(lever, dtype, dropout):
    """Per-layer bytes as a combination of MONOMIALS, fitted on small layers (SHAPES; exact
    counts, so the least-squares solution has integer-like coefficients)."""
    rows = torch.tensor([_monomials(*shape) for shape in SHAPES], dtype=torch.float64)
    got = torch.tensor(
        [per_layer_bytes(*shape, lever, dtype, dropout) for shape in SHAPES], dtype=torch.float64
    )
    coef = torch.linalg.lstsq(rows, got[:, None]).solution[:, 0]
    residual = (rows @ coef - got).abs().max().item()
    return [round(c, 3) for c in coef.tolist()], residual


def formula_bytes(coef, hidden, heads, ffn, seq, batch=1) -> float:
    return sum(c * m for c, m in zip(coef, _monomials(hidden, heads, ffn, seq, batch)))


def _step(block, rotary, x):
    block(x, rotary).float().square().mean().backward()


def step_times(hidden, heads, ffn, seq, layers, dtype, reps):
    """{lever: median seconds of forward + backward}, the levers interleaved."""
    runs = {}
    for lever in LEVERS:
        block, rotary = _block(layer_config(hidden, heads, ffn, seq, layers, lever, dtype))
        x = torch.randn(1, seq, hidden, dtype=dtype, requires_grad=True)
        _step(block, rotary, x)  # warm-up
        runs[lever] = (block, rotary, x, [])
    for _ in range(reps):
        for block, rotary, x, times in runs.values():
            t, c = time.perf_counter(), time.process_time()
            _step(block, rotary, x)
            times.append((time.perf_counter() - t, time.process_time() - c))
    # process CPU time too: on a shared machine it is what other jobs disturb least
    return {lever: tuple(statistics.median(t[i] for t in r[3]) for i in (0, 1)) for lever, r in runs.items()}


# Megatron's bytes per parameter for bf16 training with Adam (its "18 bytes" accounting):
# bf16 weight 2 + fp32 main grad 4 + fp32 main param 4 + the two moments (4 + 4 in fp32,
# 2 + 2 in bf16 with --exp-avg-dtype / --exp-avg-sq-dtype bf16). With the distributed
# optimizer over d ranks the last three shard: 6 + 12/d (fp32 moments) or 6 + 8/d (bf16).
MOMENT_BYTES = {"fp32 moments": 8, "bf16 moments": 4}
SHAPES_7B = {
    "1.7B-shaped layer (h2048 a16 f6144)": (2048, 16, 6144),
    "7B-shaped layer (h4096 a32 f11008)": (4096, 32, 11008),
}
DEVICES = {"80 GB": 80e9, "141 GB": 141e9}


def _layer_params(h, f):
    # qkv + proj (4h^2), SwiGLU fc1 (2hf) + fc2 (hf), two RMSNorms, q/k layernorms (small)
    return 4 * h * h + 3 * h * f + 2 * h + 2 * (h // 16)


def largest_layers(budget, h, a, f, seq, lever_coef, none_coef, moment_bytes, dp_shards, vocab=50289):
    """Most layers of this shape whose weights, grads, optimizer state and activations
    (micro-batch 1, one pipeline stage) fit ``budget`` bytes, and that model's parameters."""
    per_param = 2 + 4 + (4 + moment_bytes) / dp_shards
    act = formula_bytes(lever_coef, h, a, f, seq)
    # a recomputation rebuilds one layer's activations at a time; the logits (fp32) and their grad
    peak_extra = formula_bytes(none_coef, h, a, f, seq) - act + 8 * seq * vocab
    fixed = 2 * vocab * h * per_param + peak_extra  # untied embedding + output layer
    layers = int((budget - fixed) // (_layer_params(h, f) * per_param + act))
    return layers, layers * _layer_params(h, f) + 2 * vocab * h


def _fit_cmd(a):
    dtype = DTYPES[a.dtype]
    coefs = {lever: fit_formula(lever, dtype, a.dropout)[0] for lever in LEVERS}
    print(f"seq {a.seq}, micro-batch 1, {a.dtype}, dropout {a.dropout}, optimizer shards {a.dp_shards}")
    for shape, (h, heads, f) in SHAPES_7B.items():
        for dev, budget in DEVICES.items():
            for moments, mb in MOMENT_BYTES.items():
                cells = []
                for lever, coef in coefs.items():
                    n, params = largest_layers(
                        budget, h, heads, f, a.seq, coef, coefs["none"], mb, a.dp_shards
                    )
                    cells.append(f"{lever} {n} layers {params / 1e9:.2f}B")
                print(f"{shape} | {dev} | {moments} | " + " | ".join(cells))


def _bytes_cmd(a):
    dtype = DTYPES[a.dtype]
    for dropout in (0.1, 0.0):
        for lever in LEVERS:
            coef, residual = fit_formula(lever, dtype, dropout)
            got = per_layer_bytes(a.hidden, a.heads, a.ffn, a.seq, lever, dtype, dropout)
            want = formula_bytes(coef, a.hidden, a.heads, a.ffn, a.seq)
            terms = " + ".join(f"{c:g}*{m}" for c, m in zip(coef, MONOMIALS) if abs(c) > 1e-6)
            print(
                f"dropout {dropout} {lever:9s} measured {got / 2**20:10.2f} MiB/layer | formula "
                f"{want / 2**20:10.2f} MiB ({terms}; fit residual {residual:.0f} B)"
            )


def _time_cmd(a):
    times = step_times(a.hidden, a.heads, a.ffn, a.seq, a.layers, DTYPES[a.dtype], a.reps)
    (wall0, cpu0) = times["none"]
    for lever, (wall, cpu) in times.items():
        print(
            f"{lever:9s} median wall {wall * 1e3:8.1f} ms/step (ratio {wall / wall0:.3f}) | "
            f"process CPU {cpu * 1e3:8.1f} ms/step (ratio {cpu / cpu0:.3f})"
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["bytes", "time", "fit"])
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--dp-shards", type=int, default=1, help="fit: distributed-optimizer ranks")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=6144)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    {"bytes": _bytes_cmd, "time": _time_cmd, "fit": _fit_cmd}[a.what](a)


if __name__ == "__main__":
    main()
