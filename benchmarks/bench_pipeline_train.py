"""Benchmark: step time of pipeline parallelism THROUGH THE TRAINER (``megadlms.pretrain.run``,
the CLI's code path) on 2 CPU gloo ranks, on the same global batch:

    OMP_NUM_THREADS=1 PYTHONPATH=python:. python benchmarks/bench_pipeline_train.py

Layouts: pp=2 with 1F1B, pp=2 interleaved (2 chunks per rank), dp=2 (pp=1), all in the
same 2-rank world, and one process (pp=1, dp=1). Each layout runs ``--rounds`` times,
round-robin, so background load hits them alike; a run's step time is the median of its
``ms_per_iter`` records (--metrics-jsonl, --log-interval 1) after ``--warmup`` iterations.
The step is the trainer's whole step: data, crop, token-count all-reduce, the pipeline
schedule (p2p of activations and grads, shape exchange per step), finish_grad_sync per
chunk, the embedding-group all-reduce of the tied embedding, the step's reduction and
AdamW. On CPU the stages share 2 cores with nothing to overlap, so the number to read is the
cost of the pipeline machinery against dp=2 on the same cores, not a speed-up.
pp-core's ``bench_pipeline.py`` measures the bubble (schedule timeline) on plain modules.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), ROOT]

from tests.dist_utils import run_distributed  # noqa: E402


def _argv(args, jsonl: str) -> list:
    return (
        f"--num-layers {args.layers} --hidden-size {args.hidden} --num-attention-heads 4 "
        f"--seq-length {args.seq} --position-embedding-type rope --normalization RMSNorm --swiglu "
        f"--attention-dropout 0 --hidden-dropout 0 --micro-batch-size {args.mbs} "
        f"--global-batch-size {args.gbs} --train-iters {args.iters} --lr 1e-3 --seed 1 --mock-data "
        f"--num-workers 0 --log-interval 1 --eval-interval {10 * args.iters} --eval-iters 0 "
        f"--metrics-jsonl {jsonl}"
    ).split()


LAYOUTS = {
    "pp2 1F1B": ["--pipeline-model-parallel-size", "2"],
    "pp2 interleaved vp2": [
        "--pipeline-model-parallel-size",
        "2",
        "--virtual-pipeline-model-parallel-size",
        "2",
    ],
    "dp2 (pp1)": [],
}


def _median_ms(jsonl: str, warmup: int) -> float:
    with open(jsonl) as f:
        recs = [r for r in map(json.loads, f) if r.get("event") == "train" and r["iteration"] > warmup]
    return statistics.median(r["ms_per_iter"] for r in recs)


def _world(rank, world, args, tmp, layouts):
    from megadlms.pretrain import run

    times = {name: [] for name in layouts}
    for rnd in range(args.rounds):
        for name in layouts:
            jsonl = os.path.join(tmp, f"{world}_{name.replace(' ', '_')}_{rnd}.jsonl")
            run(_argv(args, jsonl) + LAYOUTS.get(name, []))
            if rank == 0:
                times[name].append(_median_ms(jsonl, args.warmup))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--gbs", type=int, default=16)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_pp_train_")
    two = run_distributed(_world, 2, args=(args, tmp, list(LAYOUTS)), timeout=3600)[0]
    one = run_distributed(_world, 1, args=(args, tmp, ["one process (pp1 dp1)"]), timeout=3600)[0]
    rows = {**two, **one}
    base = statistics.median(rows["dp2 (pp1)"])
    print(
        f"\n{args.layers} layers, hidden {args.hidden}, seq {args.seq}, global batch {args.gbs} "
        f"(micro {args.mbs}), fp32, {args.rounds} rounds x {args.iters - args.warmup} timed steps"
    )
    print("\n| layout | ranks | step ms (median) | vs dp2 |")
    print("|---|---|---|---|")
    for name, ts in rows.items():
        ms = statistics.median(ts)
        ranks = 1 if name.startswith("one") else 2
        print(f"| {name} | {ranks} | {ms:.0f} | {ms / base:.2f}x |")


if __name__ == "__main__":
    main()
