"""Run a function on N gloo ranks (CPU) and collect each rank's return value.

    results = run_distributed(fn, world_size=2, args=(...))   # results[rank]

``fn(rank, world_size, *args)`` runs after ``init_process_group("gloo")``; whatever it
returns must be picklable (tensors are fine: results travel as ``torch.save`` bytes, so no
shared-memory handle outlives the worker). An exception on any rank is re-raised here with
that rank's traceback. Each call uses a fresh free port.
"""

from __future__ import annotations

import io
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # report, do not hang the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, args=(), timeout: float = 300.0):
    """Spawn ``world_size`` gloo ranks running ``fn``; return [result of rank 0, 1, ...]."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        # not daemonic, so a rank may start DataLoader workers; the finally below reaps them
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = [None] * world_size, []
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=timeout)
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=30 if not errors else 1)
            if p.is_alive():
                p.terminate()
                p.join(5)
    if errors:
        raise RuntimeError("\n".join(errors))
    # A rank that returned its result but then died (e.g. SIGABRT at interpreter exit after
    # destroy_process_group) is a failure too: teardown must be clean.
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"ranks exited uncleanly after returning their results (rank, exit code): {bad}")
    return results
