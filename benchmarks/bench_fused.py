"""The ``fused`` section of benchmarks/bench_gpu.py: each fused elementwise path of the model
against the unfused torch ops it replaces, at MegaDLMs' 1.7B model's shapes (micro-batch 4 x
4096 tokens, 16 heads x 128, hidden 2048, ffn 6144, bf16), forward alone and forward +
backward through the model's own functions (megadlms.ops: the same code the layers call, with
``fused=`` on and off).

Columns: median ms of each, speed-up (unfused / fused), the fused forward's bandwidth (the
bytes its kernel must read and write once) and its fraction of a device-to-device copy's
bandwidth measured here, and the CUDA kernels launched per call (profiler). On CPU
(``--dry-run``) the sizes are tiny and the fused paths run through the extension's CPU route
(``fused_kernels_on_cpu``) so the script itself is checked; those numbers mean nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from megadlms.ops import apply_rotary, fused_kernels_on_cpu, residual_add_norm, swiglu

FULL = dict(B=4, S=4096, N=16, D=128, H=2048, F=6144)
DRY = dict(B=1, S=32, N=2, D=16, H=64, F=96)


def _kernels(device, fn) -> str:
    if device.type != "cuda":
        return "-"
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return str(sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA))


def _cases(device, dims):
    """(name, fn(fused) forward, fn(fused) forward + backward, bytes the fused forward moves)."""
    B, S, N, D, H, F = (dims[k] for k in ("B", "S", "N", "D", "H", "F"))
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    es = torch.tensor([], dtype=dt).element_size()
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=device, generator=g).to(dt)

    # q and k as SelfAttention hands them over (MHA: strided views of the qkv output)
    qkv = rand(B, S, N, 3 * D).requires_grad_(True)
    pos = torch.arange(S, device=device, dtype=torch.float32)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D))
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)[None, :, None, :].expand(B, S, 1, D).contiguous()
    cos, sin = emb.cos(), emb.sin()

    def rope(fused):
        q, k, _ = qkv.split(D, dim=-1)
        return apply_rotary(q, cos, sin, fused=fused), apply_rotary(k, cos, sin, fused=fused)

    h_fc1 = rand(B, S, 2 * F).requires_grad_(True)
    x, h_attn = rand(B, S, H).requires_grad_(True), rand(B, S, H).requires_grad_(True)
    norm = nn.RMSNorm(H, eps=1e-6, device=device, dtype=dt)

    def backward(outs):
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    cases = [
        ("rotary q + k", rope, 2 * 2 * B * S * N * D * es),
        ("swiglu", lambda fused: swiglu(h_fc1, fused=fused), 3 * B * S * F * es),
        (
            "residual add + rmsnorm",
            lambda fused: residual_add_norm(x, h_attn, norm, fused=fused),
            4 * B * S * H * es,
        ),
    ]
    return [(name, fn, lambda fused, fn=fn: backward(fn(fused)), nbytes) for name, fn, nbytes in cases]


def _step_row(device, reps, emit, timer, step) -> None:
    """One training step of the mfu section's model, fusion on vs off (``step(fused)`` builds it)."""
    times = {}
    for fused in (False, True):
        fn = step(fused)
        times[fused] = timer(device, fn, max(3, reps // 4), warmup=2)
        del fn
        if device.type == "cuda":
            import gc

            gc.collect()
            torch.cuda.empty_cache()
    speedup = times[False] / times[True]
    emit(f"| training step (mfu model) | forward + backward + step | {times[False] * 1e3:.1f} | "
         f"{times[True] * 1e3:.1f} | {speedup:.2f}x | | | | |")  # fmt: skip


def section_fused(device, reps, dry, emit, timer, step=None):
    """Emit the fused-vs-unfused table (``emit``/``timer``: bench_gpu.py's; ``step(fused)``: a
    training-step closure of the mfu model, for a last row of the whole step)."""
    dims = DRY if dry else FULL
    emit(
        f"\n## fused elementwise kernels ({device.type}; B {dims['B']} x S {dims['S']}, {dims['N']} heads x "
        f"{dims['D']}, hidden {dims['H']}, ffn {dims['F']}; speed-up = unfused ms / fused ms)"
    )
    emit(
        "| op | pass | unfused ms | fused ms | speed-up | fused GB/s | vs copy | kernels unfused "
        "| kernels fused |"
    )
    emit("|---|---|---|---|---|---|---|---|---|")
    n = 1 << (27 if not dry else 16)
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    copy_bw = 2 * n * 4 / timer(device, lambda: dst.copy_(src), reps)
    with fused_kernels_on_cpu(device.type == "cpu"):
        for name, fwd, fwd_bwd, nbytes in _cases(device, dims):
            for label, fn in (("forward", fwd), ("forward + backward", fwd_bwd)):
                with torch.set_grad_enabled(label != "forward"):
                    unfused = timer(device, lambda fn=fn: fn(False), reps)
                    fused = timer(device, lambda fn=fn: fn(True), reps)
                    k_unfused = _kernels(device, lambda fn=fn: fn(False))
                    k_fused = _kernels(device, lambda fn=fn: fn(True))
                bw = f"{nbytes / fused / 1e9:.0f}" if label == "forward" else ""
                vs = f"{nbytes / fused / copy_bw:.2f}x" if label == "forward" else ""
                times = f"{unfused * 1e3:.3f} | {fused * 1e3:.3f} | {unfused / fused:.2f}x"
                emit(f"| {name} | {label} | {times} | {bw} | {vs} | {k_unfused} | {k_fused} |")
        if step is not None:
            _step_row(device, reps, emit, timer, step)
