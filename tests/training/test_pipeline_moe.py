"""Pipeline and expert parallelism together through the real CLI (gloo CPU ranks): the tiny
MoE DLM of test_expert_parallel.py (tied embeddings, 4 experts top-2 with capacity dropping,
aux + z loss, fp32, dropout 0) at (pp=2 x dp=2, ep=2) with the distributed optimizer and
overlapped reduce trains the same 5 steps as one process (loss, aux loss, grad norm); its
checkpoint resumes on one process and at (pp=1, dp=4, ep=2), continuing the uninterrupted curve.
"""

from __future__ import annotations

import os

from tests.dist_utils import run_distributed
from tests.training.test_expert_parallel import DISTOPT, EP2, OVERLAP, _assert_curve, _run

PP2 = ["--pipeline-model-parallel-size", "2"]


def _four(rank, world, tmp):
    ckpt = os.path.join(tmp, "pp2ep2")
    part = ["--save", ckpt, "--save-interval", "100", "--exit-interval", "3"]
    runs = {
        "pp2_ep2": PP2 + EP2 + DISTOPT + OVERLAP,
        "pp2_ep2_part": PP2 + EP2 + DISTOPT + part,
        "to_pp1_ep2_dp4": EP2 + DISTOPT + ["--load", ckpt],
    }
    return {name: _run(tmp, name, argv) for name, argv in runs.items()}


def _one(rank, world, tmp):
    return {
        "single": _run(tmp, "single", []),
        "to_single": _run(tmp, "to_single", ["--load", os.path.join(tmp, "pp2ep2")]),
    }


def test_pipeline_with_expert_parallelism_matches_one_process(tmp_path):
    tmp = str(tmp_path)
    four = run_distributed(_four, 4, args=(tmp,), timeout=1200)
    one = run_distributed(_one, 1, args=(tmp,), timeout=600)[0]
    _assert_curve(four[0]["pp2_ep2"], one["single"])
    assert all(r["pp2_ep2"][0].losses == four[0]["pp2_ep2"][0].losses for r in four)
    assert four[0]["pp2_ep2_part"][0].iteration == 3
    _assert_curve(four[0]["to_pp1_ep2_dp4"], one["single"], its=range(4, 6))
    _assert_curve(one["to_single"], one["single"], its=range(4, 6))
