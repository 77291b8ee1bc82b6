"""``--log-straggler``: every log interval rank 0 names the slowest and fastest ranks by their
own forward/backward schedule time (training/straggler.py); one rank is slowed on purpose."""

from __future__ import annotations

import logging
import time

from megadlms.training.straggler import straggler_line
from tests.dist_utils import run_distributed

TINY = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
    "--global-batch-size 4 --train-iters 4 --lr 1e-3 --mock-data --num-workers 0 --log-interval 2 "
    "--eval-interval 100 --eval-iters 0 --log-straggler --straggler-minmax-count 1"
).split()


def _slowed_world(rank, world):
    from megadlms.diffusion.objective import ObjectiveBatch
    from megadlms.pretrain import run

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("megadlms.training")
    log.addHandler(handler)
    real = ObjectiveBatch.forward

    def slow(*a, **k):  # rank 1 is the straggler: 30 ms more per micro-batch
        if rank == 1:
            time.sleep(0.03)
        return real(*a, **k)

    ObjectiveBatch.forward = slow
    try:
        run(TINY)
    finally:
        ObjectiveBatch.forward = real
        log.removeHandler(handler)
    return [x for x in lines if x.startswith("straggler report")]


def test_straggler_report_names_the_slowed_rank():
    reports = run_distributed(_slowed_world, 2, timeout=120)
    assert reports[1] == []  # rank 0 reports
    assert [x.split(":")[0] for x in reports[0]] == [
        "straggler report at iteration 2",
        "straggler report at iteration 4",
    ]
    for line in reports[0]:
        assert "slowest: rank 1 " in line and "fastest: rank 1 " not in line, line


def test_straggler_line_orders_by_schedule_time():
    rows = [[10.0, 9.0, 4.0], [10.0, 9.0, 8.0], [10.0, 9.0, 2.0]]  # step, forward-backward, schedule ms
    line = straggler_line(6, rows, 2)
    assert "slowest: rank 1 8.0 ms (step 10.0, wait 1.0), rank 0 4.0 ms" in line
    assert "fastest: rank 2 2.0 ms (step 10.0, wait 7.0), rank 0 4.0 ms" in line
