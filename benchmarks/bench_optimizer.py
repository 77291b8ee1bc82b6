"""AdamW step time against the memory floor: torch's kernels, megadlm_ext.adamw_step (ours)
and the precision-aware optimizer's per-parameter Python step, on ~1.41B fp32 parameters
shaped like bench_gpu's 1B model (the shapes of the first GPU run's adamw.py: 2 x (50304,
2048) embeddings, 18 layers of (6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192) and two
(2048,) norms).

    python benchmarks/bench_optimizer.py                         # CUDA, 1.41B params
    python benchmarks/bench_optimizer.py --dry-run --device cpu  # tiny shapes (CI, tests)

Per variant: ms per step (median of --reps steps after warm-up; CUDA events on GPU), the
bytes per parameter it must move at least (B/param), the floor = params x B/param / the
device-copy bandwidth measured in this run (``dst.copy_(src)`` of 1 GiB, bytes read + written
per second), "of floor" = floor / time (1.0: moving its bytes at the copy's bandwidth; our
target >= 0.85), and the speed-up against the baseline, torch's fused AdamW (its time / ours).

  B/param: fp32 param read + written 8, grad 4 (bf16: 2), each moment read + written 8 (bf16:
  4); the bf16 model copy written in the same pass +2; a separate copy main -> model after
  the step +6 (read fp32 4, write bf16 2). The Python step is charged the floor of its
  storage (20 B with bf16 moments): its decode/encode temporaries are its own cost.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), ROOT, os.path.join(ROOT, "benchmarks")]

import torch  # noqa: E402
from bench_gpu import _timer  # noqa: E402  (one timer for every GPU benchmark)

import megadlm_ext as ext  # noqa: E402
from megadlms.optimizer import PrecisionAwareAdamW  # noqa: E402

LR, WD, BETAS, EPS = 1e-4, 0.1, (0.9, 0.999), 1e-8
BASELINE = "torch fused (fp32)"


def shapes(dry: bool):
    h, ffn, layers, vocab = (64, 256, 2, 512) if dry else (2048, 8192, 18, 50304)
    per_layer = ((3 * h, h), (h, h), (2 * ffn, h), (h, ffn), (h,), (h,))
    return [(vocab, h), (vocab, h)] + [s for _ in range(layers) for s in per_layer]


def _params(shps, device, grad_dtype=torch.float32):
    """Params with gradients: fp32 in ``.grad``, bf16 in ``.decoupled_grad`` (what the layouts
    hand the precision-aware optimizer for --main-grads-dtype bf16)."""
    ps = []
    for s in shps:
        p = torch.nn.Parameter(torch.randn(s, device=device) * 0.02)
        g = torch.randn(s, device=device) * 1e-3
        if grad_dtype == torch.float32:
            p.grad = g
        else:
            p.decoupled_grad = g.to(grad_dtype)
        ps.append(p)
    return ps


def _precision_aware(ps, kernel, moments=torch.float32):
    return PrecisionAwareAdamW(
        ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, exp_avg_dtype=moments, exp_avg_sq_dtype=moments,
        kernel=kernel,
    )  # fmt: skip


def _op_only(ps, model_dtype=None):
    """megadlm_ext.adamw_step on the lists an optimizer would pass (no optimizer Python)."""
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    gs = [p.grad for p in ps]
    models = None if model_dtype is None else [torch.empty_like(p, dtype=model_dtype) for p in ps]
    count = [0]

    def step():
        count[0] += 1
        with torch.no_grad():
            ext.adamw_step(
                ps, gs, ms, vs, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD,
                step=count[0], model_params=models,
            )  # fmt: skip

    return step


def _then_copy(opt, ps):
    """The step, then the bf16 model copy as a separate pass (what copy_main_to_model does)."""
    models = [torch.empty_like(p, dtype=torch.bfloat16) for p in ps]

    def step():
        opt.step()
        torch._foreach_copy_(models, [p.detach() for p in ps])

    return step


# name -> (bytes per param, grad dtype, builder(params) -> step function)
VARIANTS = {
    "torch foreach (fp32)": (
        28,
        torch.float32,
        lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD, foreach=True).step,
    ),  # noqa: E501
    BASELINE: (28, torch.float32, lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD, fused=True).step),
    "ours (fp32)": (28, torch.float32, lambda ps: _precision_aware(ps, "megadlm").step),
    "ours, op only (fp32)": (28, torch.float32, _op_only),
    "ours bf16 moments": (20, torch.float32, lambda ps: _precision_aware(ps, "megadlm", torch.bfloat16).step),
    "ours bf16 moments + bf16 grads": (
        18,
        torch.bfloat16,
        lambda ps: _precision_aware(ps, "megadlm", torch.bfloat16).step,
    ),  # noqa: E501
    "ours (fp32) + separate bf16 copy": (
        34,
        torch.float32,
        lambda ps: _then_copy(_precision_aware(ps, "megadlm"), ps),
    ),  # noqa: E501
    "ours, op + bf16 model write": (30, torch.float32, lambda ps: _op_only(ps, torch.bfloat16)),
    "python step, bf16 moments": (
        20,
        torch.float32,
        lambda ps: _precision_aware(ps, "python", torch.bfloat16).step,
    ),  # noqa: E501
}


def copy_bandwidth(device, reps, dry):
    """Bytes per second of ``dst.copy_(src)`` (bytes read + written)."""
    n = (1 << 20) if dry else (1 << 28)  # 4 MiB / 1 GiB of fp32
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    sec = _timer(device, lambda: dst.copy_(src), reps, warmup=2)
    return 2 * n * 4 / sec


def run(device, reps, dry, names=None):
    """The table's rows: (name, B/param, ms, floor ms, of floor, speed-up vs the baseline)."""
    shps = shapes(dry)
    n = sum(torch.Size(s).numel() for s in shps)
    bw = copy_bandwidth(device, reps, dry)
    rows, times = [], {}
    for name, (bpp, gdt, build) in VARIANTS.items():
        if names and name not in names and name != BASELINE:
            continue
        torch.manual_seed(0)
        ps = _params(shps, device, gdt)
        step = build(ps)
        times[name] = _timer(device, step, reps, warmup=2)
        del step, ps
        if device.type == "cuda":
            torch.cuda.empty_cache()
        floor = n * bpp / bw
        rows.append([name, bpp, times[name] * 1e3, floor * 1e3, floor / times[name]])
    for row in rows:
        row.append(times[BASELINE] / times[row[0]])
    return n, bw, rows


