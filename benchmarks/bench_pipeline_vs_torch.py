"""Benchmark: our pp=2 1F1B against torch.distributed.pipelining's (``PipelineStage`` +
``Schedule1F1B``) on the same tiny GPT layers split in two, gloo CPU ranks.

    OMP_NUM_THREADS=1 PYTHONPATH=python:. python benchmarks/bench_pipeline_vs_torch.py

Three configurations run round-robin in one 2-rank world (the order rotates every round, so
background load hits them alike), after warm-up rounds:

* ``ours``: ``forward_backward_pipelining`` with ``tensor_shape`` (known shapes: one p2p batch
  per call, no shape headers; Megatron's ``--variable-seq-lengths`` off);
* ``ours-headers``: the same schedule sizing receives from shape headers (two batches per
  call: the variable-length path, and the only path before issue 44);
* ``torch``: ``Schedule1F1B(PipelineStage(...), scale_grads=False)``, the batch split by torch.

Step time of a round = the slower rank's (each rank: barrier, then the step); the ratio is the
median over rounds of the same-round ratio to torch. Bubble of a rank = 1 - compute / step,
compute = forwards + backwards (+ the last stage's loss), mean over the two ranks. Phases per
step (medians, mean over ranks): compute, p2p (posting and waiting on the batched sends and
receives), other (schedule bookkeeping, allocation) = step - compute - p2p.

:func:`run` is importable (``benchmarks/bench_vs_torch.py`` prints it with the DDP and flatten
ratios); :func:`add_args` declares its options.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), ROOT]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.dist_utils import run_distributed  # noqa: E402

CONFIGS = ("ours", "ours-headers", "torch")


def add_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """This benchmark's options (prefixed ``--pp-`` so a combined script can take them all)."""
    p.add_argument("--pp-layers", type=int, default=4, help="GPT layers, split evenly over 2 stages")
    p.add_argument("--pp-hidden", type=int, default=128)
    p.add_argument("--pp-vocab", type=int, default=512)
    p.add_argument("--pp-seq", type=int, default=64, help="tokens per row")
    p.add_argument("--pp-micro-batch", type=int, default=2, help="rows per micro-batch")
    p.add_argument("--pp-micro-batches", type=int, nargs="+", default=[4, 8])
    p.add_argument("--pp-rounds", type=int, default=30)
    p.add_argument("--pp-warmup", type=int, default=3)
    p.add_argument("--pp-threads", type=int, default=1, help="torch threads per rank (2 ranks)")
    return p


def _config(args):
    from megadlms.models import TransformerConfig

    return TransformerConfig(
        num_layers=args.pp_layers,
        hidden_size=args.pp_hidden,
        num_attention_heads=4,
        vocab_size=args.pp_vocab,
        seq_length=args.pp_seq,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        untie_embeddings_and_output_weights=True,
    )


def _chunk(cfg, rank: int):
    """This rank's half of the model (the same seed, so both implementations get equal weights)."""
    from megadlms.models import GPTModel
    from megadlms.pipeline import model_chunks, stage_layers

    (chunk,) = model_chunks(stage_layers(cfg.num_layers, 2)[rank], rank, 2, cfg.num_layers)
    torch.manual_seed(0)
    return GPTModel(cfg, pipeline=chunk)


class _TorchStage(torch.nn.Module):
    """The chunk with the one-positional-argument forward ``PipelineStage`` calls."""

    def __init__(self, chunk) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x):
        return self.chunk(x) if self.chunk.pipeline.pre_process else self.chunk(hidden_states=x)


class _Clock:
    """Accumulates seconds spent in wrapped callables, by phase."""

    def __init__(self) -> None:
        self.spent = {"compute": 0.0, "p2p": 0.0}

    def wrap(self, fn, phase: str):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.spent[phase] += time.perf_counter() - t0

        return timed

    def reset(self) -> dict:
        out, self.spent = self.spent, {"compute": 0.0, "p2p": 0.0}
        return out


