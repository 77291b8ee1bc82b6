"""Every overlapped path under deliberately slow communication (issue 21), on 2 gloo ranks.

Inside ``slow_comm()`` (tests/distributed/slow_comm.py) each async collective lands only at
its wait and its output holds NaN before: any read of a parameter or gradient whose
collective is still in flight shows up every time, not only on a loaded machine.

Toy model: fc1 -> gelu -> fc2 -> LayerNorm (several buckets). Reference (independent): the
same function with plain ``nn.Linear`` / ``nn.LayerNorm`` on one process over the global
batch, ``torch.optim.AdamW`` with Megatron's weight-decay groups and ``clip_grad_norm_``.
Compared, one spawned world for all:

* distributed optimizer with overlapped reduce and gather, as one DDP and as two model
  chunks (``ModelChunks``, the pipeline's wrapper): the params norm, ``state_dict()`` and an
  evaluation forward read right after each step (gathers in flight) equal the reference's;
  the params after 3 steps too; every async collective was waited for;
* the first steps after loading a checkpoint (model and distributed-optimizer state; the load
  launches an overlapped gather) continue the uninterrupted run exactly;
* plain DDP, overlapped reduce with a ``no_sync`` micro-batch: the reduced grads;
* FSDP2 (no prefetch configured): params after 3 steps; it launches no async collective
  through torch.distributed on CPU, so nothing of it can be read in flight;
* a parameter read outside the forward of the module that owns it raises on every rank.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.distributed.slow_comm import slow_comm

B, H, FF, STEPS, WORLD = 8, 8, 24, 3, 2
LR, WD, CLIP = 1e-2, 0.1, 0.05
BUCKET = 100  # elements: several buckets


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc1, self.fc2, self.norm = nn.Linear(H, FF), nn.Linear(FF, H), nn.LayerNorm(H)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x):
        return self.norm(self.fc2(F.gelu(self.fc1(x))))


class _Head(nn.Module):
    """fc2 -> norm: the second model chunk."""

    def __init__(self, net: _Net) -> None:
        super().__init__()
        self.fc2, self.norm = net.fc2, net.norm

    def forward(self, h):
        return self.norm(self.fc2(h))


class _Body(nn.Module):
    def __init__(self, net: _Net) -> None:
        super().__init__()
        self.fc1 = net.fc1

    def forward(self, x):
        return F.gelu(self.fc1(x))


class _ReadsChildWeight(_Net):
    """Reads fc2's weight in its own forward, never calling fc2: unguarded under overlap."""

    def forward(self, x):
        return self.norm(F.linear(F.gelu(self.fc1(x)), self.fc2.weight, self.fc2.bias))


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, H, generator=g), torch.randn(B, H, generator=g)


def _groups(named):
    decay = [p for n, p in named if p.dim() > 1]
    return [
        {"params": decay, "weight_decay": WD},
        {"params": [p for n, p in named if p.dim() == 1], "weight_decay": 0.0},
    ]


def _reference():
    net = _Net()
    opt = torch.optim.AdamW(_groups(list(net.named_parameters())), lr=LR)
    out = {"pnorms": [], "params": [], "evals": []}
    for s in range(STEPS):
        opt.zero_grad()
        x, y = _batch(s)
        F.mse_loss(net(x), y).backward()
        if s == 0:
            out["grads"] = {n: p.grad.clone() for n, p in net.named_parameters()}
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        out["pnorms"].append(
            math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in net.parameters()))
        )
        out["params"].append({n: p.detach().clone() for n, p in net.named_parameters()})
        with torch.no_grad():
            out["evals"].append(net(_batch(99)[0]))
    return out


def _optimizer(model, distopt=True):
    from megadlms.optimizer import OptimizerConfig, get_optimizer

    return get_optimizer(
        OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP, use_distributed_optimizer=distopt), model
    )


def _wrap(chunked: bool):
    """(wrapper, forward) for the distributed optimizer with everything overlapped."""
    from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig, ModelChunks

    cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        bucket_size=BUCKET,
    )
    net = _Net()
    if not chunked:
        ddp = DistributedDataParallel(net, cfg)
        return ddp, ddp
    chunks = ModelChunks([DistributedDataParallel(_Body(net), cfg), DistributedDataParallel(_Head(net), cfg)])
    return chunks, lambda x: chunks.chunks[1](chunks.chunks[0](x))


