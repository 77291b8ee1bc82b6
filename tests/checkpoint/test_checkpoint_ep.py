"""Checkpoints across expert-parallel sizes (library level, toy MoE block of
tests/distributed/expert_toy.py with contract C's marks, gloo).

An (ep=2, dp=2) checkpoint -- replicated DDP and distributed optimizer, torch_dist and torch
formats -- saved after 2 steps loads at (ep=4, dp=4), (ep=2, dp=4), (ep=1, dp=4) and on one
process (ep=1, dp=1): the full weights and the full optimizer state come back exactly, and
one more step equals the uninterrupted run's (1e-6). Back: the (ep=4) checkpoint written
after that step loads exactly at (ep=2, dp=4) and on one process. Expert tensors are stored
under their FULL shape [E, ...] (DCP metadata), every tensor written once (the files are as
large as one process's checkpoint of the same state), and common.json records ep.
"""

from __future__ import annotations

import torch

from megadlms.parallel.sharding import sharding_of
from tests.checkpoint.payload import distcp_bytes, same_payload
from tests.dist_utils import run_distributed
from tests.distributed.expert_toy import E, ExpertToy, H, T, batch, token_losses

N = 4 * T  # tokens of the global batch
VARIANTS = (("ddp", "torch_dist"), ("distopt", "torch_dist"), ("distopt", "torch"))


def _build(groups, kind: str, perturb: bool = False):
    from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megadlms.optimizer import OptimizerConfig, get_optimizer

    distopt = kind == "distopt"
    if groups is None:
        module = ExpertToy()
        wrapper = module
    else:
        module = ExpertToy(groups.ep.group, groups.ep.rank, groups.ep.ranks)
        cfg = DistributedDataParallelConfig(use_distributed_optimizer=distopt, calculate_per_token_loss=True)
        wrapper = DistributedDataParallel(module, cfg, parallel=groups)
    opt = get_optimizer(
        OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0, use_distributed_optimizer=distopt), wrapper
    )
    if perturb:  # so that a load that does nothing is seen
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return module, wrapper, opt


def _step(wrapper, opt, step: int, groups) -> None:
    dp, rank = (groups.dp.size, groups.dp.rank) if groups is not None else (1, 0)
    n = N // dp
    x, y = batch(step, N)
    opt.zero_grad()
    rows = slice(rank * n, (rank + 1) * n)
    token_losses(wrapper(x[rows], step, rank * n), y[rows]).sum().backward()
    if groups is not None:
        wrapper.finish_grad_sync()
    assert opt.step()[0]
    if groups is not None:
        wrapper.finish_param_sync()


def _full(t, p, groups):
    import torch.distributed as dist

    if groups is None or groups.ep.size == 1 or sharding_of(p).expert_dim is None:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(groups.ep.size)]
    dist.all_gather(parts, t.detach().contiguous(), group=groups.ep.group)
    return torch.cat(parts)


def _full_state(module, opt, groups) -> dict:
    params = dict(module.named_parameters())
    out = {f"model/{n}": _full(params[n], params[n], groups) for n in sorted(params)}
    state = opt.state_dict()["state"]
    for fqn in sorted(state):
        for k in sorted(state[fqn]):
            out[f"optimizer/{fqn}/{k}"] = _full(state[fqn][k], params[fqn], groups)
    return out


def _full_params(module, groups) -> dict:
    return {n: _full(p, p, groups) for n, p in sorted(module.named_parameters())}


def _max_diff(a, b) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _exact(a, b) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _save(root, groups, wrapper, opt, iteration, fmt):
    from megadlms import checkpoint as ck

    ep_group = groups.ep.group if groups is not None and groups.ep.size > 1 else None
    return ck.save_checkpoint(
        root,
        iteration,
        model=wrapper,
        optimizer=opt,
        ckpt_format=fmt,
        layout=ck.ParallelLayout(ep_group=ep_group),
    )


def _load(ckpt, groups, wrapper, opt):
    from megadlms import checkpoint as ck

    ep_group = groups.ep.group if groups is not None and groups.ep.size > 1 else None
    return ck.load_checkpoint(ckpt, model=wrapper, optimizer=opt, layout=ck.ParallelLayout(ep_group=ep_group))


def _save_ep2_dp2(rank, world, root):
    from megadlms.parallel import ParallelGroups

    g = ParallelGroups.build(ep=2)
    out = {"saved": {}, "after": {}}
    for kind, fmt in VARIANTS:
        module, wrapper, opt = _build(g, kind)
        for s in (0, 1):
            _step(wrapper, opt, s, g)
        _save(f"{root}/{kind}_{fmt}", g, wrapper, opt, 2, fmt)
        out["saved"][kind, fmt] = _full_state(module, opt, g)
        _step(wrapper, opt, 2, g)
        out["after"][kind, fmt] = _full_params(module, g)
    return out


