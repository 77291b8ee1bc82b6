"""Benchmark of megadlm_ext's fused multi-tensor ops against PyTorch baselines.

    python benchmarks/bench_ext.py                    # CPU, torch's default thread count
    python benchmarks/bench_ext.py --device cuda      # GPU (CUDA build of megadlm_ext)
    python benchmarks/bench_ext.py --cases cd --threads 1 --repeats 101   # list vs TensorTable

One table; each row is a ratio measured in this run (medians of --repeats timings,
ops interleaved so machine noise hits all of them alike):
  (a) 200 fp32 tensors totalling 256 MB, (b) 20,000 fp32 tensors of 512-4096 elements;
  flatten into a preallocated buffer vs dst.copy_(src) of the same bytes (the memory
  bandwidth ceiling; ratio = ours / ceiling bandwidth), vs torch.cat(out=) and
  torch._foreach_copy_ (ratio = speed-up), and with the sources as views of one buffer
  (isolates the cost of reading many separately allocated tensors); accumulate_into of
  bf16 sources into an fp32 buffer vs one contiguous fp32.add_(bf16) of the same bytes
  (and, stricter, vs an all-fp32 add_ of the same element count); l2_norm vs
  torch._foreach_norm + torch.linalg.vector_norm.
A second table times each op on a list and on a megadlm_ext.TensorTable of the same tensors
(the per-call parse of the list against the table's cached segment table): (c) 10,000
one-element fp32 tensors, (d) 10,000 fp32 tensors of 256-4096 elements. Quietest numbers:

    OMP_NUM_THREADS=1 python benchmarks/bench_ext.py --cases cd --threads 1 --repeats 101
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import megadlm_ext  # noqa: E402


def make_case(name: str, device, gen):
    if name == "a":  # 200 tensors, 256 MB of fp32 in total, uneven sizes
        total = 256 * 2**20 // 4
        w = torch.rand(200, generator=gen) + 0.5
        sizes = (w / w.sum() * total).long()
        sizes[-1] += total - int(sizes.sum())
    else:  # 20,000 tensors of 512-4096 elements
        sizes = torch.randint(512, 4097, (20_000,), generator=gen)
    return [torch.randn(int(n), generator=gen).to(device) for n in sizes.tolist()]


def timer(device):
    if device.type == "cuda":

        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
    else:

        def run(fn):
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

    return run


def measure(fns: dict, device, repeats: int) -> dict:
    """Median seconds of each callable; calls interleaved round-robin after a warm-up."""
    run = timer(device)
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            times[k].append(run(fn))
    return {k: statistics.median(v) for k, v in times.items()}


def bench_case(case: str, device, repeats: int, gen):
    ts = make_case(case, device, gen)
    n = sum(t.numel() for t in ts)
    flat = torch.empty(n, device=device)
    views = list(torch.split(flat, [t.numel() for t in ts]))
    src = torch.randn(n, generator=gen).to(device)
    dst = torch.empty_like(src)
    bf16 = [t.to(torch.bfloat16) for t in ts]
    bf16_contig = torch.cat([t.reshape(-1) for t in bf16])
    acc = torch.zeros(n, device=device)
    acc_base = torch.zeros(n, device=device)

    # the same sizes as views of one contiguous buffer: separates our per-tensor cost from
    # the memory-locality cost of many separately allocated sources
    pool = torch.cat([x.reshape(-1) for x in ts])
    pool_views = list(torch.split(pool, [x.numel() for x in ts]))
    acc32 = torch.randn(n, generator=gen).to(device)

    t = measure(
        {
            "flatten_views": lambda: megadlm_ext.flatten(pool_views, flat),
            "flatten": lambda: megadlm_ext.flatten(ts, flat),
            "copy": lambda: dst.copy_(src),
            "cat": lambda: torch.cat(ts, out=flat),
            "foreach": lambda: torch._foreach_copy_(views, ts),
            "accumulate": lambda: megadlm_ext.accumulate_into(acc, bf16),
            "add": lambda: acc_base.add_(bf16_contig),
            "add32": lambda: acc_base.add_(acc32),
            "l2_norm": lambda: megadlm_ext.l2_norm(ts),
            "foreach_norm": lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts))),
        },
        device,
        repeats,
    )
    # correctness of what was timed (cheap, outside the timings)
    assert torch.equal(flat, torch.cat(ts))
    ref_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts)))
    assert torch.allclose(megadlm_ext.l2_norm(ts), ref_norm, rtol=1e-4)

    label = {"a": "(a) 200 tensors, 256 MB", "b": "(b) 20k tensors, 512-4096 el."}[case]
    mb = n * 4 / 2**20
    gbs = lambda sec, nbytes: nbytes / sec / 1e9  # noqa: E731
    rows = [
        (
            label,
            "flatten vs dst.copy_(src) (ceiling)",
            t["flatten"],
            t["copy"],
            t["copy"] / t["flatten"],
            ">= 0.85" if device.type == "cuda" else (">= 0.9" if case == "a" else ">= 0.8"),
            gbs(t["flatten"], 2 * n * 4),
        ),
        (
            label,
            "flatten, sources = views of 1 buffer, vs copy_",
            t["flatten_views"],
            t["copy"],
            t["copy"] / t["flatten_views"],
            "",
            gbs(t["flatten_views"], 2 * n * 4),
        ),
        (label, "flatten vs torch.cat(out=)", t["flatten"], t["cat"], t["cat"] / t["flatten"], "", None),
        (
            label,
            "flatten vs torch._foreach_copy_",
            t["flatten"],
            t["foreach"],
            t["foreach"] / t["flatten"],
            ">= 3" if case == "b" and device.type == "cpu" else "",
            None,
        ),
        (
            label,
            "accumulate_into bf16->fp32 vs add_",
            t["accumulate"],
            t["add"],
            t["add"] / t["accumulate"],
            ">= 0.8" if device.type == "cpu" else "",
            gbs(t["accumulate"], n * (4 + 4 + 2)),
        ),
        (
            label,
            "accumulate_into bf16->fp32 vs fp32 add_(fp32)",
            t["accumulate"],
            t["add32"],
            t["add32"] / t["accumulate"],
            "",
            None,
        ),
        (
            label,
            "l2_norm vs _foreach_norm+vector_norm",
            t["l2_norm"],
            t["foreach_norm"],
            t["foreach_norm"] / t["l2_norm"],
            "",
            gbs(t["l2_norm"], n * 4),
        ),
    ]
    return rows, mb


TABLE_CASES = {"c": "(c) 10k one-element tensors", "d": "(d) 10k tensors, 256-4096 el."}


def bench_table_case(case: str, device, repeats: int, gen):
    """Each op on a list and on a megadlm_ext.TensorTable of it (fp32): the host's per-call
    parse of the list against the table's cached segment table. Rows: (case, op, list s,
    table s, target)."""
    n = 10_000
    sizes = [1] * n if case == "c" else torch.randint(256, 4097, (n,), generator=gen).tolist()
    ts = [torch.randn(k, generator=gen).to(device) for k in sizes]
    table = megadlm_ext.TensorTable(ts)
    flat = torch.empty(table.flat_numel, device=device)
    ops = {
        "flatten(out=)": (lambda: megadlm_ext.flatten(ts, flat), lambda: megadlm_ext.flatten(table, flat)),
        "accumulate_into": (
            lambda: megadlm_ext.accumulate_into(flat, ts),
            lambda: megadlm_ext.accumulate_into(flat, table),
        ),
        "unflatten": (lambda: megadlm_ext.unflatten(flat, ts), lambda: megadlm_ext.unflatten(flat, table)),
        "scale_": (lambda: megadlm_ext.scale_(ts, 1.0000001), lambda: megadlm_ext.scale_(table, 1.0000001)),
        "l2_norm": (lambda: megadlm_ext.l2_norm(ts), lambda: megadlm_ext.l2_norm(table)),
        "has_nonfinite": (lambda: megadlm_ext.has_nonfinite(ts), lambda: megadlm_ext.has_nonfinite(table)),
    }
    fns = {(op, kind): fn for op, pair in ops.items() for kind, fn in zip(("list", "table"), pair)}
    t = measure(fns, device, repeats)
    # equal results (cheap, outside the timings)
    assert torch.equal(megadlm_ext.l2_norm(ts), megadlm_ext.l2_norm(table))
    assert torch.equal(megadlm_ext.flatten(table, flat), torch.cat(ts))
    target = "<= 150 us and >= 5x" if case == "c" and device.type == "cpu" else ""
    return [(TABLE_CASES[case], op, t[op, "list"], t[op, "table"], target) for op in ops]


def print_table_rows(rows) -> None:
    head = ("case", "op", "list us", "table us", "list / table", "target")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for case, op, lst, tab, target in rows:
        print(f"| {case} | {op} | {lst * 1e6:.1f} | {tab * 1e6:.1f} | {lst / tab:.1f}x | {target} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--repeats", type=int, default=9, help="timed runs per op (median reported)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--cases", default="abcd", help="subset of 'abcd' (c, d: list vs TensorTable)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    info = megadlm_ext.backend_info()
    if not info["compiled"]:
        raise SystemExit(f"megadlm_ext._C is not built ({info.get('error')}): build it first (make install)")
    if device.type == "cuda" and not info["cuda"]:
        raise SystemExit("--device cuda needs a CUDA build of megadlm_ext (MEGADLM_EXT_CUDA=1)")
    gen = torch.Generator().manual_seed(0)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"megadlm_ext {info['version']} ({info.get('cpu_isa', '?')}), torch {torch.__version__}, "
        f"device {device}, threads {torch.get_num_threads()}, repeats {args.repeats} (medians), "
        f"load avg {load:.2f}"
    )
    rows = []
    for case in args.cases:
        if case in "ab":
            r, mb = bench_case(case, device, args.repeats, gen)
            rows += r
    table_rows = []
    for case in args.cases:
        if case in TABLE_CASES:
            table_rows += bench_table_case(case, device, args.repeats, gen)
    if not rows:
        print_table_rows(table_rows)
        return
    head = ("case", "op vs baseline", "ours ms", "base ms", "ratio", "target", "ours GB/s")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for case, op, ours, base, ratio, target, bw in rows:
        print(
            f"| {case} | {op} | {ours * 1e3:.2f} | {base * 1e3:.2f} | {ratio:.2f}x | {target} | "
            f"{'' if bw is None else f'{bw:.1f}'} |"
        )
    print(
        "ratio = baseline time / our time (> 1: we are faster; vs the copy ceiling: fraction of "
        "its bandwidth)"
    )
    if table_rows:
        print()
        print_table_rows(table_rows)


if __name__ == "__main__":
    main()