def _step(model, forward, opt, s):
    rows = slice(model.comm.rank * B // WORLD, (model.comm.rank + 1) * B // WORLD)
    opt.zero_grad()
    x, y = _batch(s)
    F.mse_loss(forward(x[rows]), y[rows]).backward()
    model.finish_grad_sync()
    ok, _ = opt.step()  # with overlap: the gathers are in flight when it returns
    assert ok, f"step {s} skipped"


def _read_after_step(model, forward, pnorms, sds, evals):
    from megadlms.training.validation import params_norm

    pnorms.append(params_norm(model, torch.device("cpu")))
    model.start_param_sync()  # each read below with the (same) gathers in flight again
    sds.append({k: v.clone() for k, v in model.state_dict().items()})
    model.start_param_sync()
    with torch.no_grad():
        evals.append(forward(_batch(99)[0]))


def _distopt(chunked: bool):
    model, forward = _wrap(chunked)
    opt = _optimizer(model)
    out = {"pnorms": [], "sds": [], "evals": []}
    with slow_comm() as sc:
        for s in range(STEPS):
            _step(model, forward, opt, s)
            _read_after_step(model, forward, out["pnorms"], out["sds"], out["evals"])
            if s == 0:
                saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
        out["pending"] = sc.pending()
        out["launched"] = dict(sc.launched)
        # resume after step 0 in a fresh wrapper: the load launches an overlapped gather
        model2, forward2 = _wrap(chunked)
        opt2 = _optimizer(model2)
        model2.load_state_dict(saved[0])
        opt2.load_state_dict(saved[1])
        for s in range(1, STEPS):
            _step(model2, forward2, opt2, s)
        out["resumed"] = {k: v.clone() for k, v in model2.state_dict().items()}  # waits
    return out


def _plain_ddp():
    """Overlapped reduce, a no_sync micro-batch: the reduced gradients of step 0."""
    from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(
        _Net(), DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=BUCKET)
    )
    rank, half = ddp.comm.rank, B // WORLD // 2
    x, y = _batch(0)
    with slow_comm() as sc:
        for mb in range(2):  # each micro-batch's loss: its share of the global mean
            rows = slice(rank * 2 * half + mb * half, rank * 2 * half + (mb + 1) * half)
            loss = F.mse_loss(ddp(x[rows]), y[rows]) / 2
            if mb == 0:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
        ddp.finish_grad_sync()
        pending, launched = sc.pending(), dict(sc.launched)
    return {n: p.main_grad.clone() for p, n in ddp.param_names.items()}, pending, launched, len(ddp.buckets)


def _fsdp2():
    from megadlms.distributed import DistributedDataParallelConfig, TorchFullyShardedDataParallel

    model = TorchFullyShardedDataParallel(
        _Net(), DistributedDataParallelConfig(), fsdp_unit_modules=[nn.Linear]
    )
    opt = _optimizer(model, distopt=False)
    with slow_comm() as sc:
        for s in range(STEPS):
            _step(model, model, opt, s)
        launched = dict(sc.launched)
    return {k: v.full_tensor() for k, v in model.state_dict().items()}, launched


def _unguarded():
    from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig

    cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
    )
    ddp = DistributedDataParallel(_ReadsChildWeight(), cfg)
    opt = _optimizer(ddp)
    _step(ddp, ddp, opt, 0)  # nothing in flight yet at step 0
    try:
        _step(ddp, ddp, opt, 1)
        return None
    except RuntimeError as e:
        return str(e)


def _job(rank, world):
    return {
        "single": _distopt(chunked=False),
        "chunks": _distopt(chunked=True),
        "plain": _plain_ddp(),
        "fsdp2": _fsdp2(),
        "unguarded": _unguarded(),
    }


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_job, world_size=WORLD, timeout=400), _reference()


def _close(a, b, tol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=tol, rtol=tol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("kind", ["single", "chunks"])
def test_reads_right_after_an_overlapped_step_see_the_gathered_params(runs, kind):
    """Params norm, state_dict (checkpoint save) and an evaluation forward right after the
    step, while the param gathers are in flight; and the first steps after a load."""
    results, ref = runs
    for res in results:
        run = res[kind]
        assert run["pending"] == 0
        assert set(run["launched"]) == {"reduce_scatter_tensor", "all_gather_into_tensor"}
        for s in range(STEPS):
            assert abs(run["pnorms"][s] - ref["pnorms"][s]) <= 1e-6 * ref["pnorms"][s], s
            _close(run["sds"][s], ref["params"][s], 1e-5)
            torch.testing.assert_close(run["evals"][s], ref["evals"][s], atol=1e-5, rtol=1e-5)
        _close(run["resumed"], run["sds"][-1], 0)  # resuming continues the run exactly


def test_plain_ddp_overlapped_reduce_with_no_sync(runs):
    results, ref = runs
    for res in results:
        grads, pending, launched, n_buckets = res["plain"]
        assert n_buckets >= 2 and pending == 0 and launched == {"all_reduce": n_buckets}
        _close(grads, ref["grads"], 1e-6)


def test_fsdp2_under_slow_comm(runs):
    results, ref = runs
    for res in results:
        params, launched = res["fsdp2"]
        assert launched == {}  # no prefetch configured: FSDP2's gathers here are blocking
        _close(params, ref["params"][-1], 1e-5)


def test_a_param_read_outside_its_owners_forward_raises(runs):
    results, _ = runs
    for res in results:
        assert re.search(r"parameter fc2\.(weight|bias) was read in the forward", res["unguarded"] or ""), (
            res["unguarded"]
        )
