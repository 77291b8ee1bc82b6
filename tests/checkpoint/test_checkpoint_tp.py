"""Checkpoints across tensor-parallel sizes (gloo; one 4-rank run plus this process).

A toy TP model -- VocabParallelEmbedding -> replicated LayerNorm -> ColumnParallelLinear
(SwiGLU-style ``partition_blocks=2``) -> RowParallelLinear -- whose shards come from the same
full init at any tp, under our DistributedDataParallel over the data-parallel group and
MixedPrecisionOptimizer (replicated and distributed). It trains 2 steps at (tp=2, dp=2),
saves (torch_dist and torch), takes step 3 (the uninterrupted reference), and the
checkpoints are loaded at (tp=2, dp=2), (tp=1, dp=4) with the other optimizer kind, FSDP2
(tp=1, dp=4) and on one process (tp=1, dp=1, no process group). Every load must give the
saved full weights and full optimizer states exactly, and step 3 must then match the
reference to 1e-6. The full tensors are gathered here with ``sharding.gather_full`` (not
with the checkpoint code), and the files are checked directly: full logical shapes in the
DCP metadata, the layout record, and total bytes independent of (tp, dp).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.checkpoint.payload import distcp_bytes, same_payload
from tests.dist_utils import run_distributed

V, H, FFN, B, S = 16, 8, 16, 8, 4
LR, WD = 1e-2, 0.1
VARIANTS = ("ddp", "distopt")
FORMATS = ("torch_dist", "torch")


class _ToyTP(torch.nn.Module):
    def __init__(self, tp_group, seed: int = 0) -> None:
        from megadlms.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

        super().__init__()
        g = torch.Generator().manual_seed(seed)  # full tensors drawn in the same order at any tp
        self.embedding = VocabParallelEmbedding(V, H, tp_group=tp_group, generator=g)
        self.norm = torch.nn.LayerNorm(H)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.1, generator=g)
            self.norm.bias.normal_(0.0, 0.1, generator=g)
        self.fc1 = ColumnParallelLinear(H, 2 * FFN, tp_group=tp_group, partition_blocks=2, generator=g)
        self.fc2 = RowParallelLinear(FFN, H, tp_group=tp_group, generator=g)

    def forward(self, ids):
        h = self.norm(self.embedding(ids))
        gate, up = self.fc1(h).chunk(2, dim=-1)  # this rank's matching gate/up halves
        return h + self.fc2(F.silu(gate) * up)


def _batch(step: int, dp_rank: int = 0, dp: int = 1):
    g = torch.Generator().manual_seed(100 + step)
    ids, target = torch.randint(0, V, (B, S), generator=g), torch.randn(B, S, H, generator=g)
    per = B // dp
    return ids[dp_rank * per : (dp_rank + 1) * per], target[dp_rank * per : (dp_rank + 1) * per]


def _build(kind: str, tp_group, dp_group, seed: int = 0, bf16: bool = False):
    """(module, wrapper, optimizer); kind: ddp | distopt | fsdp2 | plain (one process);
    ``bf16``: bf16 params under Float16Module, fp32 main params (``fp32_param`` state)."""
    from megadlms.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        Float16Module,
        TorchFullyShardedDataParallel,
    )
    from megadlms.optimizer import OptimizerConfig, get_optimizer

    module = _ToyTP(tp_group, seed)
    distopt = kind == "distopt"
    # clip_grad 0: the step must not depend on the TP-aware grad norm (built elsewhere)
    cfg = OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=0.0, use_distributed_optimizer=distopt, bf16=bf16)
    if kind == "plain":
        wrapper = module
    elif kind == "fsdp2":
        wrapper = TorchFullyShardedDataParallel(module, process_group=dp_group)
    else:
        ddp_cfg = DistributedDataParallelConfig(
            use_distributed_optimizer=distopt, bucket_size=300, grad_reduce_in_fp32=bf16
        )
        inner = Float16Module(module, dtype=torch.bfloat16) if bf16 else module
        wrapper = DistributedDataParallel(inner, ddp_cfg, process_group=dp_group)
    return module, wrapper, get_optimizer(cfg, wrapper)


def _train_step(wrapper, opt, step: int, dp_rank: int, dp: int) -> None:
    opt.zero_grad()
    ids, target = _batch(step, dp_rank, dp)
    F.mse_loss(wrapper(ids), target).backward()
    if hasattr(wrapper, "finish_grad_sync"):
        wrapper.finish_grad_sync()
    ok, _ = opt.step()
    assert ok


def _full(t, like, tp_group):
    """The full logical tensor of ``t`` (sharded like parameter ``like``; collective)."""
    from megadlms.parallel import gather_full, shard_spec

    if hasattr(t, "full_tensor"):
        return t.full_tensor().detach().clone()
    spec = shard_spec(like)
    if spec is not None and tp_group is not None and t.dim() > 0:
        return gather_full(t.detach(), tp_group, *spec).clone()
    return t.detach().clone()


def _full_params(module, tp_group) -> dict:
    params = dict(module.named_parameters())
    return {f"model/{n}": _full(params[n], params[n], tp_group) for n in sorted(params)}


def _full_state(module, opt, tp_group) -> dict:
    """Full weights and full optimizer state tensors (sorted: a rank-independent order)."""
    out = _full_params(module, tp_group)
    params, state = dict(module.named_parameters()), opt.state_dict()["state"]
    for fqn in sorted(state):
        for k in sorted(state[fqn]):
            out[f"optimizer/{fqn}/{k}"] = _full(state[fqn][k], params[fqn], tp_group)
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _exact(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _worker(rank, world, root):
    import torch.distributed as dist

    from megadlms import checkpoint as ck
    from megadlms.parallel import ParallelGroups, model_parallel_manual_seed

    g22, g14 = ParallelGroups.build(tp=2), ParallelGroups.build(tp=1)
    out = {"saved": {}, "after": {}, "loads": {}, "rng": {}}
    for variant in VARIANTS:
        module, wrapper, opt = _build(variant, g22.tp.group, g22.dp.group)
        tracker = model_parallel_manual_seed(1234, g22.tp.rank)
        for step in (0, 1):
            _train_step(wrapper, opt, step, g22.dp.rank, g22.dp.size)
        with tracker.fork():
            torch.rand(3)  # advance the model-parallel stream
        for fmt in FORMATS:
            ck.save_checkpoint(
                f"{root}/{variant}_{fmt}", 2, model=wrapper, optimizer=opt, ckpt_format=fmt,
                layout=ck.ParallelLayout(tp_group=g22.tp.group, rng_tracker=tracker),
            )  # fmt: skip
        out["rng"][f"{variant}_saved"] = tracker.get_states()
        out["saved"][variant] = _full_state(module, opt, g22.tp.group)
        _train_step(wrapper, opt, 2, g22.dp.rank, g22.dp.size)  # the uninterrupted step 3
        out["after"][variant] = _full_params(module, g22.tp.group)

    # (target layout, optimizer kind to load into) for each saved variant
    targets = {
        "tp2dp2": (g22, lambda v: v),
        "tp1dp4": (g14, lambda v: "distopt" if v == "ddp" else "ddp"),
        "fsdp2": (g14, lambda v: "fsdp2"),
    }
    for variant in VARIANTS:
        for fmt in FORMATS:
            for name, (groups, kind_of) in targets.items():
                module, wrapper, opt = _build(kind_of(variant), groups.tp.group, groups.dp.group, seed=7)
                tracker = model_parallel_manual_seed(99, groups.tp.rank)
                state = ck.load_checkpoint(
                    f"{root}/{variant}_{fmt}/iter_0000002", model=wrapper, optimizer=opt,
                    layout=ck.ParallelLayout(tp_group=groups.tp.group, rng_tracker=tracker),
                )  # fmt: skip
                loaded = _full_state(module, opt, groups.tp.group)
                _train_step(wrapper, opt, 2, groups.dp.rank, groups.dp.size)
                after = _full_params(module, groups.tp.group)
                out["loads"][(variant, fmt, name)] = {
                    "exact": _exact(loaded, out["saved"][variant]),
                    "step_diff": _max_diff(after, out["after"][variant]),
                    "iteration": state.iteration,
                    "rng_restored": state.rng_restored,
                }
                if name == "tp2dp2":
                    out["rng"][f"{variant}_{fmt}_loaded"] = tracker.get_states()

    # bf16 (fp32 main params in the optimizer state): distributed optimizer at (tp=2, dp=2)
    # -> replicated at (tp=1, dp=4); the full state, fp32_param included, comes back exactly.
    module, wrapper, opt = _build("distopt", g22.tp.group, g22.dp.group, bf16=True)
    for step in (0, 1):
        _train_step(wrapper, opt, step, g22.dp.rank, g22.dp.size)
    ck.save_checkpoint(
        f"{root}/bf16", 2, model=wrapper, optimizer=opt, layout=ck.ParallelLayout(tp_group=g22.tp.group)
    )
    saved = _full_state(module, opt, g22.tp.group)
    module, wrapper, opt = _build("ddp", g14.tp.group, g14.dp.group, seed=7, bf16=True)
    ck.load_checkpoint(
        f"{root}/bf16/iter_0000002",
        model=wrapper,
        optimizer=opt,
        layout=ck.ParallelLayout(tp_group=g14.tp.group),
    )
    out["bf16"] = {"exact": _exact(_full_state(module, opt, g14.tp.group), saved), "keys": sorted(saved)}
    dist.barrier()
    return out


def test_tp_checkpoint_reshards_everywhere(tmp_path):
    from megadlms import checkpoint as ck
    from megadlms.checkpoint.format import SafeFileSystemReader

    root = str(tmp_path)
    results = run_distributed(_worker, world_size=4, args=(root,), timeout=600)
    out = results[0]
    for key, res in out["loads"].items():
        assert res["exact"], f"{key}: loaded full state differs from the saved one"
        assert res["step_diff"] <= 1e-6, (key, res["step_diff"])
        assert res["iteration"] == 2
        # RNG states come back only at the same layout (TP ranks share their default stream)
        assert res["rng_restored"] == (key[2] == "tp2dp2"), key
    for r, res in enumerate(results):  # every rank got its own tracker streams back
        for variant in VARIANTS:
            for fmt in FORMATS:
                saved, loaded = res["rng"][f"{variant}_saved"], res["rng"][f"{variant}_{fmt}_loaded"]
                assert all(torch.equal(saved[k], loaded[k]) for k in saved), (r, variant, fmt)
    assert out["bf16"]["exact"] and "optimizer/fc1.weight/fp32_param" in out["bf16"]["keys"]
    assert not torch.equal(  # the two TP ranks' model-parallel streams differ
        results[0]["rng"]["ddp_saved"]["model-parallel-rng"],
        results[1]["rng"]["ddp_saved"]["model-parallel-rng"],
    )

    # One process, no process group (tp=1, dp=1): the same state, the same step 3.
    for variant in VARIANTS:
        for fmt in FORMATS:
            ckpt = f"{root}/{variant}_{fmt}/iter_0000002"
            common = ck.read_common(ckpt)
            assert common["parallel"] == {"tp": 2, "pp": 1, "vp": 1, "dp": 2, "world": 4, "ep": 1}
            module, wrapper, opt = _build("plain", None, None, seed=7)
            state = ck.load_checkpoint(ckpt, model=module, optimizer=opt)
            assert not state.rng_restored
            assert _exact(_full_state(module, opt, None), out["saved"][variant]), (variant, fmt)
            _train_step(module, opt, 2, 0, 1)
            assert _max_diff(_full_params(module, None), out["after"][variant]) <= 1e-6, (variant, fmt)

    # The DCP metadata holds full logical shapes (model and optimizer state).
    md = SafeFileSystemReader(f"{root}/distopt_torch_dist/iter_0000002").read_metadata()
    shapes = {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
    expected = {
        "embedding.weight": (V, H),
        "fc1.weight": (2 * FFN, H),
        "fc1.bias": (2 * FFN,),
        "fc2.weight": (H, FFN),
        "fc2.bias": (H,),
        "norm.weight": (H,),
    }
    for name, shape in expected.items():
        assert shapes[f"model/{name}"] == shape, (name, shapes[f"model/{name}"])
        for k in ("exp_avg", "exp_avg_sq"):
            assert shapes[f"optimizer/state/{name}/{k}"] == shape, (name, k)

    # Each tensor is written once: the same checkpoint saved by one process has the same size.
    module, wrapper, opt = _build("plain", None, None, seed=7)
    ck.load_checkpoint(f"{root}/ddp_torch_dist/iter_0000002", model=module, optimizer=opt)
    single = ck.save_checkpoint(f"{root}/single", 2, model=module, optimizer=opt)
    full_bytes = sum(t.numel() * t.element_size() for t in out["saved"]["ddp"].values())
    multi, one = distcp_bytes(f"{root}/ddp_torch_dist/iter_0000002"), distcp_bytes(single)
    assert full_bytes <= one and same_payload(f"{root}/ddp_torch_dist/iter_0000002", single, 0.02), (
        multi,
        one,
        full_bytes,
    )
    for key, item in md.state_dict_metadata.items():  # no chunk stored twice
        if hasattr(item, "chunks"):
            assert sum(torch.Size(c.sizes).numel() for c in item.chunks) == torch.Size(item.size).numel(), key
    assert same_payload(f"{root}/ddp_torch_dist/iter_0000002", single, 0.05), (multi, one)
