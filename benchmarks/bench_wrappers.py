"""FSDP2 against DDP on the same training step, and where the difference goes.

    python benchmarks/bench_wrappers.py                       # GPU: the 1.7B model, seq 4096
    python benchmarks/bench_wrappers.py --device cpu --tiny   # seconds, on a CPU (gloo)

One process (a world of one) by default; under torchrun every rank runs it. For each wrapper
-- our DDP with the distributed optimizer, FSDP2, and FSDP2 without resharding after forward
(ZeRO-2, ``--torch-fsdp2-no-reshard-after-forward``) -- it times a full optimizer step of
``--micro`` micro-batches (bf16, masked-token cross-entropy, the project's optimizer: the
trainer's step without data loading and logging), takes the peak memory, and profiles one
step: time per family of kernels (CUDA) or of operators (CPU self time), so the rows of the
breakdown show which work one wrapper does that the other does not (FSDP2's all-gather
copies and casts, its reduce-scatter, the fp32 gradient accumulation). Times are medians of
``--reps`` steps after a warm-up step; ratios are against DDP measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), ROOT]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# (family, substrings of a kernel / operator name), first match wins; the rest is "other".
FAMILIES = (
    ("fsdp2 gather copy-in/out", ("all_gather_copy", "split_with_sizes_copy", "chunk_cat", "foreach_all")),
    ("fsdp2 hooks (host)", ("fsdp::", "registerpostbackward", "cast_forward_inputs")),
    ("dtensor dispatch (host)", ("pythonsubclass",)),
    ("collectives", ("nccl", "c10d", "gloo", "all_gather", "reduce_scatter", "allreduce", "all_reduce")),
    ("optimizer", ("adam", "multi_tensor", "_foreach", "megadlm", "fused")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "aten::mm", "aten::addmm", "aten::bmm", "matmul")),
    ("attention", ("flash", "sdpa", "fmha", "attention")),
    ("casts/copies", ("copy", "_to_copy", "cast")),
)
WRAPPERS = ("ddp+distopt", "fsdp2", "fsdp2 zero-2")


def _model(device, tiny: bool):
    from megadlms.models import GPTModel, TransformerConfig

    if tiny:
        dims = dict(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=384, seq_length=128)
        vocab = 512
    else:  # MegaDLMs' 1.7B model (the first GPU run's trainer rows)
        dims = dict(
            num_layers=28, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=6144, seq_length=4096
        )
        vocab = 50304
    cfg = TransformerConfig(
        **dims, vocab_size=vocab, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
        position_embedding_type="rope", qk_layernorm=True, attention_dropout=0.0, hidden_dropout=0.0,
        untie_embeddings_and_output_weights=True,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        return cfg, GPTModel(cfg, attention="bidirectional")


def _wrap(name, model):
    from megadlms.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        Float16Module,
        TorchFullyShardedDataParallel,
    )
    from megadlms.distributed.fsdp2 import mixed_precision_policy
    from megadlms.optimizer import OptimizerConfig, get_optimizer

    if name == "ddp+distopt":
        cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True
        )
        wrapped = DistributedDataParallel(Float16Module(model, dtype=torch.bfloat16), cfg)
        opt_cfg = OptimizerConfig(lr=1e-4, bf16=True, use_distributed_optimizer=True)
    else:
        wrapped = TorchFullyShardedDataParallel(
            model, mixed_precision=mixed_precision_policy(True), reshard_after_forward=name == "fsdp2"
        )
        opt_cfg = OptimizerConfig(lr=1e-4, bf16=True)
    return wrapped, get_optimizer(opt_cfg, wrapped)


def _step_fn(wrapped, opt, cfg, device, mbs, micro):
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(micro):
        ids = torch.randint(0, cfg.vocab_size - 1, (mbs, cfg.seq_length), generator=g)
        mask = torch.rand(mbs, cfg.seq_length, generator=g) < 0.5
        inputs = ids.masked_fill(mask, cfg.vocab_size - 1)  # the last id plays the mask token
        batches.append((inputs.to(device), ids.to(device), mask.to(device)))

    def step():
        wrapped.zero_grad_buffer()
        opt.zero_grad()
        for i, (inputs, ids, mask) in enumerate(batches):
            sync = i == micro - 1
            with wrapped.no_sync() if not sync else torch.enable_grad():
                logits = wrapped(inputs)
                loss = torch.nn.functional.cross_entropy(logits[mask].float(), ids[mask]) / micro
                loss.backward()
        wrapped.finish_grad_sync()
        if not opt.step()[0]:
            raise RuntimeError("optimizer step skipped (non-finite gradients) in the benchmark")

    return step


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _family(name: str) -> str:
    low = name.lower()
    return next((fam for fam, keys in FAMILIES if any(k in low for k in keys)), "other")


def _profile(step, device) -> dict:
    """Milliseconds per family in one step: CUDA kernel time on a GPU, CPU self time on a CPU."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        _sync(device)
    out = defaultdict(float)
    for e in prof.key_averages():
        if device.type == "cuda":
            us = e.self_device_time_total if e.device_type.name == "CUDA" else 0.0
        else:
            us = e.self_cpu_time_total
        if us:
            out[_family(e.key)] += us / 1e3
    return dict(out)


