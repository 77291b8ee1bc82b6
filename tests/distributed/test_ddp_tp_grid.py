"""DDP and the distributed optimizer over a tensor-parallel grid, and distributed-optimizer
instances, on 4 gloo ranks (one job computing every comparison).

Toy model: ColumnParallelLinear -> gelu -> RowParallelLinear (replicated bias) -> LayerNorm
(replicated), with and without sequence parallelism (then the row bias and the norm declare
``tp_partial_grad``: each TP rank's gradient covers its sequence chunk only).

Reference (independent): the same function written with torch ``nn.Linear`` / ``nn.LayerNorm``
on one process, ``torch.optim.AdamW`` with Megatron's weight-decay groups and
``torch.nn.utils.clip_grad_norm_``, on the whole global batch. Compared:

* tp=2 x dp=2, replicated and distributed optimizer, SP off and on: the reduced gradients
  gathered to full tensors (``sharding.gather_full``) within 1e-6, the optimizer's grad norm
  vs the norm of those gathered gradients and vs the reference, params after 2 AdamW steps
  with clipping within 1e-5; TP peers build identical buffer layouts;
* instances: tp=1 x dp=4 with N=2 vs N=1 (several buckets, overlapped reduce and gather):
  params within 1e-6, optimizer state bytes exactly 8 x params per instance (so twice N=1's
  per rank); tp=2 x dp=2 with N=2 (an instance of one rank) vs the reference;
* a NaN on one TP rank raises on all 4 ranks; an fp16 overflow on one TP rank skips the step
  on all 4 ranks; the wrong-group / instance-count errors.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from megadlms.parallel.groups import derived_rank_grid
from megadlms.parallel.sharding import set_sharding
from tests.dist_utils import run_distributed
from tests.distributed.slow_comm import slow_comm

B, S, H, FF = 4, 4, 8, 16
LR, WD, CLIP, STEPS = 1e-2, 0.1, 0.05, 2  # two steps: the second reads the first's optimizer state
BUCKET = 100  # elements: several buckets for the instance runs


class _Toy(nn.Module):
    def __init__(self, tp_group, sp: bool) -> None:
        super().__init__()
        from megadlms.parallel import ColumnParallelLinear, RowParallelLinear, normal_init

        g = torch.Generator().manual_seed(0)
        self.tp_group, self.sp = tp_group, sp
        # std 0.3, not Megatron's 0.02: O(1) activations into the LayerNorm keep its grads O(1),
        # so fp32 reduction-order differences stay far below the 1e-6 tolerance.
        init = dict(tp_group=tp_group, sequence_parallel=sp, generator=g, init_method=normal_init(0.3))
        self.fc1 = ColumnParallelLinear(H, FF, **init)
        self.fc2 = RowParallelLinear(FF, H, **init)
        self.norm = nn.LayerNorm(H)
        with torch.no_grad():  # non-trivial replicated values, the same draws on every rank
            self.norm.weight.copy_(1 + 0.1 * torch.randn(H, generator=g))
            self.norm.bias.copy_(0.1 * torch.randn(H, generator=g))
        if sp:
            set_sharding(self.norm.weight, tp_partial_grad=True)
            set_sharding(self.norm.bias, tp_partial_grad=True)

    def forward(self, x):
        from megadlms.parallel import mappings

        if self.sp:
            x = mappings.scatter_to_sequence_parallel(x, self.tp_group)
        h = self.norm(self.fc2(F.gelu(self.fc1(x))))
        if self.sp:  # every TP rank computes the same full loss
            h = mappings.gather_from_sequence_parallel(h, self.tp_group, grad_is_partial=False)
        return h


class _Ref(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(H, FF), nn.Linear(FF, H), nn.LayerNorm(H)

    def forward(self, x):
        return self.norm(self.fc2(F.gelu(self.fc1(x))))


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)


def _reference():
    toy = _Toy(None, False)  # tp = 1: the full logical weights (layout-independent init)
    ref = _Ref()
    ref.load_state_dict(toy.state_dict())
    decay = [p for n, p in ref.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
    rest = [p for n, p in ref.named_parameters() if p.dim() == 1 or n.endswith(".bias")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}], lr=LR
    )
    norms, grads = [], None
    for s in range(STEPS):
        opt.zero_grad()
        x, y = _batch(s)
        F.mse_loss(ref(x), y).backward()
        if s == 0:
            grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP).item())
        opt.step()
    return {
        "grads": grads,
        "norms": norms,
        "params": {n: p.detach().clone() for n, p in ref.named_parameters()},
    }


# ---------------------------------------------------------------------------------- ranks
def _full(t, like, parallel):
    from megadlms.parallel import gather_full, shard_spec

    spec = shard_spec(like)
    return t.clone() if spec is None else gather_full(t, parallel.tp.group, *spec)


def _full_grads(ddp, parallel):
    """Every reduced gradient as its full logical tensor (collective: dp shards, then TP)."""
    flat = {}
    for b in ddp.buckets:
        data = b.grad_data.clone()
        if ddp.ddp_config.use_distributed_optimizer:
            lo, hi = b.shard_range(ddp.shard_comm.rank, ddp.shard_comm.world_size)
            ddp.shard_comm.all_gather(data, data[lo:hi].clone())
        for p, off in zip(b.params, b.offsets):
            flat[p] = data[off : off + p.numel()].view(p.shape)
    return {n: _full(flat[p], p, parallel) for p, n in ddp.param_names.items()}


def _train(parallel, sp, ddp_cfg):
    from megadlms.distributed import DistributedDataParallel
    from megadlms.optimizer import OptimizerConfig, get_optimizer

    ddp = DistributedDataParallel(_Toy(parallel.tp.group, sp), ddp_cfg, parallel=parallel)
    opt = get_optimizer(
        OptimizerConfig(
            lr=LR,
            weight_decay=WD,
            clip_grad=CLIP,
            use_distributed_optimizer=ddp_cfg.use_distributed_optimizer,
        ),
        ddp,
    )
    per = B // parallel.dp.size
    rows = slice(parallel.dp.rank * per, (parallel.dp.rank + 1) * per)
    out = {"norms": [], "full_norms": []}
    for s in range(STEPS):
        opt.zero_grad()
        x, y = _batch(s)
        F.mse_loss(ddp(x[rows]), y[rows]).backward()
        ddp.finish_grad_sync()
        grads = _full_grads(ddp, parallel)
        if s == 0:
            out["grads"] = grads
        out["full_norms"].append(math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values())))
        ok, norm = opt.step()
        assert ok, f"step {s} skipped"
        out["norms"].append(norm)
    ddp.finish_param_sync()
    out["params"] = {n: _full(p.detach(), p, parallel) for p, n in ddp.param_names.items()}
    out["state_bytes"] = opt.state_bytes()
    if parallel.tp.size == 1:  # the checkpoint format: full logical shapes (collective)
        state = opt.state_dict()["state"]
        out["opt_state"] = {f"{n}.{k}": v.clone() for n, st in state.items() for k, v in st.items()}
    out["sp_params"] = sorted(ddp.param_names[p] for p in ddp._sp_params)
    out["layout"] = (
        [(ddp.param_names[p], rng) for buf in ddp.buffers_ for p, rng in buf.param_index_map.items()],
        [(b.grad_data.numel(), ddp._shard_range(b)) for b in ddp.buckets],
    )
    return out


def _nan_on_tp_rank_1(parallel):
    from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig

    model = _Toy(parallel.tp.group, False)
    ddp = DistributedDataParallel(
        model, DistributedDataParallelConfig(check_for_nan_in_grad=True), parallel=parallel
    )
    x, y = _batch(0)
    F.mse_loss(ddp(x), y).backward()
    if parallel.rank == 1:  # tp rank 1 of dp rank 0: its TP peer 0 never sees this value
        with torch.no_grad():
            model.fc1.weight.main_grad[0, 0] = float("nan")
    try:
        ddp.finish_grad_sync()
        return None
    except RuntimeError as e:
        return str(e)


def _fp16_overflow_on_tp_rank_1(parallel, distopt):
    from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megadlms.optimizer import OptimizerConfig, get_optimizer

    cfg = DistributedDataParallelConfig(use_distributed_optimizer=distopt)
    ddp = DistributedDataParallel(_Toy(parallel.tp.group, False), cfg, parallel=parallel)
    opt = get_optimizer(
        OptimizerConfig(lr=LR, fp16=True, loss_scale=1.0, use_distributed_optimizer=distopt), ddp
    )
    flags = []
    for s in range(2):
        opt.zero_grad()
        x, y = _batch(s)
        F.mse_loss(ddp(x), y).backward()
        ddp.finish_grad_sync()
        if s == 0 and parallel.rank == 1:  # inside this rank's shard (dp rank 0 owns offset 0)
            ddp.buckets[0].grad_data[0] = float("inf")
        flags.append(opt.step()[0])
    return flags


def _errors(parallel):
    import torch.distributed as dist

    from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig

    out = {}
    cases = {
        "group": lambda: DistributedDataParallel(
            _Toy(None, False), process_group=dist.group.WORLD, parallel=parallel
        ),
        "needs_parallel": lambda: DistributedDataParallel(
            _Toy(None, False),
            DistributedDataParallelConfig(
                use_distributed_optimizer=True, num_distributed_optimizer_instances=2
            ),
        ),
        "mismatch": lambda: DistributedDataParallel(
            _Toy(None, False),
            DistributedDataParallelConfig(
                use_distributed_optimizer=True, num_distributed_optimizer_instances=2
            ),
            parallel=parallel,
        ),
    }
    for name, build in cases.items():
        try:
            build()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def _job(rank, world):
    import torch.distributed as dist

    from megadlms.distributed import DistributedDataParallelConfig as Cfg
    from megadlms.parallel import ParallelGroups

    g22 = ParallelGroups.build(tp=2)
    g41 = ParallelGroups.build(tp=1)
    g42 = ParallelGroups.build(tp=1, num_distributed_optimizer_instances=2)
    g22n2 = ParallelGroups.build(tp=2, num_distributed_optimizer_instances=2)
    out = {"axes": {}}
    for key, g in (("g22", g22), ("g42", g42), ("g22n2", g22n2)):
        for axis in ("mp", "dp_intra", "dp_inter"):
            a = getattr(g, axis)
            t = torch.tensor([float(rank)])
            if a.group is not None:
                assert dist.get_process_group_ranks(a.group) == list(a.ranks)
                dist.all_reduce(t, group=a.group)
            out["axes"][key, axis] = (a.size, a.rank, a.ranks, t.item())
    for sp in (False, True):
        for distopt in (False, True):
            out["grid", sp, distopt] = _train(g22, sp, Cfg(use_distributed_optimizer=distopt))
    overlap = dict(use_distributed_optimizer=True, bucket_size=BUCKET, overlap_grad_reduce=True)
    out["n1"] = _train(g41, False, Cfg(overlap_param_gather=True, **overlap))
    out["n2"] = _train(
        g42, False, Cfg(overlap_param_gather=True, num_distributed_optimizer_instances=2, **overlap)
    )
    out["n2_tp2"] = _train(g22n2, True, Cfg(num_distributed_optimizer_instances=2, **overlap))
    # Issue 21: every async collective lands only at its wait (NaN before): TP x SP with
    # overlapped reduce and gather, and instances (their async inter-instance all-reduce).
    for key, g, sp, n in (("slow_sp", g22, True, 1), ("slow_n2", g42, False, 2)):
        with slow_comm() as sc:
            cfg = Cfg(overlap_param_gather=True, num_distributed_optimizer_instances=n, **overlap)
            out[key] = _train(g, sp, cfg)
        out[key]["comm"] = (dict(sc.launched), sc.pending())
    out["nan"] = _nan_on_tp_rank_1(g22)
    out["fp16"] = {d: _fp16_overflow_on_tp_rank_1(g22, d) for d in (False, True)}
    out["errors"] = _errors(g22)
    try:  # a bad instance count fails on every rank before any collective
        ParallelGroups.build(tp=1, num_distributed_optimizer_instances=3)
        out["bad_n"] = None
    except ValueError as e:
        out["bad_n"] = str(e)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_job, world_size=4, timeout=400), _reference()


def _close(a, b, tol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=tol, rtol=tol, msg=lambda m, k=k: f"{k}: {m}")


def test_groups_match_the_pure_tables(runs):
    results, _ = runs
    for key, sizes in (("g22", dict(tp=2)), ("g42", dict(num_distributed_optimizer_instances=2))):
        table = derived_rank_grid(4, **sizes)
        for rank, res in enumerate(results):
            for axis in ("mp", "dp_intra", "dp_inter"):
                size, axis_rank, ranks, total = res["axes"][key, axis]
                group = next(g for g in table[axis] if rank in g)
                assert (size, axis_rank, ranks) == (len(group), group.index(rank), tuple(group))
                assert total == sum(group)
    assert derived_rank_grid(4, num_distributed_optimizer_instances=2) == {
        "mp": [[0], [1], [2], [3]],
        "dp_intra": [[0, 1], [2, 3]],
        "dp_inter": [[0, 2], [1, 3]],
    }
    assert derived_rank_grid(8, tp=2, pp=2)["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("distopt", [False, True])
def test_tp2_dp2_matches_one_process(runs, sp, distopt):
    results, ref = runs
    assert ref["norms"][0] > CLIP  # clipping is active
    for rank, res in enumerate(results):
        run = res["grid", sp, distopt]
        _close(run["grads"], ref["grads"], 1e-6)
        for got, full, want in zip(run["norms"], run["full_norms"], ref["norms"]):
            assert abs(got - full) <= 1e-6 * full, (rank, got, full)
            assert abs(got - want) <= 1e-6 * want, (rank, got, want)
        _close(run["params"], ref["params"], 1e-5)
        assert run["sp_params"] == (["fc2.bias", "norm.bias", "norm.weight"] if sp else [])


def test_overlap_with_tp_sp_and_instances_under_slow_comm(runs):
    """Async collectives that complete only at their wait: TP x SP x distributed optimizer
    matches the reference, instances match one instance; the TP/SP mappings issue no async
    collective (nothing of theirs can be in flight), the DDP every one it launches waits."""
    results, ref = runs
    for res in results:
        sp, n2 = res["slow_sp"], res["slow_n2"]
        _close(sp["grads"], ref["grads"], 1e-6)
        for got, want in zip(sp["norms"], ref["norms"]):
            assert abs(got - want) <= 1e-6 * want, (got, want)
        _close(sp["params"], ref["params"], 1e-5)
        _close(n2["params"], res["n1"]["params"], 1e-6)
        n_sp, n_n2 = len(sp["layout"][1]), len(n2["layout"][1])
        assert sp["comm"] == (
            {"reduce_scatter_tensor": STEPS * n_sp, "all_gather_into_tensor": STEPS * n_sp},
            0,
        )
        assert n2["comm"] == (
            {
                "reduce_scatter_tensor": STEPS * n_n2,
                "all_reduce": STEPS * n_n2,
                "all_gather_into_tensor": STEPS * n_n2,
            },
            0,
        )


def test_tp_peers_have_identical_buffer_layouts(runs):
    """What makes the TP all-reduce of sequence_parallel grads valid under the distributed
    optimizer: TP peers (ranks 0,1 and 2,3) own the same shard ranges of the same layout."""
    results, _ = runs
    for a, b in ((0, 1), (2, 3)):
        assert results[a]["grid", True, True]["layout"] == results[b]["grid", True, True]["layout"]
    # and dp peers own different shards of it
    assert results[0]["grid", True, True]["layout"][1] != results[2]["grid", True, True]["layout"][1]


def test_instances_match_one_instance_and_shard_state_within_it(runs):
    results, ref = runs
    n_params = sum(p.numel() for p in ref["params"].values())
    for res in results:
        _close(res["n2"]["params"], res["n1"]["params"], 1e-6)
        _close(res["n2"]["opt_state"], res["n1"]["opt_state"], 1e-6)  # gathered within an instance
        _close(res["n2"]["params"], ref["params"], 1e-5)
        _close(res["n2_tp2"]["params"], ref["params"], 1e-5)
    # fp32 params: AdamW's exp_avg + exp_avg_sq = 8 bytes per owned element. N=1: the 4 dp
    # ranks partition the state; N=2: each instance (ranks 0,1 and 2,3) holds a full copy.
    n1 = [r["n1"]["state_bytes"] for r in results]
    n2 = [r["n2"]["state_bytes"] for r in results]
    assert sum(n1) == 8 * n_params
    assert n2[0] + n2[1] == n2[2] + n2[3] == 8 * n_params
    assert sum(n2) == 2 * sum(n1)  # total / (dp/N) per rank on average: twice N=1's
    # tp=2, dp=2, N=2: an instance is one rank, which holds the state of all its local shards
    local = 8 * (n_params - FF * H // 2 - FF // 2 - H * FF // 2)
    assert all(r["n2_tp2"]["state_bytes"] == local for r in results)


def test_nan_on_one_tp_rank_stops_every_rank(runs):
    results, _ = runs
    for rank, res in enumerate(results):
        assert res["nan"] is not None, f"rank {rank} did not stop"
        assert "NaN/Inf gradients on rank(s) [1]" in res["nan"], res["nan"]
    assert "fc1.weight" in results[1]["nan"]


def test_fp16_overflow_on_one_tp_rank_skips_everywhere(runs):
    results, _ = runs
    for res in results:
        assert res["fp16"] == {False: [False, True], True: [False, True]}


def test_wrong_groups_and_instance_counts_are_clear_errors(runs):
    results, _ = runs
    for res in results:
        errs = res["errors"]
        assert "differs from parallel.dp" in errs["group"]
        assert "needs parallel=ParallelGroups.build" in errs["needs_parallel"]
        assert "parallel was built with 1 instance(s)" in errs["mismatch"]
        assert (
            "num_distributed_optimizer_instances 3 does not divide the data-parallel size 4" in res["bad_n"]
        )


def test_config_checks_the_instance_count():
    from megadlms.common.errors import ConfigError
    from megadlms.distributed import DistributedDataParallelConfig

    with pytest.raises(ConfigError, match="num_distributed_optimizer_instances must be a positive integer"):
        DistributedDataParallelConfig(num_distributed_optimizer_instances=0)
    with pytest.raises(
        ConfigError, match="num_distributed_optimizer_instances 2 > 1 needs use_distributed_optimizer"
    ):
        DistributedDataParallelConfig(num_distributed_optimizer_instances=2)
    assert (
        DistributedDataParallelConfig(
            use_distributed_optimizer=True, num_distributed_optimizer_instances=2
        ).num_distributed_optimizer_instances
        == 2
    )
