"""FSDP2 composed with tensor (and sequence) parallelism, and hybrid sharding, end to end
through ``megadlms.pretrain.run`` on gloo CPU ranks.

The independent reference is the one-process run (the plain model, no collectives): the same
global batch gives the same loss curve and grad norm (fp32, dropout 0, within 1e-5) under
FSDP2 at (dp2 x tp2) with --sequence-parallel (iterations 1-3) and without (4-5), under HSDP
(2 replicas x 2 shards, iteration 4) and DDP. The runs chain through checkpoints, so the same
curves check resharding: FSDP2 tp2 x dp2 -> DDP tp1 dp4 / HSDP dp4 / one process, DDP tp1 ->
FSDP2 tp2, HSDP -> FSDP2 dp4 / one process. Per-rank
model and optimizer state are measured from the local shards against DDP's. One pooled
4-rank job and one 1-rank job do all of it.
"""

from __future__ import annotations

import os

import pytest

from tests.dist_utils import run_distributed
from tests.training.test_tensor_parallel import REL, TINY, TP1, TP2

FSDP = ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"]
SP = ["--sequence-parallel"]
HSDP = FSDP + ["--num-distributed-optimizer-instances", "2"]
RUN = TINY + ["--eval-iters", "0"]  # the curves are the check: no evaluation passes


def _local_bytes(tensors) -> int:
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local if t.dim() > 0)


def _run_measured(argv):
    """Run, and return the result with this rank's bytes of parameters (all, and those split
    over TP) and of optimizer state; under HSDP also the params norm and the norm of the
    gathered full parameters."""
    import torch

    from megadlms.distributed import unwrap_model
    from megadlms.parallel.sharding import sharding_of
    from megadlms.pretrain import run
    from megadlms.training import train
    from megadlms.training.validation import params_norm

    real, seen = train.train_step, {}

    def spy(model, optimizer, *a, **k):
        seen["model"], seen["optimizer"] = model, optimizer
        return real(model, optimizer, *a, **k)

    train.train_step = spy
    try:
        res = run(RUN + list(argv))
    finally:
        train.train_step = real
    params = list(unwrap_model(seen["model"]).parameters())
    states = [t for st in seen["optimizer"].inner.state.values() for t in st.values()]
    out = {
        "params": _local_bytes(params),
        "tp_split": _local_bytes(p for p in params if sharding_of(p).tp_dim is not None),
        "optimizer": _local_bytes(states),
    }
    if "--num-distributed-optimizer-instances" in argv:  # HSDP: replicas must count once
        out["params_norm"] = params_norm(seen["model"], torch.device("cpu"), seen["model"].parallel)
        out["full_norm"] = sum(p.full_tensor().double().square().sum().item() for p in params) ** 0.5
    return res, out


def _four_rank_world(rank, world, tmp):
    from megadlms.pretrain import run

    def ckpt(name, exit_at=3):
        return ["--save", os.path.join(tmp, name), "--save-interval", "100", "--exit-interval", str(exit_at)]

    def load(name):
        return ["--load", os.path.join(tmp, name)]

    out = {}
    out["fsdp_tp2_sp"], out["bytes_fsdp_tp2"] = _run_measured(TP2 + FSDP + SP + ckpt("f"))
    out["f_to_ddp"] = run(RUN + TP1 + load("f"))
    # resumes from f for one iteration and writes it (iteration 4) under h
    out["f_to_hsdp"], out["bytes_hsdp"] = _run_measured(TP1 + HSDP + load("f") + ckpt("h", exit_at=4))
    out["h_to_fsdp_dp4"] = run(RUN + TP1 + FSDP + load("h"))
    out["ddp"], out["bytes_ddp"] = _run_measured(TP1 + ckpt("d"))
    out["d_to_fsdp_tp2"] = run(RUN + TP2 + FSDP + load("d"))
    return out


def _one_process_world(rank, world, tmp):
    from megadlms.pretrain import run

    return {
        "single": run(RUN + TP1),
        "f_to_single": run(RUN + TP1 + ["--load", os.path.join(tmp, "f")]),
        "h_to_single": run(RUN + TP1 + ["--load", os.path.join(tmp, "h")]),
    }


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("fsdp2tp"))
    four = run_distributed(_four_rank_world, 4, args=(tmp,), timeout=900)
    one = run_distributed(_one_process_world, 1, args=(tmp,), timeout=300)[0]
    return four, one


def _assert_curve(res, ref, its):
    got, want = [res.losses[i] for i in its], [ref.losses[i] for i in its]
    assert got == pytest.approx(want, rel=REL), (got, want)
    for i in its:
        assert res.grad_norms[i] == pytest.approx(ref.grad_norms[i], rel=1e-4), i


@pytest.mark.slow
def test_curves_and_resharding_match_one_process(worlds):
    four, one = worlds
    ref, first, resumed = one["single"], range(1, 4), range(4, 6)
    for name in ("fsdp_tp2_sp", "ddp"):  # iterations 1-3, each then saved
        assert four[0][name].iteration == 3, name
        _assert_curve(four[0][name], ref, first)
    for name in ("f_to_ddp", "d_to_fsdp_tp2"):
        _assert_curve(four[0][name], ref, resumed)
    assert four[0]["f_to_hsdp"].iteration == 4
    _assert_curve(four[0]["f_to_hsdp"], ref, [4])
    _assert_curve(four[0]["h_to_fsdp_dp4"], ref, [5])
    _assert_curve(one["f_to_single"], ref, resumed)
    _assert_curve(one["h_to_single"], ref, [5])
    for r in range(1, 4):  # the loss is reduced once, so every rank reports the same curve
        assert four[r]["fsdp_tp2_sp"].losses == four[0]["fsdp_tp2_sp"].losses


@pytest.mark.slow
def test_state_per_rank_is_ddps_over_the_shards(worlds):
    four, _ = worlds
    for r in range(4):
        ddp, fsdp, hsdp = four[r]["bytes_ddp"], four[r]["bytes_fsdp_tp2"], four[r]["bytes_hsdp"]
        assert ddp["optimizer"] == 2 * ddp["params"]  # Adam: exp_avg, exp_avg_sq
        # TP-split parameters: / (dp x tp); TP-replicated ones (norms, row-parallel biases): / dp.
        # Every dim 0 here divides evenly, so the shards are exact fractions.
        replicated = ddp["params"] - ddp["tp_split"]
        assert 0 < replicated < ddp["params"] / 50
        assert (
            fsdp["tp_split"] * 4 == ddp["tp_split"] and fsdp["params"] * 4 == ddp["tp_split"] + 2 * replicated
        )
        assert fsdp["optimizer"] == 2 * fsdp["params"]
        for key in ("params", "optimizer"):  # HSDP: 2 shards x 2 replicas
            assert hsdp[key] * 2 == ddp[key], (r, key)
        # the params norm counts each HSDP replica once (sharding.counts_once)
        assert hsdp["params_norm"] == pytest.approx(hsdp["full_norm"], rel=1e-12)
