"""GPU benchmark of the extension: one table per section, every ratio measured in this run.

    python benchmarks/bench_gpu.py                     # ops, ddp, fused, mfu on one GPU
    torchrun --nproc-per-node 2 benchmarks/bench_gpu.py --sections ddp,comm
    python benchmarks/bench_gpu.py --dry-run           # tiny sizes; runs on CPU too (CI)

Sections:
  ops  each op on (a) 10,000 small tensors and (b) 200 large ones, side by side: eager on
       the list (parsed every call), eager on a megadlm_ext.TensorTable of it (built once),
       and kernel-only (the table op captured into a CUDA graph and replayed; has_nonfinite:
       nonfinite_flag, the bool's host sync is not capturable). "table / kernel" is the host
       overhead left on a table (target <= 1.25). vs copy: kernel bandwidth (CPU: the table
       op's) against a device-to-device copy that moves the bytes the op moves (an op that
       only reads n bytes is compared with a copy of n/2 bytes: n/2 read + n/2 written;
       target >= 0.85); vs foreach: torch's foreach equivalent over the table op (speed-up;
       target >= 3 on 10k tensors); "launches" counts the extension's kernels per table call
       (profiler).
  ddp  one training step (forward, backward, grad sync, optimizer) of our DDP with
       --comm-backend nccl_ext vs the torch NCCL backend (ratio = torch / ours; target
       >= 1). On one rank the ratio is "n/a": torch's backend skips the collective at
       world size 1 while nccl_ext still runs NCCL; the step times are still printed.
  comm (2+ ranks, torchrun) all-reduce bus bandwidth of nccl_ext vs torch NCCL over
       message sizes (busbw = bytes * 2 (n-1) / n / time, as nccl-tests defines it).
  fused the model's fused elementwise paths (rotary embedding, SwiGLU, residual add + RMSNorm)
       vs the unfused torch ops, forward and forward + backward, at MegaDLMs' 1.7B shapes
       (benchmarks/bench_fused.py): speed-up, the fused forward's GB/s and kernels per call.
  mfu  model FLOPs utilisation of a ~1B-parameter bidirectional DLM step (bf16 params,
       masked-token cross-entropy, DDP + Adam) against the bf16 matmul ceiling measured
       here (8192^3 products on random data; --peak-tflops overrides it), target >= 0.40;
       the datasheet figure is printed beside it. Memory: peak allocated during the step,
       and the optimizer state (fp32 main params + Adam moments) per rank.
Times are medians of --reps timed runs after warm-up (CUDA events on GPU). --out FILE
also appends the tables (rank 0) to FILE.
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

DATASHEET_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}  # dense, SXM
_OUT = {"file": None}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def emit(line: str = "") -> None:
    """Print one table line on rank 0 (and append it to --out)."""
    if _rank() != 0:
        return
    print(line, flush=True)
    if _OUT["file"]:
        with open(_OUT["file"], "a") as f:
            f.write(line + "\n")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


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


def _kernel_seconds(device, fn, reps):
    """Median time of fn()'s kernels alone: fn captured once into a CUDA graph (after a warm-up
    on a side stream, which also uploads the segment tables), then replayed. None off GPU."""
    if device.type != "cuda":
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    seconds = _timer(device, graph.replay, reps)
    del graph
    return seconds


def _op_rows(ts, device, reps):
    """Per op: eager time on the list and on a TensorTable of it, kernel-only time (the table
    op replayed from a CUDA graph), the bytes it moves, torch's foreach equivalent, launches."""
    numel = sum(t.numel() for t in ts)
    flat = torch.empty(numel, device=device)
    views = list(flat.split([t.numel() for t in ts]))
    bf = [t.bfloat16() for t in ts]
    table, bf_table = ext.TensorTable(ts), ext.TensorTable(bf)
    b4 = 4 * numel
    # (op, list call, table call, graph-capturable table call, bytes, foreach name, foreach call)
    ops = [
        (
            "flatten",
            lambda: ext.flatten(ts, flat),
            lambda: ext.flatten(table, flat),
            None,
            2 * b4,
            "_foreach_copy_",
            lambda: torch._foreach_copy_(views, ts),
        ),
        (
            "accumulate_into bf16->fp32",
            lambda: ext.accumulate_into(flat, bf),
            lambda: ext.accumulate_into(flat, bf_table),
            None,
            b4 // 2 + 2 * b4,  # bf16 read, fp32 read + written
            "_foreach_add_",
            lambda: torch._foreach_add_(views, bf),
        ),
        (
            "scale_",
            lambda: ext.scale_(ts, 1.0000001),
            lambda: ext.scale_(table, 1.0000001),
            None,
            2 * b4,
            "_foreach_mul_",
            lambda: torch._foreach_mul_(ts, 1.0000001),
        ),
        (
            "l2_norm",
            lambda: ext.l2_norm(ts),
            lambda: ext.l2_norm(table),
            None,
            b4,  # read only
            "_foreach_norm+norm",
            lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts))),
        ),
        (
            "has_nonfinite",
            lambda: ext.has_nonfinite(ts),
            lambda: ext.has_nonfinite(table),
            lambda: ext.nonfinite_flag(table),  # the bool needs a host sync: not capturable
            b4,
            "isfinite(_foreach_norm)",
            lambda: bool(torch.stack(torch._foreach_norm(ts)).isfinite().all()),
        ),
    ]
    rows = []
    for name, on_list, on_table, kernel_fn, nbytes, fname, fe in ops:
        rows.append(
            {
                "op": name,
                "list": _timer(device, on_list, reps),
                "table": _timer(device, on_table, reps),
                "kernel": _kernel_seconds(device, kernel_fn or on_table, reps),
                "bytes": nbytes,
                "foreach_name": fname,
                "foreach": _timer(device, fe, reps),
                "launches": _launches(device, on_table),
            }
        )
    return rows


