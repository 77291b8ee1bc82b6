"""``MixedPrecisionOptimizer.sharded_state_dict`` / ``load_sharded_state_dict`` on gloo, dp 2 and 3.

Distributed optimizer (several buckets, so parameters straddle shard boundaries; dp 3 pads the
buckets) with fp32 params, bf16 params (fp32 main params saved as ``fp32_param``) and the
precision-aware AdamW with bf16 moments or with fp16 main params (``fp32_param`` decoded from
the state): (1) every rank's FlatPieces put together are the full tensors of ``state_dict()``,
bitwise and in its dtypes, each element held by exactly one rank;
(2) ``load_sharded_state_dict`` of pieces cut from a full state restores what
``load_state_dict(full)`` restores, bitwise (the state, the main and the model params, and
again after a further step). Replicated (DDP) and FSDP2 layouts at dp 2: the leaves are the local
state tensors, and the sharded load equals the full one.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

DIN, HID, LR, WD = 16, 96, 1e-2, 0.1
CASES = ("fp32", "bf16", "bf16_moments", "fp16_main")


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(DIN, HID)
        self.norm = torch.nn.LayerNorm(HID)
        self.out = torch.nn.Linear(HID, DIN)

    def forward(self, x):
        return self.out(self.norm(torch.relu(self.fc1(x))))


def _build(case, kind="dist", weights=None):
    from megadlms.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        Float16Module,
        TorchFullyShardedDataParallel,
    )
    from megadlms.optimizer import OptimizerConfig, get_optimizer

    torch.manual_seed(0)
    module = _MLP()
    if weights is not None:
        module.load_state_dict(weights)  # the model state first, then the optimizer's
    bf16 = case != "fp32"
    lowered = {}
    if case == "bf16_moments":
        lowered = dict(use_precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    if case == "fp16_main":  # the main params live in the state (fp16, scaled): fp32_param decoded
        lowered = dict(use_precision_aware_optimizer=True, main_params_dtype="fp16")
    cfg = OptimizerConfig(
        lr=LR, weight_decay=WD, clip_grad=0.0, bf16=bf16 and kind != "fsdp2", use_distributed_optimizer=kind == "dist",
        **lowered,
    )  # fmt: skip
    if kind == "fsdp2":
        model = TorchFullyShardedDataParallel(module)
    else:
        ddp = DistributedDataParallelConfig(
            use_distributed_optimizer=kind == "dist", bucket_size=1000, grad_reduce_in_fp32=bf16
        )
        model = DistributedDataParallel(Float16Module(module, dtype=torch.bfloat16) if bf16 else module, ddp)
    return model, get_optimizer(cfg, model)


def _train(model, opt, rank, ws, steps):
    for s in steps:
        opt.zero_grad()
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(12, DIN, generator=g), torch.randn(12, DIN, generator=g)
        per = 12 // ws
        out = model(x[rank * per : (rank + 1) * per])
        torch.nn.functional.mse_loss(out.float(), y[rank * per : (rank + 1) * per]).backward()
        model.finish_grad_sync()
        assert opt.step()[0]


def _weights(model):
    from megadlms.distributed import unwrap_model

    sd = unwrap_model(model).state_dict()  # waits for overlapped param gathers
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sd.items()}


def _leaf(v):
    from megadlms.common.dtensor import local_tensor
    from megadlms.optimizer import FlatPiece

    return v.tensor if isinstance(v, FlatPiece) else local_tensor(v)


def _same_tensor(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _same_state(opt_a, opt_b, model_a, model_b) -> bool:
    """Sharded states, main params and model weights of two optimizers: bitwise equal."""
    a, b = opt_a.sharded_state_dict(), opt_b.sharded_state_dict()
    same = a["step"] == b["step"] and a["param_groups"] == b["param_groups"]
    for fqn, st in a["state"].items():
        same = same and st.keys() == b["state"][fqn].keys()
        same = same and all(_same_tensor(_leaf(v), _leaf(b["state"][fqn][k])) for k, v in st.items())
    mains = zip(opt_a.layout.entries, opt_b.layout.entries)
    same = same and all(_same_tensor(_leaf(x.main.detach()), _leaf(y.main.detach())) for x, y in mains)
    wa, wb = _weights(model_a), _weights(model_b)
    return same and all(_same_tensor(wa[k], wb[k]) for k in wa)


def _same_layout(a: dict, b: dict) -> bool:
    """Two sharded state dicts' leaves: the same types, local shapes, dtypes and ranges."""

    def layout(v):
        t = _leaf(v)
        return type(v), tuple(t.shape), t.dtype, getattr(v, "start", None), getattr(v, "stop", None)

    return (
        all(
            st.keys() == b["state"][fqn].keys()
            and all(layout(v) == layout(b["state"][fqn][k]) for k, v in st.items())
            for fqn, st in a["state"].items()
        )
        and a["state"].keys() == b["state"].keys()
    )


