"""Cost of the failure channel (training/failures.py) when nothing fails: the round trip of
the watcher's poll (one ``check`` on a real TCPStore, server in this process), a guarded
phase's entry and exit with and without a channel, and the process CPU time while a watcher
polls for 10 s with nothing to find.

    PYTHONPATH=python:. OMP_NUM_THREADS=1 python benchmarks/bench_failures.py
"""

from __future__ import annotations

import datetime
import socket
import time

import torch.distributed as dist

from megadlms.training.failures import FailureChannel, guarded


def _per_call(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def bench(watch_seconds: float = 10.0) -> None:
    """Print the three costs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    timeout = datetime.timedelta(seconds=30)
    server = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timeout, wait_for_workers=False)
    store = dist.PrefixStore(
        "megadlms/rank_failure/", dist.TCPStore("127.0.0.1", port, 2, False, timeout=timeout)
    )
    channel = FailureChannel(store, 1, 2)
    check = _per_call(lambda: store.check(["failure"]), 2000)
    print(f"watcher poll (store.check): {check * 1e6:.1f} us, {check / channel.poll * 100:.3f}% of one core")

    def enter(ch):
        with guarded(ch, "logging"):
            pass

    with_ch, without = _per_call(lambda: enter(channel), 200_000), _per_call(lambda: enter(None), 200_000)
    print(f"guarded phase: {with_ch * 1e6:.2f} us with a channel, {without * 1e6:.2f} us without")
    channel.start()
    t0 = time.process_time()
    time.sleep(watch_seconds)
    cpu = time.process_time() - t0
    channel.close()
    print(
        f"process CPU while the watcher (and the store server) ran {watch_seconds:.0f} s: {cpu * 1e3:.1f} ms"
    )
    del server


if __name__ == "__main__":
    bench()