def _copy_seconds(device, nbytes, reps, cache):
    """Median time of a fp32 D2D copy moving `nbytes` in all (nbytes/2 read, nbytes/2 written)."""
    if nbytes not in cache:
        n = max(1, nbytes // 8)
        src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
        cache[nbytes] = _timer(device, lambda: dst.copy_(src), reps)
    return cache[nbytes]


def section_ops(device, reps, dry):
    emit(
        f"\n## ops ({device.type}; eager on the list and on a TensorTable of it, kernel = the table op "
        "replayed from a CUDA graph; vs copy = kernel GB/s (CPU: table) / GB/s of a D2D copy moving "
        "the same bytes; targets: table / kernel <= 1.25, vs copy >= 0.85)"
    )
    emit(
        "| case | op | bytes moved | list ms | table ms | kernel ms | table / kernel | table vs list "
        "| copy GB/s | vs copy | foreach | foreach ms | vs foreach | launches |"
    )
    emit("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case, ts in _cases(device, dry).items():
        cache = {}
        for r in _op_rows(ts, device, reps):
            copy_bw = r["bytes"] / _copy_seconds(device, r["bytes"], reps, cache)
            kernel, table = r["kernel"], r["table"]
            bw = r["bytes"] / (kernel if kernel is not None else table)
            kernel_ms = "-" if kernel is None else f"{kernel * 1e3:.3f}"
            over_kernel = "-" if kernel is None else f"{table / kernel:.2f}x"
            launches = "-" if r["launches"] is None else r["launches"]
            emit(
                f"| {case} | {r['op']} | {r['bytes'] / 1e6:.1f} MB | {r['list'] * 1e3:.3f} | "
                f"{table * 1e3:.3f} | {kernel_ms} | {over_kernel} | {r['list'] / table:.2f}x | "
                f"{copy_bw / 1e9:.1f} | {bw / copy_bw:.2f}x | {r['foreach_name']} | "
                f"{r['foreach'] * 1e3:.3f} | {r['foreach'] / table:.2f}x | {launches} |"
            )


def _init_dist(device):
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=5)
    if int(os.environ.get("WORLD_SIZE", 1)) == 1:
        # a world of one needs no TCP port: a MASTER_PORT inherited from the caller's
        # environment may be taken (EADDRINUSE seen under pytest)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)


def _model(device, size, dry, fused=True):
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
        apply_rope_fusion=fused,
        bias_swiglu_fusion=fused,
        residual_rmsnorm_fusion=fused,
    )
    torch.manual_seed(0)
    with torch.device(device):  # parameters created on the device (1B params: no CPU detour)
        return cfg, GPTModel(cfg, attention="bidirectional")


