"""Checkpoint throughput and the training-loop stall per save (single process, CPU).

    python benchmarks/bench_checkpoint.py [--size-gb 1.0] [--dir /tmp/bench_ckpt] [--repeats 3]

1. Save / load GB/s of a ~size-gb state (fp32 tensors shaped like a transformer's weights
   and Adam moments) with megadlms' checkpointing (torch_dist: DCP files + the size/CRC-32
   manifest; load = verification + read) vs plain ``torch.save`` / ``torch.load`` of the same
   tensors in the same directory. Every file written is fsynced inside the timing (DCP's
   writer does, and the plain torch.save here does too); reads come from the page cache
   when the file was just written (said in the table).
2. The stall per save of a training loop (time spent inside the save call) synchronously vs
   with ``--async-save`` (DCP staging only; the write continues in the background), and how
   long the background write took.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import time

import torch
import torch.distributed as dist


def _state(size_gb: float) -> dict:
    """fp32 tensors of 16 MiB (4M elements) adding up to size_gb."""
    n = max(1, int(size_gb * 2**30 / (4 * 2**22)))
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(2048, 2048, generator=g) for i in range(n)}


class _Module(torch.nn.Module):
    def __init__(self, tensors: dict) -> None:
        super().__init__()
        for k, v in tensors.items():
            self.register_buffer(k.replace(".", "_"), v)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _torch_save_fsynced(tensors: dict, path: str) -> None:
    with open(path, "wb") as f:  # fsynced like DCP's writer (sync_files) and our common.json
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())


def _init_world() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")


def throughput(tensors: dict, root: str, repeats: int) -> dict:
    from megadlms import checkpoint as ck

    module = _Module(tensors)
    gb = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9
    out = {k: [] for k in ("torch.save", "torch.load", "megadlms save", "megadlms load")}
    for r in range(repeats):
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        plain = os.path.join(root, "plain.pt")
        out["torch.save"].append(_timed(lambda p=plain: _torch_save_fsynced(tensors, p)))
        out["torch.load"].append(_timed(lambda p=plain: torch.load(p, weights_only=True)))
        os.remove(plain)
        out["megadlms save"].append(_timed(lambda i=r + 1: ck.save_checkpoint(root, i, model=module)))
        target = _Module({k: torch.empty_like(v) for k, v in tensors.items()})
        path = ck.checkpoint_dir(root, r + 1)
        load = lambda p=path, m=target: ck.load_checkpoint(p, model=m, load_rng=False)
        out["megadlms load"].append(_timed(load))
    return {k: gb / statistics.median(v) for k, v in out.items()}, gb


def stall(tensors: dict, root: str, repeats: int) -> dict:
    """Seconds inside the save call: synchronous vs asynchronous (and the background write)."""
    from megadlms import checkpoint as ck
    from megadlms.checkpoint.async_save import background_group

    module = _Module(tensors)
    group = background_group(True)
    res = {"sync": [], "async": [], "async background": []}
    for r in range(repeats):
        shutil.rmtree(root, ignore_errors=True)
        res["sync"].append(_timed(lambda i=2 * r + 1: ck.save_checkpoint(root, i, model=module)))
        t0 = time.perf_counter()
        pending = ck.save_checkpoint(root, 2 * r + 2, model=module, async_group=group)
        res["async"].append(time.perf_counter() - t0)
        pending.wait()
        res["async background"].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in res.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--dir", default="/tmp/bench_ckpt")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    _init_world()
    tensors = _state(a.size_gb)
    rates, gb = throughput(tensors, a.dir, a.repeats)
    print(f"state: {len(tensors)} fp32 tensors, {gb:.2f} GB; dir {a.dir}; median of {a.repeats}")
    print("| operation | GB/s |\n|---|---|")
    for k, v in rates.items():
        note = " (page cache: file just written)" if "load" in k else " (incl. fsync)"
        print(f"| {k}{note} | {v:.2f} |")
    s = stall(tensors, a.dir, a.repeats)
    print("\n| save mode | training-loop stall per save (s) |\n|---|---|")
    print(f"| synchronous (write + manifest + rename) | {s['sync']:.2f} |")
    print(f"| --async-save (staging copy only) | {s['async']:.2f} |")
    print(f"| --async-save, background write until complete | {s['async background']:.2f} |")
    shutil.rmtree(a.dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
