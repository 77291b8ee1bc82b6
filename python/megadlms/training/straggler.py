"""The straggler report (``--log-straggler``, Megatron's name): every ``interval`` steps each
rank's mean step time, forward-backward time and schedule time (its own forward/backward,
before it waits for its peers' gradients) are all-gathered, and rank 0 names the slowest and
fastest ranks (``--straggler-minmax-count`` of each) by schedule time.

Where the schedule holds no collective (DDP, the distributed optimizer: the gradient
reductions are waited for after it) a slow rank's schedule time is its own; its peers' step
and forward-backward times grow as much, as they wait for it in the reduction. Under FSDP2
and pipeline parallelism the schedule waits on peers (all-gathers, stage hand-offs), so its
times converge too; the rank with the shortest wait (forward-backward minus schedule) is
then the slow one, and the report prints that wait beside each named rank.
"""

from __future__ import annotations

import logging
from typing import List

import torch
import torch.distributed as dist

_log = logging.getLogger("megadlms.training")


class StragglerReport:
    """Accumulates this rank's step timings; :meth:`after_step` reports every ``interval``
    steps (a collective: every rank calls it after every step)."""

    def __init__(self, *, enabled: bool, interval: int, minmax_count: int, device, group=None) -> None:
        self.enabled, self.interval, self.count = enabled, max(1, interval), minmax_count
        self.device, self.group = device, group
        self.sums = [0.0, 0.0, 0.0]  # step, forward-backward, schedule seconds
        self.steps = 0

    def after_step(self, iteration: int, seconds: float, times: dict) -> None:
        """Record one step (``iteration``: completed steps, this one included)."""
        if not self.enabled:
            return
        got = (seconds, times.get("forward-backward", 0.0), times.get("schedule", 0.0))
        self.sums = [a + b for a, b in zip(self.sums, got)]
        self.steps += 1
        if iteration % self.interval:
            return
        mine = torch.tensor(
            [1e3 * x / self.steps for x in self.sums], dtype=torch.float64, device=self.device
        )
        world = dist.get_world_size(self.group)
        rows = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine, group=self.group)
        self.sums, self.steps = [0.0, 0.0, 0.0], 0
        if dist.get_rank() == 0:
            _log.info(straggler_line(iteration, [r.tolist() for r in rows], self.count))


def straggler_line(iteration: int, rows: List[List[float]], count: int) -> str:
    """The report of ``rows`` (per rank: mean step, forward-backward, schedule ms)."""
    order = sorted(range(len(rows)), key=lambda r: rows[r][2])

    def named(ranks) -> str:
        return ", ".join(
            f"rank {r} {rows[r][2]:.1f} ms (step {rows[r][0]:.1f}, wait {rows[r][1] - rows[r][2]:.1f})"
            for r in ranks
        )

    return (
        f"straggler report at iteration {iteration}: forward/backward schedule per rank, "
        f"slowest: {named(order[::-1][:count])} | fastest: {named(order[:count])}"
    )