def _ours(chunk, batch, args, pp_group, clock: _Clock, known: bool):
    from megadlms.pipeline import forward_backward_pipelining

    rows = args.pp_micro_batch
    micro = list(batch.split(rows))  # as torch's schedule splits it: dim 0, m chunks
    norm = float(batch.numel())

    def forward_step(c, i, x):
        out = chunk(micro[i]) if chunk.pipeline.pre_process else chunk(hidden_states=x)
        if not chunk.pipeline.post_process:
            return out
        loss = chunk.token_cross_entropy(out, micro[i]).sum() / norm
        return loss, loss.detach()

    shape = (rows, args.pp_seq, args.pp_hidden)
    timeline: list = []
    forward_backward_pipelining(
        [chunk],
        micro,
        forward_step,
        pp_group=pp_group,
        timeline=timeline,
        tensor_shape=(lambda i: shape) if known else None,
    )
    clock.spent["compute"] += sum(e["end"] - e["start"] for e in timeline)


def _torch_schedule(chunk, m: int, pp_group, clock: _Clock):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    norm_box = [1.0]

    def loss_fn(out, target):
        return chunk.token_cross_entropy(out, target).sum() / norm_box[0]

    stage = PipelineStage(_TorchStage(chunk), pp_group.rank, 2, torch.device("cpu"), group=pp_group.group)
    stage.forward_one_chunk = clock.wrap(stage.forward_one_chunk, "compute")  # type: ignore[method-assign]
    stage.backward_one_chunk = clock.wrap(stage.backward_one_chunk, "compute")  # type: ignore[method-assign]
    # our loss sum / N is the scaled loss: torch must not divide the grads by m again
    schedule = Schedule1F1B(stage, m, loss_fn=loss_fn, scale_grads=False)
    schedule._compute_loss = clock.wrap(schedule._compute_loss, "compute")  # type: ignore[method-assign]
    return schedule, norm_box


def _rounds(args, m: int, groups, chunks, clock: _Clock) -> dict:
    """Every configuration once per round (order rotating), after the warm-up rounds: per
    configuration a list of (step, compute, p2p) seconds on this rank."""
    ours_chunk, torch_chunk = chunks
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, args.pp_vocab, (m * args.pp_micro_batch, args.pp_seq), generator=g)
    schedule, norm_box = _torch_schedule(torch_chunk, m, groups.pp, clock)
    norm_box[0] = float(batch.numel())
    runs: dict = {c: [] for c in CONFIGS}
    for r in range(args.pp_warmup + args.pp_rounds):
        for k in range(len(CONFIGS)):
            name = CONFIGS[(r + k) % len(CONFIGS)]
            dist.barrier(group=groups.pp.group)
            clock.reset()
            t0 = time.perf_counter()
            if name == "torch":
                if groups.pp.rank == 0:
                    schedule.step(batch)
                else:
                    schedule.step(target=batch)
            else:
                _ours(ours_chunk, batch, args, groups.pp, clock, known=name == "ours")
            step = time.perf_counter() - t0
            spent = clock.reset()
            (torch_chunk if name == "torch" else ours_chunk).zero_grad(set_to_none=True)
            if r >= args.pp_warmup:
                runs[name].append((step, spent["compute"], spent["p2p"]))
    return runs


def _worker(rank, world, args):
    import torch.distributed.pipelining.schedules as torch_schedules

    from megadlms.parallel import ParallelGroups
    from megadlms.pipeline.p2p import PipelineP2P

    torch.set_num_threads(args.pp_threads)
    groups = ParallelGroups.build(pp=world)
    cfg = _config(args)
    clock = _Clock()
    chunks = (_chunk(cfg, groups.pp.rank), _chunk(cfg, groups.pp.rank))  # ours, torch's
    # p2p time of both implementations: our batches, torch's posting and waiting (module globals);
    # put back afterwards, as the pool's processes run later jobs
    saved = (PipelineP2P._batch, torch_schedules._batch_p2p, torch_schedules._wait_batch_p2p)
    PipelineP2P._batch = clock.wrap(saved[0], "p2p")  # type: ignore[method-assign]
    torch_schedules._batch_p2p = clock.wrap(saved[1], "p2p")
    torch_schedules._wait_batch_p2p = clock.wrap(saved[2], "p2p")
    try:
        return {m: _rounds(args, m, groups, chunks, clock) for m in args.pp_micro_batches}
    finally:
        PipelineP2P._batch = saved[0]  # type: ignore[method-assign]
        torch_schedules._batch_p2p, torch_schedules._wait_batch_p2p = saved[1], saved[2]


