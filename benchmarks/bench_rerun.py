"""Cost of result validation when nothing is wrong: the same tiny CPU run with
``--rerun-mode disabled`` (baseline) and ``validate_results`` with every check on, interleaved,
3 runs each after a warm-up; prints the fastest and the median of each and their ratio.

    PYTHONPATH=python:. OMP_NUM_THREADS=1 python benchmarks/bench_rerun.py
"""

from __future__ import annotations

import statistics
import time

from megadlms.pretrain import main

TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
    "--global-batch-size 8 --train-iters 60 --lr 1e-3 --mock-data --num-workers 0 --log-interval 1000 "
    "--eval-interval 1000 --eval-iters 0 --seed 3"
).split()
CHECKS = "--rerun-mode validate_results --check-for-spiky-loss --check-for-large-grads".split()


def _seconds(argv) -> float:
    t0 = time.perf_counter()
    assert main(argv) == 0
    return time.perf_counter() - t0


def bench() -> None:
    """Print the table (seconds per 60 steps)."""
    _seconds(TINY)  # warm-up: imports, first allocations
    runs = {"disabled (baseline)": [], "validate_results": []}
    for _ in range(3):
        runs["disabled (baseline)"].append(_seconds(TINY))
        runs["validate_results"].append(_seconds(TINY + CHECKS))
    base = min(runs["disabled (baseline)"])
    print(f"{'mode':<22} {'fastest s':>10} {'median s':>10} {'fastest / baseline':>20}")
    for name, t in runs.items():
        print(f"{name:<22} {min(t):>10.3f} {statistics.median(t):>10.3f} {min(t) / base:>20.3f}")


if __name__ == "__main__":
    bench()