def _train_step_fn(device, size, mbs, backend, dry, fused=True):
    """A closure running one DLM training step; returns (fn, config, parameter count, optimizer).
    ``fused``: the model's fused elementwise kernels (their flags; GPU only)."""
    from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig, Float16Module
    from megadlms.optimizer import OptimizerConfig, get_optimizer

    cfg, model = _model(device, size, dry, fused)
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

    return step, cfg, sum(p.numel() for p in model.parameters()), opt


def section_ddp(device, reps, dry):
    import torch.distributed as dist

    _init_dist(device)
    world = dist.get_world_size()
    emit(f"\n## ddp step (world size {world}; ratio = torch NCCL step time / nccl_ext step time)")
    emit("| model | backend | step ms | ratio |")
    emit("|---|---|---|---|")
    backends = ("torch", "nccl_ext") if device.type == "cuda" else ("torch",)  # CPU: gloo only
    times = {}
    for backend in backends:
        step, _, _, _ = _train_step_fn(device, "small", 2, backend, dry)
        times[backend] = _timer(device, step, reps)
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    model = "2L-64h (dry run)" if dry else "8L-1024h"
    for backend, t in times.items():
        ratio = f"{times['torch'] / t:.2f}x" if world > 1 else "n/a (1 rank: torch skips the collective)"
        emit(f"| {model} | {backend} | {t * 1e3:.2f} | {ratio} |")
    if "nccl_ext" not in times:
        emit(f"| {model} | nccl_ext | needs CUDA (skipped) | |")