def _reassembled(sharded: dict, full: dict) -> dict:
    """Every rank's FlatPieces put together (collective): checks against ``full``."""
    everyone = [None] * dist.get_world_size()
    mine = {f: {k: (p.start, p.stop, p.shape, p.tensor) for k, p in st.items()} for f, st in sharded.items()}
    dist.all_gather_object(everyone, mine)
    out = {"bitwise": True, "once": True, "empty": 0, "split": 0}
    for fqn, st in full.items():
        assert all(set(r[fqn]) == set(st) for r in everyone), fqn  # every rank: the same keys
        for key, ref in st.items():
            flat = torch.zeros(ref.numel(), dtype=ref.dtype)
            seen = torch.zeros(ref.numel(), dtype=torch.int32)
            for r in everyone:
                start, stop, shape, t = r[fqn][key]
                assert tuple(shape) == tuple(ref.shape) and t.numel() == stop - start, (fqn, key)
                out["bitwise"] &= t.dtype == ref.dtype
                flat[start:stop] = t
                seen[start:stop] += 1
            out["bitwise"] &= torch.equal(flat.view(ref.shape), ref)
            out["once"] &= bool((seen == 1).all())
        holders = sum(
            everyone[r][fqn]["exp_avg"][1] > everyone[r][fqn]["exp_avg"][0] for r in range(len(everyone))
        )
        out["empty"] += holders < len(everyone)
        out["split"] += holders > 1
    return out


def _cut(own: dict, full: dict, dtype=None) -> dict:
    """``full``'s state cut into ``own``'s ranges (a checkpoint reader's work), in ``dtype``."""
    from megadlms.optimizer import FlatPiece

    sd = copy.deepcopy({k: v for k, v in full.items() if k != "state"})
    sd["state"] = {}
    for fqn, st in own["state"].items():
        pieces = {}
        for key, p in st.items():
            t = full["state"][fqn][key].reshape(-1)[p.start : p.stop].clone()
            pieces[key] = FlatPiece(t if dtype is None else t.to(dtype), p.start, p.stop, p.shape)
        sd["state"][fqn] = pieces
    return sd


def _dist_case(case, rank, ws) -> dict:
    model, opt = _build(case)
    _train(model, opt, rank, ws, range(2))
    full = copy.deepcopy(opt.state_dict())
    out = _reassembled(opt.sharded_state_dict()["state"], full["state"])
    weights = copy.deepcopy(_weights(model))
    ref_model, ref_opt = _build(case, weights=weights)
    ref_opt.load_state_dict(copy.deepcopy(full))
    model_b, opt_b = _build(case, weights=weights)
    # A fresh optimizer's layout without zero-filling (values=False, as a checkpoint load asks).
    own = opt_b.sharded_state_dict(values=False)
    out["layout_only"] = _same_layout(own, opt_b.sharded_state_dict())
    # take=True, as a checkpoint load does: the pieces become the state without a copy.
    opt_b.load_sharded_state_dict(copy.deepcopy(_cut(own, full)), take=True)
    out["load"] = _same_state(ref_opt, opt_b, ref_model, model_b)
    if case == "bf16_moments":  # pieces of another floating dtype: rounded to bf16 on the way in
        model_c, opt_c = _build(case, weights=weights)
        opt_c.load_sharded_state_dict(_cut(opt_c.sharded_state_dict(), full, torch.float32))
        out["load_fp32_pieces"] = _same_state(ref_opt, opt_c, ref_model, model_c)
    _train(ref_model, ref_opt, rank, ws, [2])
    _train(model_b, opt_b, rank, ws, [2])
    out["after_step"] = _same_state(ref_opt, opt_b, ref_model, model_b)
    return out