def _bubble(x) -> float:
    return 1 - x[1] / x[0]


def _compute(x) -> float:
    return x[1]


def _p2p(x) -> float:
    return x[2]


def _other(x) -> float:
    return x[0] - x[1] - x[2]


def _summary(per_rank, m: int) -> dict:
    """Medians over rounds (step: the slower rank of each round), bubbles and phases."""
    out: dict = {}
    rounds = {
        c: [max(r[m][c][i][0] for r in per_rank) for i in range(len(per_rank[0][m][c]))] for c in CONFIGS
    }
    for c in CONFIGS:
        out[f"{c}_s"] = statistics.median(rounds[c])
        # per rank: the median over rounds of each phase (other: per round, so the three add up per round)
        phases = [
            [statistics.median(f(x) for x in r[m][c]) for f in (_bubble, _compute, _p2p, _other)]
            for r in per_rank
        ]
        bubble, compute, p2p, other = (statistics.mean(p[j] for p in phases) for j in range(4))
        out[f"{c}_bubble"] = bubble
        out[f"{c}_phases_ms"] = {"compute": 1e3 * compute, "p2p": 1e3 * p2p, "other": 1e3 * other}
    for c in ("ours", "ours-headers"):
        out[f"{c}_ratio"] = statistics.median(a / b for a, b in zip(rounds[c], rounds["torch"]))
        out[f"{c}_ratio_min"] = min(a / b for a, b in zip(rounds[c], rounds["torch"]))
        out[f"{c}_ratio_max"] = max(a / b for a, b in zip(rounds[c], rounds["torch"]))
    return out


def run(args) -> dict:
    """Runs the benchmark (a 2-rank gloo world) and returns, per micro-batch count m, the median
    step seconds, the same-round ratios to torch (median, min, max), bubbles and phases of each
    configuration; plus ``cpu`` (the processor's name) and ``config`` (the model and batch)."""
    per_rank = run_distributed(_worker, 2, args=(args,), timeout=1800)
    return {
        "cpu": _cpu_name(),
        "config": (
            f"GPTModel {args.pp_layers} layers (half per stage), hidden {args.pp_hidden}, "
            f"vocab {args.pp_vocab}, "
            f"micro-batch {args.pp_micro_batch} x {args.pp_seq} tokens, fp32, gloo, "
            f"{args.pp_threads} thread(s) per rank, {args.pp_rounds} rounds"
        ),
        "results": {m: _summary(per_rank, m) for m in args.pp_micro_batches},
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def print_table(out: dict) -> None:
    """The result of :func:`run` as markdown tables."""
    print(f"{out['cpu']}, {os.cpu_count()} CPUs; {out['config']}")
    print("\n| m | config | step ms | / torch (median, min-max) | bubble | compute / p2p / other ms |")
    print("|---|---|---|---|---|---|")
    for m, r in out["results"].items():
        for c in CONFIGS:
            ratio = (
                "1"
                if c == "torch"
                else f"{r[f'{c}_ratio']:.3f} ({r[f'{c}_ratio_min']:.2f}-{r[f'{c}_ratio_max']:.2f})"
            )
            ph = r[f"{c}_phases_ms"]
            print(
                f"| {m} | {c} | {1e3 * r[f'{c}_s']:.2f} | {ratio} | {r[f'{c}_bubble']:.3f} | "
                f"{ph['compute']:.2f} / {ph['p2p']:.2f} / {ph['other']:.2f} |"
            )


def main() -> None:
    args = add_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0])).parse_args()
    print_table(run(args))


if __name__ == "__main__":
    main()