def section_comm(device, reps, dry):
    """All-reduce bus bandwidth, nccl_ext vs torch NCCL (2+ ranks)."""
    import torch.distributed as dist

    _init_dist(device)
    world = dist.get_world_size()
    emit(f"\n## all-reduce bus bandwidth (world size {world}, fp32; busbw = bytes * 2(n-1)/n / time)")
    if world < 2 or device.type != "cuda":
        emit("n/a: needs 2+ GPU ranks (torchrun --nproc-per-node N benchmarks/bench_gpu.py --sections comm)")
        return
    from megadlms.distributed.comm import NcclExtCommunicator

    ours = NcclExtCommunicator(dist.group.WORLD)
    emit("| size | torch GB/s | nccl_ext GB/s | ratio |")
    emit("|---|---|---|---|")
    for mb in (1, 8, 64, 256, 1024):
        buf = torch.ones(mb * (1 << 20) // 4, device=device)
        t_torch = _timer(device, lambda buf=buf: dist.all_reduce(buf), reps)
        t_ours = _timer(device, lambda buf=buf: ours.all_reduce(buf), reps)
        bus = buf.numel() * 4 * 2 * (world - 1) / world
        emit(f"| {mb} MB | {bus / t_torch / 1e9:.1f} | {bus / t_ours / 1e9:.1f} | {t_torch / t_ours:.2f}x |")
    ours.close()


def matmul_ceiling_tflops(device, dry):
    """Measured dense bf16 matmul TFLOP/s: mean of 10 products after 3 warm-ups (random data)."""
    n = 256 if dry else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync(device)
    return 2 * n**3 * 10 / (time.perf_counter() - t0) / 1e12


def _optimizer_state_bytes(opt) -> int:
    """fp32 main params + optimizer moments held by this rank."""
    moments = sum(
        t.numel() * t.element_size()
        for st in opt.inner.state.values()
        for t in st.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    return moments + sum(e.main.numel() * e.main.element_size() for e in opt.layout.entries)


def section_mfu(device, reps, dry, peak_tflops, mbs):
    from megadlms.models import num_floating_point_operations

    _init_dist(device)
    ceiling = matmul_ceiling_tflops(device, dry)
    if device.type == "cuda":  # the earlier sections' models (hook cycles) out of the peak
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    step, cfg, n_params, opt = _train_step_fn(device, "1b", mbs, "torch", dry)
    tokens = mbs * cfg.seq_length
    seconds = _timer(device, step, reps, warmup=2)
    flops = num_floating_point_operations(cfg, mbs, cfg.seq_length)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    sheet = next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in name), None)
    peak = peak_tflops if peak_tflops is not None else ceiling
    achieved = flops / seconds / 1e12
    emit(f"\n## mfu ({n_params / 1e9:.3f}B params, bf16, micro-batch {mbs} x {cfg.seq_length} tokens)")
    emit(
        "| step ms | tokens/s | TFLOP/s | matmul ceiling TFLOP/s (measured) | MFU vs ceiling | datasheet "
        "| MFU vs datasheet |"
    )
    emit("|---|---|---|---|---|---|---|")
    vs_sheet = f"{achieved / sheet:.1%}" if sheet else "-"
    emit(
        f"| {seconds * 1e3:.1f} | {tokens / seconds:.0f} | {achieved:.2f} | {peak:.1f}"
        f"{' (--peak-tflops)' if peak_tflops is not None else ''} | {achieved / peak:.1%} | "
        f"{sheet or '-'} | {vs_sheet} |"
    )
    emit("\n## memory (the MFU step)")
    emit("| figure | value |")
    emit("|---|---|")
    peak_mem = (
        f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if device.type == "cuda" else "n/a (cpu)"
    )
    emit(f"| peak allocated | {peak_mem} |")
    emit(
        "| optimizer state per rank (fp32 main params + Adam moments) | "
        f"{_optimizer_state_bytes(opt) / 2**30:.3f} GiB |"
    )
    emit("| activation recompute | off here (saved bytes per layer: benchmarks/activation_memory.py) |")


SECTIONS = ("ops", "ddp", "comm", "fused", "mfu")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default="ops,ddp,fused,mfu", help="comma list of: " + ", ".join(SECTIONS))
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--reps", type=int, default=20, help="timed runs per measurement (median)")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes (CI / CPU check of this script)")
    p.add_argument("--peak-tflops", type=float, default=None, help="bf16 peak for MFU (default: measured)")
    p.add_argument("--mbs", type=int, default=4, help="micro-batch of the MFU step")
    p.add_argument("--out", default=None, help="also append the tables to this file (rank 0)")
    a = p.parse_args(argv)
    a.sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    bad = sorted(set(a.sections) - set(SECTIONS))
    if bad:
        p.error(f"--sections: unknown {bad}; choose from {', '.join(SECTIONS)}")
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
    _OUT["file"] = a.out  # appended to: gpu_check.sh collects every benchmark's tables in one file
    emit(
        f"bench_gpu: device={device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), "
        f"torch {torch.__version__}, megadlm_ext {info}, dry_run={a.dry_run}"
    )
    if "ops" in a.sections:
        section_ops(device, a.reps, a.dry_run)
    if "ddp" in a.sections:
        section_ddp(device, a.reps, a.dry_run)
    if "comm" in a.sections:
        section_comm(device, a.reps, a.dry_run)
    if "fused" in a.sections:
        from bench_fused import section_fused

        _init_dist(device)
        mbs = 1 if a.dry_run else a.mbs
        step = lambda fused: _train_step_fn(device, "1b", mbs, "torch", a.dry_run, fused)[0]  # noqa: E731
        section_fused(device, a.reps, a.dry_run, emit, _timer, step)
    if "mfu" in a.sections:
        section_mfu(device, max(3, a.reps // 4), a.dry_run, a.peak_tflops, 1 if a.dry_run else a.mbs)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