def _device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def table(device, n, bw, rows) -> str:
    lines = [
        f"AdamW step, {n / 1e6:,.1f}M params on {_device_name(device)}; device copy {bw / 1e9:.1f} GB/s "
        f"(read + write); baseline: {BASELINE}",
        "",
        "| variant | B/param | ms/step | floor ms | of floor | vs baseline |",
        "|---|---|---|---|---|---|",
    ]
    for name, bpp, ms, floor, frac, speed in rows:
        lines.append(f"| {name} | {bpp} | {ms:.2f} | {floor:.2f} | {frac:.2f} | {speed:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --dry-run)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes: checks the script (CI)")
    ap.add_argument("--reps", type=int, default=None, help="timed steps per variant (default 10; 2 dry)")
    ap.add_argument("--variants", default=None, help=f"comma-separated subset of: {', '.join(VARIANTS)}")
    ap.add_argument("--out", default=None, help="also append the table to this file")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: on CPU use --dry-run --device cpu")
    if device.type == "cpu" and not a.dry_run:
        ap.error("on CPU use --dry-run (1.4B parameters are a GPU benchmark)")
    names = None
    if a.variants:
        names = [v.strip() for v in a.variants.split(",")]
        unknown = [v for v in names if v not in VARIANTS]
        if unknown:
            ap.error(f"unknown variants {unknown}; choose from: {', '.join(VARIANTS)}")
    reps = a.reps or (2 if a.dry_run else 10)
    n, bw, rows = run(device, reps, a.dry_run, names)
    text = table(device, n, bw, rows)
    print(text, flush=True)
    if a.out:
        with open(a.out, "a") as f:  # appended: gpu_check.sh collects every benchmark's tables in one file
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
