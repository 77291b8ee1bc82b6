"""GPU benchmark of the extension: one table per section, every ratio measured in this run.

    python benchmarks/bench_gpu.py                     # all sections, one GPU
    torchrun --nproc-per-node 2 benchmarks/bench_gpu.py --sections ddp
    python benchmarks/bench_gpu.py --dry-run           # tiny sizes; runs on CPU too (CI)

Sections:
  ops  each op on (a) 10,000 small tensors and (b) 200 large ones: ours vs a
       device-to-device copy of the same bytes (ratio = our bandwidth / copy bandwidth,
       target >= 0.85) and vs torch's foreach equivalent (ratio = speed-up; target >= 3
       on 10k tensors); "launches" counts the extension's kernels per call (profiler).
  ddp  one training step (forward, backward, grad sync, optimizer) of our DDP with
       --comm-backend nccl_ext vs the torch NCCL backend (ratio = torch / ours; target >= 1).
       On one process the torch backend skips the collective (a local no-op) while
       nccl_ext still runs NCCL: launch with torchrun on 2+ GPUs for the real comparison.
  mfu  model FLOPs utilisation of a ~1B-parameter bidirectional DLM step (bf16 params,
       masked-token cross-entropy, DDP + Adam): achieved TFLOP/s / --peak-tflops
       (target >= 0.40). Uses only the public API.
Times are medians of --reps timed runs after warm-up (CUDA events on GPU).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), ROOT]

import torch  # noqa: E402

import megadlm_ext as ext  # noqa: E402

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}  # dense, SXM


def _timer(device, fn, reps, warmup=3):
    """Median seconds of fn() over `reps` runs (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _launches(device, fn):
    """Extension kernels launched by one fn() call (None off GPU)."""
    if device.type != "cuda":
        return None
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(
        1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "megadlm" in e.name
    )


def _cases(device, dry):
    g = torch.Generator().manual_seed(0)
    n_small, n_large, large = (200, 8, 1 << 14) if dry else (10_000, 200, 1 << 22)
    small = [int(x) for x in torch.randint(256, 4097, (n_small,), generator=g)]
    return {
        f"(a) {n_small} tensors, 256-4096 el.": [torch.randn(n, device=device) for n in small],
        f"(b) {n_large} tensors, {large} el.": [torch.randn(large, device=device) for _ in range(n_large)],
    }


def _op_rows(ts, device, reps):
    """(op, ours_s, bytes moved, foreach name, foreach_s, launches) per op."""
    numel = sum(t.numel() for t in ts)
    flat = torch.empty(numel, device=device)
    views = list(flat.split([t.numel() for t in ts]))
    bf = [t.bfloat16() for t in ts]
    b4 = 4 * numel
    ops = [
        (
            "flatten",
            lambda: ext.flatten(ts, flat),
            2 * b4,
            "_foreach_copy_",
            lambda: torch._foreach_copy_(views, ts),
        ),
        (
            "accumulate_into bf16->fp32",
            lambda: ext.accumulate_into(flat, bf),
            b4 // 2 + 2 * b4,
            "_foreach_add_",
            lambda: torch._foreach_add_(views, bf),
        ),
        (
            "scale_",
            lambda: ext.scale_(ts, 1.0000001),
            2 * b4,
            "_foreach_mul_",
            lambda: torch._foreach_mul_(ts, 1.0000001),
        ),
        (
            "l2_norm",
            lambda: ext.l2_norm(ts),
            b4,
            "_foreach_norm+norm",
            lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts))),
        ),
        (
            "has_nonfinite",
            lambda: ext.has_nonfinite(ts),
            b4,
            "isfinite(_foreach_norm)",
            lambda: bool(torch.stack(torch._foreach_norm(ts)).isfinite().all()),
        ),
    ]
    rows = []
    for name, ours, nbytes, fname, foreach in ops:
        rows.append(
            (
                name,
                _timer(device, ours, reps),
                nbytes,
                fname,
                _timer(device, foreach, reps),
                _launches(device, ours),
            )
        )
    return rows


def section_ops(device, reps, dry):
    print(f"\n## ops ({device.type}; ratio vs copy = our GB/s / D2D copy GB/s of the same bytes)")
    print("| case | op | ours ms | ours GB/s | vs copy | foreach | foreach ms | vs foreach | launches |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case, ts in _cases(device, dry).items():
        numel = sum(t.numel() for t in ts)
        src, dst = torch.randn(numel, device=device), torch.empty(numel, device=device)
        copy_s = _timer(device, lambda src=src, dst=dst: dst.copy_(src), reps)
        copy_bw = 8 * numel / copy_s
        for name, ours_s, nbytes, fname, fe_s, launches in _op_rows(ts, device, reps):
            bw = nbytes / ours_s
            print(
                f"| {case} | {name} | {ours_s * 1e3:.3f} | {bw / 1e9:.1f} | {bw / copy_bw:.2f}x | {fname} | "
                f"{fe_s * 1e3:.3f} | {fe_s / ours_s:.2f}x | {'-' if launches is None else launches} |"
            )
        base = f"{copy_s * 1e3:.3f} | {copy_bw / 1e9:.1f}"
        print(f"| {case} | D2D copy_ (baseline) | {base} | 1.00x |  |  |  |  |")


def _init_dist(device):
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=5))


