"""OptimizerParamScheduler vs independent references (torch's own schedulers and
hand-computed Megatron values), plus state_dict round trip and validation errors."""

import math

import pytest
import torch

from megadlms.optimizer.lr_scheduler import OptimizerParamScheduler


def _opt(wd=0.1):
    p = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(2))
    return torch.optim.AdamW(
        [{"params": [p], "weight_decay": wd}, {"params": [b], "weight_decay": 0.0}], lr=1.0
    )


def _trace(sched, n, inc=1):
    out = [sched.get_lr()]
    for _ in range(n):
        out.append(sched.step(inc))
    return out


def test_warmup_then_cosine_matches_torch_cosine_annealing():
    warmup, decay = 10, 50
    s = OptimizerParamScheduler(
        _opt(),
        max_lr=1e-3,
        min_lr=1e-5,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style="cosine",
    )
    lrs = _trace(s, 60)
    for n in range(warmup + 1):  # linear warmup from 0 (Megatron: init_lr = 0)
        assert lrs[n] == pytest.approx(1e-3 * n / warmup, rel=1e-12, abs=1e-15)
    # torch's CosineAnnealingLR closed form over the decay segment is the same curve
    p = torch.nn.Parameter(torch.zeros(1))
    ref_opt = torch.optim.SGD([p], lr=1e-3)
    ref = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, T_max=decay - warmup, eta_min=1e-5)
    for n in range(warmup, decay + 1):
        assert lrs[n] == pytest.approx(ref_opt.param_groups[0]["lr"], rel=1e-9)
        ref_opt.step()
        ref.step()
    assert all(lr == 1e-5 for lr in lrs[decay + 1 :])


def test_linear_and_constant_hand_values():
    s = OptimizerParamScheduler(
        _opt(), max_lr=2.0, min_lr=0.5, lr_warmup_steps=0, lr_decay_steps=30, lr_decay_style="linear"
    )
    lrs = _trace(s, 40, inc=3)  # steps counted in samples: 3 per call
    assert lrs[0] == 2.0
    assert lrs[5] == pytest.approx(0.5 + 1.5 * (1 - 15 / 30))
    assert lrs[10] == pytest.approx(0.5)
    assert lrs[11] == 0.5
    c = OptimizerParamScheduler(
        _opt(), max_lr=3e-4, lr_warmup_steps=4, lr_decay_steps=10, lr_decay_style="constant"
    )
    assert _trace(c, 12) == pytest.approx([3e-4 * min(n, 4) / 4 for n in range(13)])


@pytest.mark.parametrize(
    "style,fn",
    [
        ("linear", lambda w: 1 - w),
        ("cosine", lambda w: 0.5 * (1 + math.cos(math.pi * w))),
        ("exponential", lambda w: 2 * 0.5**w - 1),
        ("minus_sqrt", lambda w: 1 - math.sqrt(w)),
    ],
)
def test_wsd(style, fn):
    # warmup 10, stable until 80, anneal over the last 20 of 100 (Megatron's WSD)
    s = OptimizerParamScheduler(
        _opt(),
        max_lr=1.0,
        min_lr=0.1,
        lr_warmup_steps=10,
        lr_decay_steps=100,
        lr_decay_style="WSD",
        wsd_decay_steps=20,
        lr_wsd_decay_style=style,
    )
    lrs = _trace(s, 110)
    assert lrs[5] == pytest.approx(0.5)
    assert lrs[10] == lrs[50] == lrs[80] == 1.0
    for n in (85, 90, 99, 100):
        assert lrs[n] == pytest.approx(0.1 + 0.9 * fn((n - 80) / 20), abs=1e-12)
    assert lrs[101] == 0.1


def test_writes_groups_and_keeps_no_decay_groups():
    opt = _opt(wd=0.1)
    s = OptimizerParamScheduler(
        opt, max_lr=1.0, lr_warmup_steps=2, lr_decay_steps=10, lr_decay_style="linear", weight_decay=0.05
    )
    s.step(1)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.5]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]


def test_state_dict_round_trip_and_mismatch():
    kw = dict(max_lr=1.0, min_lr=0.0, lr_warmup_steps=2, lr_decay_steps=10, lr_decay_style="cosine")
    a = OptimizerParamScheduler(_opt(), **kw)
    for _ in range(7):
        a.step(1)
    opt_b = _opt()
    b = OptimizerParamScheduler(opt_b, **kw)
    b.load_state_dict(a.state_dict())
    assert b.num_steps == 7 and opt_b.param_groups[0]["lr"] == a.get_lr()
    c = OptimizerParamScheduler(_opt(), **dict(kw, lr_decay_style="linear"))
    with pytest.raises(ValueError, match="lr_decay_style"):
        c.load_state_dict(a.state_dict())
    c.load_state_dict(a.state_dict(), override=True)
    assert c.num_steps == 7 and c.lr_decay_style == "linear"


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(lr_decay_style="exp"), "lr_decay_style"),
        (dict(lr_decay_style="WSD"), "lr_wsd_decay_iters"),
        (dict(lr_warmup_steps=20), "lr_warmup_iters"),
        (dict(min_lr=2.0), "min_lr"),
        (dict(lr_decay_style="WSD", wsd_decay_steps=5, lr_wsd_decay_style="step"), "lr_wsd_decay_style"),
    ],
)
def test_bad_settings_name_the_flag(kw, msg):
    base = dict(max_lr=1.0, lr_decay_steps=10)
    with pytest.raises(ValueError, match=msg):
        OptimizerParamScheduler(_opt(), **{**base, **kw})
