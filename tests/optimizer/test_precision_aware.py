"""The precision-aware optimizer (--use-precision-aware-optimizer, --exp-avg-dtype, ...).

References: torch.optim.AdamW (all-fp32 must be it, bitwise), a plain-PyTorch AdamW written
out here whose moments are rounded to bf16 after every step (the same rounding the
optimizer claims), and the uninterrupted run for a resume. One process for the math and
the parse rules; world 2 for distributed == replicated, the checkpoint dtype and a resume
through the training loop; world 3 for dp2 -> dp3 resharding of a bf16-moment checkpoint.
"""

from __future__ import annotations

import copy
import io
import os
import shlex

import pytest
import torch

from tests.dist_utils import run_distributed

LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.999), 1e-8
DIN = 16


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(DIN, 96)
        self.norm = torch.nn.LayerNorm(96)
        self.out = torch.nn.Linear(96, DIN)

    def forward(self, x):
        return self.out(self.norm(torch.relu(self.fc1(x))))


def _base():
    torch.manual_seed(0)
    return _MLP()


def _data(step, rank=0, ws=1, rows=12):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(rows, DIN, generator=g), torch.randn(rows, DIN, generator=g)
    per = rows // ws
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _loss(model, step, rank=0, ws=1):
    x, y = _data(step, rank, ws)
    return torch.nn.functional.mse_loss(model(x).float(), y)


# ------------------------------------------------------------------ parse level
BASE = shlex.split(
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 8 --train-iters 10 --lr 1e-3 --mock-data"
)
# MegaDLMs' examples/dlm_training/dlm_pretrain_1.7b.sh "stable training" block, as written there
STABLE = shlex.split(
    "--accumulate-allreduce-grads-in-fp32 --use-precision-aware-optimizer --main-params-dtype=fp32 "
    "--main-grads-dtype=fp32 --exp-avg-dtype=fp32 --exp-avg-sq-dtype=fp32"
)
PA = ["--use-precision-aware-optimizer"]
NOFUSE = "--no-gradient-accumulation-fusion"
REFUSED = [
    (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
    (["--exp-avg-sq-dtype", "fp8"], "--exp-avg-sq-dtype fp8 needs --use-precision-aware-optimizer"),
    (PA + ["--exp-avg-dtype", "fp16", "--optimizer", "sgd"], "needs --optimizer adam, got sgd"),
    (PA + ["--main-grads-dtype", "bf16", NOFUSE], "--main-grads-dtype bf16 needs --bf16"),
    (
        PA + ["--bf16", "--main-grads-dtype", "bf16", "--accumulate-allreduce-grads-in-fp32", NOFUSE],
        "--main-grads-dtype bf16 contradicts --accumulate-allreduce-grads-in-fp32",
    ),
    (PA + ["--bf16", "--main-grads-dtype", "bf16"], "pass --no-gradient-accumulation-fusion"),
    (PA + ["--main-params-dtype", "fp16"], "--main-params-dtype fp16 needs --bf16 or --fp16"),
    (
        PA
        + ["--bf16", "--exp-avg-dtype", "bf16", "--use-torch-fsdp2", "--untie-embeddings-and-output-weights"],
        "--exp-avg-dtype bf16 is not supported with --use-torch-fsdp2",
    ),
]


def test_flags_parse_act_and_refuse_by_name():
    from megadlms.config import parse_config

    for extra in ([], ["--bf16"]):  # the stable block: accepted, all fp32 = today's optimizer
        cfg = parse_config(BASE + STABLE + extra, world_size=2)
        assert cfg.optimizer.use_precision_aware_optimizer and not cfg.optimizer.lowers_state
        assert cfg.ddp.grad_reduce_in_fp32 and cfg.optimizer.exp_avg_sq_dtype == torch.float32
    # MegaDLMs' moment choices (fp32/fp16/fp8) and Megatron-LM's bf16 all parse; bf16 main grads
    # keep the DDP grad buffer bf16 (Megatron: no fp32 accumulation then).
    for dt, want in (("fp16", torch.float16), ("fp8", torch.uint8), ("bf16", torch.bfloat16)):
        argv = PA + ["--bf16", "--exp-avg-dtype", dt, "--exp-avg-sq-dtype", dt, "--main-grads-dtype", "bf16"]
        cfg = parse_config(BASE + argv + ["--no-gradient-accumulation-fusion"], world_size=2)
        assert cfg.optimizer.exp_avg_dtype == cfg.optimizer.exp_avg_sq_dtype == want
        assert cfg.optimizer.main_grads_dtype == torch.bfloat16 and not cfg.ddp.grad_reduce_in_fp32
    for argv, text in REFUSED:
        with pytest.raises(ValueError) as err:
            parse_config(BASE + argv, world_size=2)
        lines = [ln for ln in str(err.value).splitlines() if ln.startswith("  - ")]
        assert len(lines) == 1 and text in lines[0], (argv, str(err.value))
    from megadlms.config import build_parser

    with pytest.raises(SystemExit):  # Megatron's choices: main params fp32 / fp16 only
        build_parser().parse_args(BASE + PA + ["--main-params-dtype", "bf16"])


# ------------------------------------------------------------------ one process: the math
def _ref_adamw_rounded(params, grads_per_step, dtype):
    """Textbook AdamW (decoupled decay, bias correction) in fp32, moments stored in ``dtype``
    after every step (round to nearest even), the update taken from the unrounded moments."""
    params = [p.detach().clone() for p in params]
    m = [torch.zeros_like(p, dtype=dtype) for p in params]
    v = [torch.zeros_like(p, dtype=dtype) for p in params]
    b1, b2 = BETAS
    for t, grads in enumerate(grads_per_step, start=1):
        for i, (p, g) in enumerate(zip(params, grads)):
            mi = b1 * m[i].float() + (1 - b1) * g
            vi = b2 * v[i].float() + (1 - b2) * g * g
            p.mul_(1 - LR * WD)
            p.sub_(LR / (1 - b1**t) * mi / (vi.sqrt() / (1 - b2**t) ** 0.5 + EPS))
            m[i], v[i] = mi.to(dtype), vi.to(dtype)
    return params, m, v


def _grads(steps, shapes):
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(s, generator=g) * 1e-3 for s in shapes] for _ in range(steps)]