def _load_at_4(rank, world, root, saved, after):
    from megadlms.parallel import ParallelGroups

    layouts = {ep: ParallelGroups.build(ep=ep) for ep in (4, 2, 1)}
    out = {"loads": {}}
    for kind, fmt in VARIANTS:
        for ep, g in layouts.items():
            other = "ddp" if kind == "distopt" else "distopt"
            module, wrapper, opt = _build(g, other if ep == 4 else kind, perturb=True)
            state = _load(f"{root}/{kind}_{fmt}/iter_0000002", g, wrapper, opt)
            loaded = _full_state(module, opt, g)
            _step(wrapper, opt, 2, g)
            out["loads"][kind, fmt, ep] = {
                "exact": _exact(loaded, saved[kind, fmt]),
                "step_diff": _max_diff(_full_params(module, g), after[kind, fmt]),
                "iteration": state.iteration,
                "rng": state.rng_restored,
            }
            if ep == 4 and kind == "distopt" and fmt == "torch_dist":
                _save(f"{root}/ep4", g, wrapper, opt, 3, fmt)
                out["ep4_saved"] = _full_state(module, opt, g)
    g = layouts[2]  # and back: ep4 -> ep2
    module, wrapper, opt = _build(g, "distopt", perturb=True)
    _load(f"{root}/ep4/iter_0000003", g, wrapper, opt)
    out["back_exact"] = _exact(_full_state(module, opt, g), out["ep4_saved"])
    return out


def test_ep_checkpoint_reshards_everywhere(tmp_path):
    from megadlms import checkpoint as ck
    from megadlms.checkpoint.format import SafeFileSystemReader

    root = str(tmp_path)
    first = run_distributed(_save_ep2_dp2, world_size=2, args=(root,), timeout=300)
    saved, after = first[0]["saved"], first[0]["after"]
    assert all(_exact(saved[v], first[1]["saved"][v]) for v in VARIANTS)  # ranks agree
    second = run_distributed(_load_at_4, world_size=4, args=(root, saved, after), timeout=400)
    for res in second:
        for key, r in res["loads"].items():
            assert r["exact"], f"{key}: loaded full state differs from the saved one"
            assert r["step_diff"] <= 1e-6, (key, r["step_diff"])
            assert r["iteration"] == 2 and not r["rng"], key  # other world size: RNG not restored
        assert res["back_exact"]

    for kind, fmt in VARIANTS:  # one process, no process group
        ckpt = f"{root}/{kind}_{fmt}/iter_0000002"
        assert ck.read_common(ckpt)["parallel"] == {"tp": 1, "pp": 1, "vp": 1, "dp": 2, "world": 2, "ep": 2}
        module, wrapper, opt = _build(None, "ddp", perturb=True)
        _load(ckpt, None, wrapper, opt)
        assert _exact(_full_state(module, opt, None), saved[kind, fmt]), (kind, fmt)
        _step(wrapper, opt, 2, None)
        assert _max_diff(_full_params(module, None), after[kind, fmt]) <= 1e-6, (kind, fmt)
    module, wrapper, opt = _build(None, "ddp", perturb=True)
    _load(f"{root}/ep4/iter_0000003", None, wrapper, opt)
    assert _exact(_full_state(module, opt, None), second[0]["ep4_saved"])
    assert ck.read_common(f"{root}/ep4/iter_0000003")["parallel"]["ep"] == 4

    # full shapes in the metadata; every tensor written once
    ckpt = f"{root}/distopt_torch_dist/iter_0000002"
    md = SafeFileSystemReader(ckpt).read_metadata()
    shapes = {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
    for key in ("model/experts.weight", "optimizer/state/experts.weight/exp_avg"):
        assert shapes[key] == (E, H, H), (key, shapes[key])
    module, wrapper, opt = _build(None, "ddp")
    _load(ckpt, None, wrapper, opt)
    single = _save(f"{root}/single", None, wrapper, opt, 2, "torch_dist")
    multi, one = distcp_bytes(ckpt), distcp_bytes(single)
    full_bytes = sum(t.numel() * t.element_size() for t in saved["distopt", "torch_dist"].values())
    assert full_bytes <= one and same_payload(ckpt, single, 0.1), (multi, one, full_bytes)
