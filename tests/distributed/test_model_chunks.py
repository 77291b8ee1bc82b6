"""``ModelChunks``: the DataParallel protocol over per-chunk DDPs, and the optimizer through it.

Toy chunks (no pipeline code): a stack of ``Linear`` layers named with GLOBAL layer numbers
(``layers.{i}.weight``), cut into chunks. Reference (independent): the whole stack on one
process, ``torch.optim.AdamW`` with Megatron's weight-decay groups and
``torch.nn.utils.clip_grad_norm_``, on the whole global batch.

* dp=2 on 2 ranks, two chunks per rank (the interleaved shape): params after 3 clipped AdamW
  steps and the grad norm match the reference, replicated and distributed optimizer (one
  bucket per chunk per dtype: the chunks' bucket indices collide, the optimizer must not
  care); the merged state dict has the full model's keys; no_sync suppresses every chunk's
  collectives;
* pp=2 x dp=2 on 4 ranks (each stage one chunk, separable losses so no activations need to
  travel): the grad norm sums both stages (the model-parallel group spans tp x pp) and a
  parameter declared ``tied_copy`` counts zero times; clipping uses that norm.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from megadlms.parallel.sharding import set_sharding
from tests.dist_utils import run_distributed

H, LAYERS, B = 6, 4, 4
LR, WD, CLIP, STEPS = 1e-2, 0.1, 0.05, 3


class _Chunk(nn.Module):
    """Layers ``layer_ids`` of the stack, under their global names ``layers.{i}``."""

    def __init__(self, layer_ids) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        full = [nn.Linear(H, H) for _ in range(LAYERS)]
        for lin in full:  # the same draws on every rank, for every chunking
            with torch.no_grad():
                lin.weight.copy_(torch.randn(H, H, generator=g) * 0.5)
                lin.bias.copy_(torch.randn(H, generator=g) * 0.1)
        self.layers = nn.ModuleDict({str(i): full[i] for i in layer_ids})

    def forward(self, x):
        for lin in self.layers.values():
            x = torch.tanh(lin(x))
        return x


def _data(step: int, n: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, H, generator=g)


def _reference(layer_groups, steps=STEPS):
    """One process, whole batch: per group of layers a separate sum-of-squares loss (groups run
    on separate inputs when the layers are separable stages)."""
    model = _Chunk(range(LAYERS))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}], lr=LR
    )
    norms = []
    for step in range(steps):
        opt.zero_grad()
        loss = 0.0
        for gi, ids in enumerate(layer_groups):
            x = _data(step * 10 + gi, 2 * B)
            for i in ids:
                x = torch.tanh(model.layers[str(i)](x))
            loss = loss + x.square().sum()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _optimizer(chunks, distributed: bool):
    from megadlms.optimizer import OptimizerConfig, get_optimizer

    cfg = OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP, use_distributed_optimizer=distributed)
    return get_optimizer(cfg, chunks)


def _wrap(parts, groups, distributed):
    from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig, ModelChunks

    cfg = DistributedDataParallelConfig(calculate_per_token_loss=True, use_distributed_optimizer=distributed)
    return ModelChunks([DistributedDataParallel(p, cfg, parallel=groups) for p in parts])


def _two_chunks_dp2(rank, world):
    from megadlms.parallel import ParallelGroups

    groups = ParallelGroups.build()
    out = {}
    for distributed in (False, True):
        model = _wrap([_Chunk([0, 1]), _Chunk([2, 3])], groups, distributed)
        opt = _optimizer(model, distributed)
        norms = []
        for step in range(STEPS):
            opt.zero_grad()
            x = _data(step * 10, 2 * B)[rank * B : (rank + 1) * B]
            with model.no_sync():  # first half of the batch: no collective anywhere
                a, b = model.chunks
                b(a(x[: B // 2])).square().sum().backward()
            assert all(not bk.launched for bk in model.grad_buckets)
            b(a(x[B // 2 :])).square().sum().backward()
            model.finish_grad_sync()
            ok, norm = opt.step()
            assert ok
            norms.append(norm)
        buckets = [bk.index for bk in model.grad_buckets]
        out[distributed] = ({k: v.clone() for k, v in model.state_dict().items()}, norms, buckets)
    return out


def test_two_chunks_per_rank_match_one_process():
    ref, ref_norms = _reference([range(LAYERS)])
    for res in run_distributed(_two_chunks_dp2, world_size=2):
        for distributed, (state, norms, buckets) in res.items():
            assert sorted(state) == sorted(ref), "merged names are the full model's"
            assert buckets == [0, 0], "one bucket per chunk: indices are per chunk"
            assert norms == pytest.approx(ref_norms, rel=1e-5)
            for k in ref:
                torch.testing.assert_close(state[k], ref[k], atol=1e-5, rtol=1e-5, msg=f"{distributed} {k}")


def _two_stages_dp2(rank, world):
    from megadlms.parallel import ParallelGroups

    groups = ParallelGroups.build(pp=2)
    stage = groups.pp.rank
    out = {}
    for distributed in (False, True):
        part = _Chunk([0, 1] if stage == 0 else [2, 3])
        if stage == 1:  # a tied-embedding copy: trained, never in the norm
            part.copy = nn.Linear(H, H, bias=False)
            set_sharding(part.copy.weight, tied_copy=True)
        model = _wrap([part], groups, distributed)
        opt = _optimizer(model, distributed)
        norms = []
        for step in range(STEPS):
            opt.zero_grad()
            x = _data(step * 10 + stage, 2 * B)[groups.dp.rank * B : (groups.dp.rank + 1) * B]
            y = model.chunks[0](x)
            loss = y.square().sum()
            if stage == 1:
                loss = loss + 100.0 * part.copy(x).square().sum()  # a big gradient the norm must skip
            loss.backward()
            model.finish_grad_sync()
            ok, norm = opt.step()
            assert ok
            norms.append(norm)
        state = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("copy")}
        out[distributed] = (state, norms)
    return out


def test_two_stages_norm_spans_the_pipeline_and_skips_the_shared_copy():
    ref, ref_norms = _reference([[0, 1], [2, 3]])
    results = run_distributed(_two_stages_dp2, world_size=4)
    for rank, res in enumerate(results):
        for distributed, (state, norms) in res.items():
            assert norms == pytest.approx(ref_norms, rel=1e-5), f"rank {rank} {distributed}"
            for k, v in state.items():
                torch.testing.assert_close(v, ref[k], atol=1e-5, rtol=1e-5, msg=f"rank {rank} {k}")