def _run_pa(dtype, grads_per_step, params):
    from megadlms.optimizer import PrecisionAwareAdamW

    ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = PrecisionAwareAdamW(
        ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype
    )
    for grads in grads_per_step:
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
    return ps, opt


def test_moment_dtypes_against_references():
    torch.manual_seed(0)
    params = [torch.randn(64, 32), torch.randn(32)]
    grads = _grads(6, [p.shape for p in params])
    # all fp32: bitwise torch.optim.AdamW
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    topt = torch.optim.AdamW(ref, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for gs in grads:
        for p, g in zip(ref, gs):
            p.grad = g.clone()
        topt.step()
    ps, opt = _run_pa(torch.float32, grads, params)
    assert all(torch.equal(a, b) for a, b in zip(ps, ref))
    assert all(torch.equal(opt.state[p]["exp_avg_sq"], topt.state[q]["exp_avg_sq"]) for p, q in zip(ps, ref))
    # bf16 moments: stored bf16, == the rounded textbook reference (its fp32 ops differ in order
    # from torch's, so a last-bit fp32 difference may flip a rounding: one bf16 ulp at most)
    ps, opt = _run_pa(torch.bfloat16, grads, params)
    rp, rm, rv = _ref_adamw_rounded(params, grads, torch.bfloat16)
    for p, a, m, v in zip(ps, rp, rm, rv):
        st = opt.state[p]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
        torch.testing.assert_close(st["exp_avg"].float(), m.float(), rtol=2**-7, atol=0)
        torch.testing.assert_close(st["exp_avg_sq"].float(), v.float(), rtol=2**-7, atol=0)
        torch.testing.assert_close(p.detach(), a, rtol=1e-5, atol=1e-6)
    # rounding makes a difference at all (the reference with fp32 state is further away)
    fp32_ref, _, _ = _ref_adamw_rounded(params, grads, torch.float32)
    assert not torch.equal(ps[0].detach(), fp32_ref[0])
    # fp16 / fp8: scaled payloads (power-of-two scale), values close to the fp32 moments;
    # unscaled fp16 would flush exp_avg_sq (~1e-7 here) to subnormals/zero
    fp32_ps, fp32_opt = _run_pa(torch.float32, grads, params)
    for dtype, storage, rtol in (
        (torch.float16, torch.float16, 2e-3),
        (torch.uint8, torch.float8_e4m3fn, 0.25),
    ):
        ps, opt = _run_pa(dtype, grads, params)
        p0, q0 = ps[0], fp32_ps[0]
        assert opt.state[p0]["exp_avg_sq"].dtype == storage
        scale = float(opt.scales[p0]["exp_avg_sq"])
        assert scale == 2.0 ** round(torch.log2(torch.tensor(scale)).item())
        v = opt.get_fp32(p0, "exp_avg_sq")
        vref = fp32_opt.state[q0]["exp_avg_sq"]
        big = vref > vref.max() * 1e-2  # fp8: 3 mantissa bits, compounded over 6 steps
        torch.testing.assert_close(v[big], vref[big], rtol=rtol, atol=0)


def test_checkpoint_round_trip_and_cross_dtype_load():
    """state_dict -> load_state_dict continues bitwise (bf16, fp16 scaled); bf16 moments are
    stored bf16; an fp32 checkpoint loads into bf16 moments rounded, and back."""
    from megadlms.optimizer import OptimizerConfig, get_optimizer

    def make(dt):
        model = _base()
        cfg = OptimizerConfig(
            lr=LR,
            weight_decay=WD,
            use_precision_aware_optimizer=dt != "fp32",
            exp_avg_dtype=dt,
            exp_avg_sq_dtype=dt,
        )
        return model, get_optimizer(cfg, model)

    def steps(model, opt, rng):
        for s in rng:
            opt.zero_grad()
            _loss(model, s).backward()
            assert opt.step()[0]

    for dt in ("bf16", "fp16"):
        m1, o1 = make(dt)
        steps(m1, o1, range(3))
        sd = copy.deepcopy(o1.state_dict())  # state_dict() shares the live tensors (as torch's)
        saved = {n: p.detach().clone() for n, p in m1.named_parameters()}
        want = torch.bfloat16 if dt == "bf16" else torch.float32  # fp16: its fp32 values (Megatron)
        assert all(st["exp_avg"].dtype == want for st in sd["state"].values())
        steps(m1, o1, range(3, 6))
        m2, o2 = make(dt)
        with torch.no_grad():
            for n, p in m2.named_parameters():
                p.copy_(saved[n])
        o2.load_state_dict(sd)
        steps(m2, o2, range(3, 6))
        assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters())), dt
    # cross-dtype: Megatron's behaviour (the saved values rounded into the flags' dtypes)
    m32, o32 = make("fp32")
    steps(m32, o32, range(2))
    mbf, obf = make("bf16")
    obf.load_state_dict(o32.state_dict())
    for fqn, st in obf.state_dict()["state"].items():
        src = o32.state_dict()["state"][fqn]["exp_avg_sq"]
        assert torch.equal(st["exp_avg_sq"], src.to(torch.bfloat16))
    o32b = make("fp32")[1]
    o32b.load_state_dict(obf.state_dict())  # bf16 -> fp32: exact
    assert all(st["exp_avg"].dtype == torch.float32 for st in o32b.state_dict()["state"].values())
    assert o32b.state_bytes() == 2 * obf.state_bytes()


