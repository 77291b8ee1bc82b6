"""Sum-mode reduction (``calculate_per_token_loss``), the DataParallel protocol, and
cross-rank agreement on NaN gradients, on 3 gloo ranks (odd: catches padding bugs).

Reference: one process computes the gradient of (sum of every rank's summed loss) / N on
all the data; each wrapper in sum mode, fed loss_sum / N per rank, must reproduce it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed

VOCAB, D = 13, 8


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.fc1 = torch.nn.Linear(D, 24)
        self.norm = torch.nn.LayerNorm(24)
        self.fc2 = torch.nn.Linear(24, VOCAB)

    def forward(self, ids):
        return self.fc2(self.norm(torch.tanh(self.fc1(self.emb(ids)))))


def _data(rank: int):
    g = torch.Generator().manual_seed(17 + rank)
    rows = 3 + rank  # unequal token counts per rank: the global N matters
    return torch.randint(0, VOCAB, (rows, 5), generator=g), torch.randint(0, VOCAB, (rows, 5), generator=g)


def _loss_sum(model, ids, tgt):
    return F.cross_entropy(model(ids).reshape(-1, VOCAB), tgt.reshape(-1), reduction="sum")


def _reference(world: int) -> dict:
    torch.manual_seed(0)
    model = Net()
    batches = [_data(r) for r in range(world)]
    n = sum(t.numel() for _, t in batches)
    total = sum(_loss_sum(model, ids, tgt) for ids, tgt in batches) / n
    total.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def _grads(wrapper, kind: str) -> dict:
    from megadlms.distributed import unwrap_model

    out = {}
    for name, p in unwrap_model(wrapper).named_parameters():
        if kind == "fsdp2":
            out[name] = p.grad.full_tensor()
        elif kind == "distopt":  # only this rank's shard is reduced: gather the buckets
            out[name] = p.main_grad
        else:
            out[name] = wrapper.main_grad(p)
    return out


def _sum_mode_world(rank, world):
    import torch.distributed as dist

    from megadlms.distributed import (
        DataParallel,
        DistributedDataParallel,
        DistributedDataParallelConfig,
        TorchFullyShardedDataParallel,
    )

    ids, tgt = _data(rank)
    n = torch.tensor([float(tgt.numel())])
    dist.all_reduce(n)
    out = {}
    for kind in ("ddp", "ddp_overlap", "distopt", "fsdp2"):
        torch.manual_seed(0)
        model = Net()
        kw = dict(calculate_per_token_loss=True)
        if kind == "ddp_overlap":
            kw.update(overlap_grad_reduce=True, bucket_size=50)
        if kind == "distopt":
            kw.update(use_distributed_optimizer=True, bucket_size=50)
        cfg = DistributedDataParallelConfig(**kw)
        if kind == "fsdp2":
            wrapper = TorchFullyShardedDataParallel(model, cfg, fsdp_unit_modules=[torch.nn.Linear])
        else:
            wrapper = DistributedDataParallel(model, cfg)
        assert isinstance(wrapper, DataParallel)
        wrapper.zero_grad_buffer()
        (_loss_sum(wrapper, ids, tgt) / n[0]).backward()
        wrapper.finish_grad_sync()
        if kind == "distopt":
            for b in wrapper.grad_buckets:  # all-gather every rank's reduced shard
                lo, hi = b.shard_range(wrapper.comm.rank, wrapper.comm.world_size)
                wrapper.comm.all_gather(b.grad_data, b.grad_data[lo:hi].clone())
        out[kind] = {k: v.detach().clone() for k, v in _grads(wrapper, kind).items()}
        out[f"{kind}_layout"] = wrapper.optimizer_layout
    return out


def test_sum_mode_gives_the_global_per_token_gradient_in_every_wrapper():
    world = 3
    ref = _reference(world)
    results = run_distributed(_sum_mode_world, world)
    for rank, res in enumerate(results):
        for kind in ("ddp", "ddp_overlap", "distopt", "fsdp2"):
            for name, g in ref.items():
                err = (res[kind][name] - g).abs().max().item()
                assert err <= 1e-6, (rank, kind, name, err)
        assert (res["ddp_layout"], res["distopt_layout"], res["fsdp2_layout"]) == (
            "replicated",
            "bucket_shards",
            "dtensor",
        )


def _nan_world(rank, world, kind):
    from megadlms.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        TorchFullyShardedDataParallel,
    )

    torch.manual_seed(0)
    model = Net()
    cfg = DistributedDataParallelConfig(check_for_nan_in_grad=True, overlap_grad_reduce=True, bucket_size=50)
    if kind == "fsdp2":
        cfg = DistributedDataParallelConfig(check_for_nan_in_grad=True)
        wrapper = TorchFullyShardedDataParallel(model, cfg)
    else:
        wrapper = DistributedDataParallel(model, cfg)
    if rank == world - 1 and kind == "ddp":  # only the last rank sees a NaN
        model.fc1.weight.register_hook(lambda g: g * float("nan"))
    ids, tgt = _data(rank)
    _loss_sum(wrapper, ids, tgt).backward()
    if rank == world - 1 and kind == "fsdp2":  # a NaN in one rank's reduced shard only
        with torch.no_grad():
            model.fc1.weight.grad.to_local().view(-1)[0] = float("nan")
    try:
        wrapper.finish_grad_sync()
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_nan_on_one_rank_stops_every_rank(kind):
    world = 3
    msgs = run_distributed(_nan_world, world, (kind,), timeout=120)
    for rank, msg in enumerate(msgs):
        assert msg is not None, f"rank {rank} did not stop"
        assert "check_for_nan_in_grad" in msg
    if kind == "ddp":
        # the offending rank names its bucket and parameter; the others name that rank
        assert f"rank {world - 1}" in msgs[-1] and "fc1.weight" in msgs[-1], msgs[-1]
        assert f"rank(s) [{world - 1}]" in msgs[0], msgs[0]
    else:
        assert all("rank(s) [" in m for m in msgs)


class _DuckWrapper(torch.nn.Module):
    """The smallest wrapper the optimizer takes (its GradientSource protocol): one process,
    replicated gradients."""

    optimizer_layout = "replicated"

    def __init__(self, module):
        super().__init__()
        from megadlms.distributed import DistributedDataParallelConfig
        from megadlms.distributed.comm import LocalCommunicator

        self.module, self.ddp_config, self.comm = module, DistributedDataParallelConfig(), LocalCommunicator()
        self.shard_comm, self.parallel, self.grad_buckets = self.comm, None, []
        self.zeroed = 0

    def start_param_sync(self, *, force_sync=False):
        pass

    def named_trainable_parameters(self):
        return {p: n for n, p in self.module.named_parameters()}

    def main_grad(self, p):
        return p.grad

    def zero_grad_buffer(self):
        self.zeroed += 1
        for p in self.module.parameters():
            p.grad = None


def test_optimizer_uses_only_the_protocol():
    """get_optimizer never asks which class the wrapper is: a duck wrapper that declares
    the replicated layout trains exactly like the plain module."""
    from megadlms.optimizer import OptimizerConfig, get_optimizer

    torch.manual_seed(0)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    duck = _DuckWrapper(b)
    opts = [get_optimizer(OptimizerConfig(lr=1e-2), m) for m in (a, duck)]
    ids, tgt = _data(0)
    for model, opt in zip((a, duck.module), opts):
        opt.zero_grad()
        _loss_sum(model, ids, tgt).backward()
        assert opt.step()[0]
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert duck.zeroed == 1  # optimizer.zero_grad zeroes the wrapper's buffers (once)
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        get_optimizer(OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), duck)
