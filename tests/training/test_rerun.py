"""Result validation (``--rerun-mode validate_results``, training/rerun.py) with Megatron's
fault injection, through the real CLI on gloo ranks (docs/reliability.md, "Silent faults").

Per layout (DDP, distributed optimizer, FSDP2 on 2 ranks; tp2 x pp2 on 4), one job runs:
the clean curve (validation off), then every injection type (rate 1: the first validated
step, iteration 2, is rejected on every rank):

* transient_error: not reproduced in place -> exit 17 with a checkpoint of the untouched
  iteration 1, whose resume (validation on, nothing injected) continues on the clean curve;
* persistent_error: reproduced in place -> checkpoint + exit 16; resumed on the same node ->
  16 again; on another node ($MEGADLMS_NODE_NAME) not reproduced -> persistent, exit 17;
* correct_result: 16, then reproduced on another node -> diagnosed correct, exit 17.

One process also trains 200 iterations with every check on and nothing injected: the only
rejected step is a real spike (step 190's logits scaled by 1000, the same on the re-run),
reported as reproducible; training goes on (not fatal). ``report_stats`` re-runs every step
and reports a zero difference, on the unchanged curve.
"""

from __future__ import annotations

import logging
import os

from tests.dist_utils import run_distributed

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
    "--global-batch-size 4 --train-iters 3 --lr 2e-3 --seed 7 --mock-data --num-workers 0 "
    "--log-interval 1 --eval-interval 100 --eval-iters 0 --untie-embeddings-and-output-weights "
    "--attention-dropout 0.1 --hidden-dropout 0.1"
).split()
LAYOUTS = {
    "ddp": (2, []),
    "distopt": (2, ["--use-distributed-optimizer", "--overlap-grad-reduce"]),
    "fsdp2": (2, ["--use-torch-fsdp2", "--ckpt-format", "torch_dist"]),
    "tp2pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
}
VALIDATE = ["--rerun-mode", "validate_results"]


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _run(argv, node=None):
    """(exit code, {iteration: loss}, log lines) of one CLI run on this rank."""
    from megadlms.pretrain import run
    from megadlms.training.rerun import node_name  # noqa: F401 - the env var it reads is set below

    handler = _Lines()
    log = logging.getLogger("megadlms.training")
    log.addHandler(handler)
    if node:
        os.environ["MEGADLMS_NODE_NAME"] = node
    try:
        res = run(argv)
    finally:
        os.environ.pop("MEGADLMS_NODE_NAME", None)
        log.removeHandler(handler)
    return res.exit_code, dict(res.losses), handler.lines


def _layout_world(rank, world, extra, tmp):
    out = {"clean": _run(TINY + extra)}
    for kind in ("transient_error", "persistent_error", "correct_result"):
        ck = os.path.join(tmp, kind)
        args = TINY + extra + VALIDATE + ["--save", ck, "--save-interval", "100", "--load", ck]
        inject = ["--error-injection-rate", "1", "--error-injection-type", kind]
        out[kind] = [_run(args + inject)]
        if kind == "transient_error":  # resume without injection: must rejoin the clean curve
            out[kind].append(_run(args))
        else:
            out[kind].append(_run(args + inject))  # same node: resume again elsewhere
            out[kind].append(_run(args + inject, node="another-node"))
    return out


def _check_layout(name, tmp_path):
    world, extra = LAYOUTS[name]
    results = run_distributed(_layout_world, world, (extra, str(tmp_path)), timeout=300)
    for r, res in enumerate(results):
        code, clean, _ = res["clean"]
        assert code == 0 and sorted(clean) == [1, 2, 3]
        (code, losses, lines), (code2, resumed, _) = res["transient_error"]
        assert code == 17 and sorted(losses) == [1] and losses[1] == clean[1], (r, code, losses)
        assert any("not reproducible: possible transient error" in x for x in lines), lines
        # the checkpoint recorded nothing of the rejected step: the resume is the clean curve
        assert code2 == 0 and sorted(resumed) == [2, 3]
        if name == "fsdp2":  # resumes within fp tolerance (docs/checkpoints.md)
            assert all(abs(resumed[i] - clean[i]) <= 1e-6 * abs(clean[i]) for i in (2, 3)), (resumed, clean)
        else:
            assert resumed == {i: clean[i] for i in (2, 3)}, (r, resumed, clean)
        for kind, verdict in (
            ("persistent_error", "possible persistent error"),
            ("correct_result", "is correct"),
        ):
            (c1, _, l1), (c2, _, l2), (c3, _, l3) = res[kind]
            assert (c1, c2, c3) == (16, 16, 17), (r, kind, c1, c2, c3)
            assert any("reproducible: re-run on another node" in x for x in l1), l1
            assert any("rescheduled on the same node" in x for x in l2), l2
            assert any(verdict in x and "another-node" in x for x in l3), l3


def test_injection_ddp(tmp_path):
    _check_layout("ddp", tmp_path)


def test_injection_distributed_optimizer(tmp_path):
    _check_layout("distopt", tmp_path)


def test_injection_fsdp2(tmp_path):
    _check_layout("fsdp2", tmp_path)


def test_injection_tp2_pp2(tmp_path):
    _check_layout("tp2pp2", tmp_path)


def _long_world(rank, world):
    from megadlms.diffusion.objective import ObjectiveBatch

    checks = VALIDATE + ["--check-for-spiky-loss", "--check-for-large-grads", "--log-interval", "1000"]
    base = [a if a != "3" else "200" for a in TINY] + ["--attention-dropout", "0", "--hidden-dropout", "0"]
    real, calls = ObjectiveBatch.forward, [0]

    def spiking(self, *a, **k):  # the logits of step 190 (4 micro-batches a step), on both its runs
        calls[0] += 1
        logits = real(self, *a, **k)
        return logits * 1000 if 756 < calls[0] <= 764 else logits

    ObjectiveBatch.forward = spiking
    try:
        return _run(base + checks)
    finally:
        ObjectiveBatch.forward = real


def test_no_false_positive_and_a_real_spike_is_reproducible():
    code, losses, lines = run_distributed(_long_world, 1, timeout=300)[0]
    assert code == 0 and len(losses) == 200  # not fatal: training went on
    rejected = [x for x in lines if "result rejected" in x]
    # every check on for 200 steps: the crafted step is the only one rejected
    assert len(rejected) == 1 and "Spiky loss" in rejected[0] and "iteration 190" in rejected[0], rejected
    assert any("Spiky loss" in x and "reproducible: re-run on another node" in x for x in lines), lines


def _stats_world(rank, world):
    return _run(TINY), _run(TINY + ["--rerun-mode", "report_stats"])


def test_report_stats_reruns_every_step_without_changing_the_curve():
    (code, plain, _), (code2, stats, lines) = run_distributed(_stats_world, 2, timeout=120)[0]
    assert code == code2 == 0 and stats == plain  # the re-runs replay RNG: the same curve bitwise
    reports = [x for x in lines if "determinism stats" in x]
    assert len(reports) == 3 and all(x.endswith("grad norm)] 0") for x in reports), reports