# ------------------------------------------------------------------ world 2 and 3
def _build(kind, *, main_grads_bf16, exp="bf16", main_params="fp32"):
    from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig, Float16Module
    from megadlms.optimizer import OptimizerConfig, get_optimizer

    dist = kind == "dist"
    cfg = OptimizerConfig(
        lr=LR,
        weight_decay=WD,
        clip_grad=0.0,  # the norm sums in another order under sharding: last-bit clip factors
        bf16=True,
        use_distributed_optimizer=dist,
        use_precision_aware_optimizer=True,
        main_grads_dtype="bf16" if main_grads_bf16 else "fp32",
        main_params_dtype=main_params,
        exp_avg_dtype=exp,
        exp_avg_sq_dtype=exp,
    )
    ddp_cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=dist, grad_reduce_in_fp32=not main_grads_bf16, bucket_size=3000
    )
    model = DistributedDataParallel(Float16Module(_base(), dtype=torch.bfloat16), ddp_cfg)
    return model, get_optimizer(cfg, model)


def _train(model, opt, rank, ws, rng):
    for s in rng:
        opt.zero_grad()
        _loss(model, s, rank, ws).backward()
        model.finish_grad_sync()
        assert opt.step()[0]


TINY = shlex.split(
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 8 --train-iters 6 --lr 2e-3 --lr-warmup-iters 2 --seed 7 --mock-data "
    "--num-workers 0 --log-interval 1 --eval-interval 100 --eval-iters 0 --untie-embeddings-and-output-weights "
    "--bf16 --use-distributed-optimizer --use-precision-aware-optimizer --exp-avg-dtype bf16 "
    "--exp-avg-sq-dtype bf16 --main-grads-dtype bf16 --no-gradient-accumulation-fusion"
)


def _state_bytes_io(sd) -> bytes:
    buf = io.BytesIO()  # bytes, not tensors: shared-memory tensors die with the worker
    torch.save(sd, buf)
    return buf.getvalue()


def _ckpt_state_dtypes(ckpt):
    from megadlms.checkpoint.paths import read_common
    from megadlms.checkpoint.read import tensor_shapes

    shapes = tensor_shapes(ckpt, read_common(ckpt))
    return sorted({str(dt) for k, (_, dt) in shapes.items() if k.startswith("optimizer/state/")})