def _model(device, size, dry):
    from megadlms.models import GPTModel, TransformerConfig

    if dry:
        dims = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512, seq_length=64)
    elif size == "1b":  # 18 x (4h^2 + 3*h*ffn) + vocab*h = 1.03B parameters
        dims = dict(
            num_layers=18, hidden_size=2048, num_attention_heads=16, vocab_size=50304, seq_length=2048
        )
    else:
        dims = dict(num_layers=8, hidden_size=1024, num_attention_heads=16, vocab_size=32768, seq_length=1024)
    cfg = TransformerConfig(
        **dims,
        ffn_hidden_size=dims["hidden_size"] * 11 // 4 // 64 * 64 if not dry else 128,
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        position_embedding_type="rope",
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    torch.manual_seed(0)
    with torch.device(device):  # parameters created on the device (1B params: no CPU detour)
        return cfg, GPTModel(cfg, attention="bidirectional")


def _train_step_fn(device, size, mbs, backend, dry):
    """A closure running one DLM training step; returns (fn, config, parameter count)."""
    from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig, Float16Module
    from megadlms.optimizer import OptimizerConfig, get_optimizer

    cfg, model = _model(device, size, dry)
    low = torch.bfloat16
    ddp = DistributedDataParallel(
        Float16Module(model, dtype=low),
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True, comm_backend=backend
        ),
        process_group=None,
    )
    opt = get_optimizer(OptimizerConfig(lr=1e-4, bf16=True), ddp)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size - 1, (mbs, cfg.seq_length), generator=g).to(device)
    mask = torch.rand(mbs, cfg.seq_length, generator=g).to(device) < 0.5
    inputs = ids.masked_fill(mask, cfg.vocab_size - 1)  # last id plays the mask token

    def step():
        ddp.zero_grad_buffer()
        opt.zero_grad()
        logits = ddp(inputs)
        loss = torch.nn.functional.cross_entropy(logits[mask].float(), ids[mask])
        loss.backward()
        ddp.finish_grad_sync()
        ok, _ = opt.step()
        if not ok:
            raise RuntimeError("optimizer step skipped (non-finite gradients) in the benchmark")

    return step, cfg, sum(p.numel() for p in model.parameters())


def section_ddp(device, reps, dry):
    import torch.distributed as dist

    _init_dist(device)
    print(f"\n## ddp step (world size {dist.get_world_size()}; ratio = torch NCCL / nccl_ext)")
    print("| model | backend | step ms | ratio |")
    print("|---|---|---|---|")
    backends = ("torch", "nccl_ext") if device.type == "cuda" else ("torch",)  # CPU: gloo only
    times = {}
    for backend in backends:
        step, _, _ = _train_step_fn(device, "small", 2, backend, dry)
        times[backend] = _timer(device, step, reps)
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    model = "2L-64h (dry run)" if dry else "8L-1024h"
    for backend, t in times.items():
        print(f"| {model} | {backend} | {t * 1e3:.2f} | {times['torch'] / t:.2f}x |")
    if "nccl_ext" not in times:
        print(f"| {model} | nccl_ext | needs CUDA (skipped) | |")


def section_mfu(device, reps, dry, peak_tflops, mbs):
    from megadlms.models import num_floating_point_operations

    _init_dist(device)
    step, cfg, n_params = _train_step_fn(device, "1b", mbs, "torch", dry)
    tokens = mbs * cfg.seq_length
    seconds = _timer(device, step, reps, warmup=2)
    flops = num_floating_point_operations(cfg, mbs, cfg.seq_length)
    if peak_tflops is None and device.type == "cuda":
        name = torch.cuda.get_device_name()
        peak_tflops = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    achieved = flops / seconds / 1e12
    mfu = "n/a (pass --peak-tflops)" if not peak_tflops else f"{achieved / peak_tflops:.1%}"
    print(f"\n## mfu ({n_params / 1e9:.3f}B params, bf16, micro-batch {mbs} x {cfg.seq_length} tokens)")
    print("| step ms | tokens/s | TFLOP/s | peak TFLOP/s | MFU |")
    print("|---|---|---|---|---|")
    print(f"| {seconds * 1e3:.1f} | {tokens / seconds:.0f} | {achieved:.2f} | {peak_tflops or '-'} | {mfu} |")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default="ops,ddp,mfu", help="comma list of: ops, ddp, mfu")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--reps", type=int, default=20, help="timed runs per measurement (median)")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes (CI / CPU check of this script)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the GPU (MFU)")
    p.add_argument("--mbs", type=int, default=4, help="micro-batch of the MFU step")
    a = p.parse_args(argv)
    a.sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    bad = sorted(set(a.sections) - {"ops", "ddp", "mfu"})
    if bad:
        p.error(f"--sections: unknown {bad}; choose from ops, ddp, mfu")
    if a.reps < 1:
        p.error(f"--reps must be >= 1, got {a.reps}")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available (use --device cpu with --dry-run)")
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device == "cpu" and not a.dry_run:
        p.error(
            "the full-size benchmark needs a GPU; on CPU use --dry-run (benchmarks/bench_ext.py times CPU)"
        )
    return a


def main(argv=None):
    a = parse(argv)
    device = torch.device(a.device)
    info = ext.backend_info()
    if device.type == "cuda" and not info["cuda"]:
        raise SystemExit(f"megadlm_ext was built without CUDA ({info}); rebuild with MEGADLM_EXT_CUDA=1")
    print(
        f"bench_gpu: device={device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), "
        f"torch {torch.__version__}, megadlm_ext {info}, dry_run={a.dry_run}"
    )
    if "ops" in a.sections:
        section_ops(device, a.reps, a.dry_run)
    if "ddp" in a.sections:
        section_ddp(device, a.reps, a.dry_run)
    if "mfu" in a.sections:
        section_mfu(device, max(3, a.reps // 4), a.dry_run, a.peak_tflops, 1 if a.dry_run else a.mbs)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