def measure(name, device, tiny, mbs, micro, reps) -> dict:
    """Step time, peak memory and the per-family profile of one wrapper."""
    cfg, model = _model(device, tiny)
    wrapped, opt = _wrap(name, model)
    step = _step_fn(wrapped, opt, cfg, device, mbs, micro)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step()  # warm-up (allocations, FSDP2's lazy init, kernel selection)
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    families = _profile(step, device)
    del step, wrapped, opt, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"s": statistics.median(times), "peak_gib": peak, "families": families}


def report(rows: dict, device, tiny, mbs, micro) -> list:
    """The two markdown tables (step and breakdown) as lines."""
    base = rows["ddp+distopt"]["s"]
    what = "tiny model" if tiny else "1.7B model, seq 4096"
    lines = [
        f"## FSDP2 vs DDP, world size {dist.get_world_size()}, {device.type}, {what}, bf16, "
        f"{micro} micro-batches of {mbs}",
        "| wrapper | step ms | vs DDP | peak GiB |",
        "|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['s'] * 1e3:.1f} | {r['s'] / base:.3f}x | {r['peak_gib']:.1f} |")
    fams = sorted({f for r in rows.values() for f in r["families"]})
    unit = "GPU kernel ms" if device.type == "cuda" else "CPU self ms"
    lines += ["", f"| family ({unit} in one step) | " + " | ".join(rows) + " |"]
    lines.append("|---" * (len(rows) + 1) + "|")
    for fam in fams:
        cells = " | ".join(f"{r['families'].get(fam, 0.0):.1f}" for r in rows.values())
        lines.append(f"| {fam} | {cells} |")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (CPU, tests)")
    p.add_argument("--mbs", type=int, default=None, help="micro-batch size (default: 2 on GPU, 2 tiny)")
    p.add_argument("--micro", type=int, default=4, help="micro-batches per step (gradient accumulation)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--wrappers", default=",".join(WRAPPERS), help="comma list of: " + ", ".join(WRAPPERS))
    p.add_argument("--out", default=None, help="also write the tables to this file")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    names = [w.strip() for w in a.wrappers.split(",") if w.strip()]
    if "ddp+distopt" not in names or set(names) - set(WRAPPERS):
        p.error(f"--wrappers must include ddp+distopt and name only {', '.join(WRAPPERS)}")
    rows = {n: measure(n, device, a.tiny, a.mbs or 2, a.micro, a.reps) for n in names}
    lines = report(rows, device, a.tiny, a.mbs or 2, a.micro)
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