def _local_case(kind, rank, ws) -> dict:
    """Replicated (bf16: fp32 main params) and FSDP2: the leaves are the local state tensors."""
    from megadlms.common.dtensor import local_tensor

    case = "fp32" if kind == "fsdp2" else "bf16"
    model, opt = _build(case, kind)
    _train(model, opt, rank, ws, range(2))
    sd = opt.sharded_state_dict()
    same = True
    for e in opt.layout.entries:
        st = sd["state"][e.fqn]
        for key in ("exp_avg", "exp_avg_sq"):
            ref = opt.inner.state[e.main][key]
            same &= type(st[key]) is type(ref) and _same_tensor(local_tensor(st[key]), local_tensor(ref))
        if "fp32_param" in st:
            same &= _same_tensor(st["fp32_param"], e.main.detach().view(e.param.shape))
        same &= local_tensor(st["exp_avg"]).shape == local_tensor(e.param).shape
    full = copy.deepcopy(opt.state_dict())
    weights = copy.deepcopy(_weights(model))
    ref_model, ref_opt = _build(case, kind, weights=weights)
    ref_opt.load_state_dict(copy.deepcopy(full))
    model_b, opt_b = _build(case, kind, weights=weights)
    same &= _same_layout(opt_b.sharded_state_dict(values=False), sd)
    opt_b.load_sharded_state_dict(copy.deepcopy(sd))
    return {"local": same, "load": _same_state(ref_opt, opt_b, ref_model, model_b)}


def _instances_case(rank, ws) -> dict:
    """Two distributed-optimizer instances of one rank each: replicas with equal ranges."""
    from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megadlms.optimizer import OptimizerConfig, get_optimizer
    from megadlms.parallel import ParallelGroups

    groups = ParallelGroups.build(num_distributed_optimizer_instances=2)
    torch.manual_seed(0)
    cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=True, num_distributed_optimizer_instances=2, bucket_size=1000
    )
    model = DistributedDataParallel(_MLP(), cfg, parallel=groups)
    opt = get_optimizer(
        OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=0.0, use_distributed_optimizer=True), model
    )
    _train(model, opt, rank, ws, range(2))
    full = opt.state_dict()["state"]
    sd = opt.sharded_state_dict()["state"]
    ranges = {(f, k): (p.start, p.stop) for f, st in sd.items() for k, p in st.items()}
    everyone = [None] * ws
    dist.all_gather_object(everyone, ranges)
    whole = all(r == (0, full[f][k].numel()) for (f, k), r in ranges.items())
    same = all(torch.equal(p.tensor, full[f][k].reshape(-1)) for f, st in sd.items() for k, p in st.items())
    return {"replicas": all(r == ranges for r in everyone) and whole and same}


def _world(rank, ws):
    out = {case: _dist_case(case, rank, ws) for case in CASES}
    if ws == 2:
        out.update({kind: _local_case(kind, rank, ws) for kind in ("replica", "fsdp2")})
        out["instances"] = _instances_case(rank, ws)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ws", [2, 3])
def test_sharded_state_dict_pieces_and_load(ws):
    for rank, out in enumerate(run_distributed(_world, ws)):
        for case in CASES:
            res = out[case]
            assert res["bitwise"] and res["once"], (rank, case, res)
            # the buckets put some parameter on one rank only, and split another across ranks
            assert res["empty"] > 0 and res["split"] > 0, (rank, case, res)
            assert res["load"] and res["after_step"] and res["layout_only"], (rank, case, res)
        assert out["bf16_moments"]["load_fp32_pieces"], rank
        for kind in ("replica", "fsdp2") if ws == 2 else ():
            assert out[kind]["local"] and out[kind]["load"], (rank, kind, out[kind])
        assert ws != 2 or out["instances"]["replicas"], rank