def _world2(rank, ws, tmp):
    from megadlms.checkpoint import save_checkpoint
    from megadlms.distributed import unwrap_model
    from megadlms.pretrain import run

    out, models = {}, {}
    for kind in ("replica", "dist"):
        model, opt = _build(kind, main_grads_bf16=True)
        _train(model, opt, rank, ws, range(4))
        models[kind] = (unwrap_model(model).state_dict(), opt.state_dict())
        out[f"{kind}_bytes"] = opt.state_bytes()
    out["grad_dtypes"] = sorted({str(p.main_grad.dtype) for p in unwrap_model(model).parameters()})
    ckpt = save_checkpoint(os.path.join(tmp, "mlp"), 4, model=model, optimizer=opt)
    out["mlp_ckpt"], out["mlp_ckpt_dtypes"] = ckpt, _ckpt_state_dtypes(ckpt)
    (pa, sa), (pb, sb) = models["replica"], models["dist"]
    out["same_params"] = all(torch.equal(pa[k], pb[k]) for k in pa)
    out["same_state"] = all(
        torch.equal(sa["state"][f][k], sb["state"][f][k]) for f in sa["state"] for k in sa["state"][f]
    )
    out["state_dtypes"] = sorted({str(v.dtype) for st in sb["state"].values() for v in st.values()})
    out["state"] = _state_bytes_io(sb) if rank == 0 else None
    # fp16 main params (kept scaled in the optimizer state): distributed == replicated too
    fp16_main = {}
    for kind in ("replica", "dist"):
        model, opt = _build(kind, main_grads_bf16=False, exp="fp16", main_params="fp16")
        _train(model, opt, rank, ws, range(3))
        fp16_main[kind] = unwrap_model(model).state_dict()
    out["fp16_main_same"] = all(torch.equal(fp16_main["replica"][k], fp16_main["dist"][k]) for k in pa)
    # the training loop (dropout 0.1): 6 straight == 3 + resume 3, bitwise (tools: 20 = 10 + 10)
    save = os.path.join(tmp, "run")
    straight = run(TINY)
    part = run(TINY + ["--save", save, "--save-interval", "100", "--exit-interval", "3"])
    resume = run(TINY + ["--load", save])
    out["straight"] = [straight.losses[i] for i in range(1, 7)] + [
        straight.grad_norms[i] for i in range(1, 7)
    ]
    out["resumed"] = (
        [part.losses[i] for i in range(1, 4)]
        + [resume.losses[i] for i in range(4, 7)]
        + [part.grad_norms[i] for i in range(1, 4)]
        + [resume.grad_norms[i] for i in range(4, 7)]
    )
    out["run_ckpt_dtypes"] = _ckpt_state_dtypes(part.last_checkpoint)
    return out


def _world3(rank, ws, ckpt):
    """Load the dp2 distributed-optimizer checkpoint into dp3 distributed and replicated
    optimizers through the Checkpointer's loader and re-export the state."""
    from megadlms.checkpoint import load_optimizer_state

    out = {}
    for kind in ("dist", "replica"):
        model, opt = _build(kind, main_grads_bf16=True)
        load_optimizer_state(ckpt, opt, model)
        sd = opt.state_dict()  # collective under the distributed optimizer: every rank
        out[kind] = _state_bytes_io(sd) if rank == 0 else None
        _train(model, opt, rank, ws, range(4, 5))  # and it steps on
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("paopt")
    return run_distributed(_world2, 2, (str(tmp),), timeout=600)


def test_distributed_equals_replicated_and_resume_is_bitwise(world2):
    for r in world2:
        assert r["same_params"] and r["same_state"], r
        assert r["grad_dtypes"] == ["torch.bfloat16"]  # main grads bf16: the DDP buffer
        assert r["state_dtypes"] == r["mlp_ckpt_dtypes"] == ["torch.bfloat16", "torch.float32"]
        assert r["run_ckpt_dtypes"] == ["torch.bfloat16", "torch.float32"]  # moments bf16, fp32_param
        assert r["replica_bytes"] > r["dist_bytes"] and r["fp16_main_same"]
        assert r["straight"] == r["resumed"]


def test_reshard_dp2_to_dp3_keeps_bf16_moments(world2):
    saved = torch.load(io.BytesIO(world2[0]["state"]), weights_only=False)
    res = run_distributed(_world3, 3, (world2[0]["mlp_ckpt"],), timeout=300)
    for kind in ("dist", "replica"):
        got = torch.load(io.BytesIO(res[0][kind]), weights_only=False)
        assert got["step"] == saved["step"] == 4
        for fqn, st in saved["state"].items():
            for k, v in st.items():
                assert got["state"][fqn][k].dtype == v.dtype and torch.equal(got["state"][fqn][k], v), (
                    kind,
                    fqn,
                    k,
                )
