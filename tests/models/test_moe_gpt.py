"""GPTModel with MoE layers: 4 gloo ranks at ep = 2 x dp = 4 (expert-dp 2), two micro-batches
each, give the same total loss (token loss + aux losses) and gradients as one process running
the same 8 micro-batches (plain autograd; the dense grads summed over the world, the expert
grads over the expert-data-parallel group, as DDP does in sum mode). Megatron's dropout 0.1
runs too."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megadlms.models import GPTModel, TransformerConfig
from megadlms.models.config import expert_parallel_problems
from megadlms.models.moe import moe_layer_stats, set_moe_aux_loss_scale
from megadlms.parallel import ParallelGroups, TensorParallelContext
from megadlms.parallel.sharding import gather_full, sharding_of
from tests.dist_utils import run_distributed

WORLD, EP, MICRO = 4, 2, 2  # micro-batches per rank
V, S = 32, 8
NUM_MICRO = WORLD * MICRO


def _config(dropout=0.0, **kw) -> TransformerConfig:
    base = dict(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        vocab_size=V,
        seq_length=S,
        ffn_hidden_size=32,
        num_moe_experts=4,
        moe_ffn_hidden_size=12,
        moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=0.001,
        attention_dropout=dropout,
        hidden_dropout=dropout,
    )
    base.update(kw)
    return TransformerConfig(**base)


CONFIGS = {
    "alltoall_dropping_shared": dict(
        moe_token_dispatcher_type="alltoall",
        moe_expert_capacity_factor=1.0,
        moe_shared_expert_intermediate_size=8,
        swiglu=True,
    ),
    "allgather_dropless_sigmoid": dict(
        moe_token_dispatcher_type="allgather", moe_router_score_function="sigmoid", moe_layer_freq=[0, 1]
    ),
}


def _micro_batch(index):
    g = torch.Generator().manual_seed(1000 + index)
    return torch.randint(0, V, (1, S), generator=g), torch.randint(0, V, (1, S), generator=g)


def _steps(model, indices):
    """Forward/backward of the micro-batches ``indices``; returns the summed token loss / N."""
    set_moe_aux_loss_scale(model, 1.0 / NUM_MICRO)  # once per step: 1 / micro-batches in the global batch
    n_tokens = NUM_MICRO * S
    total = 0.0
    for i in indices:
        ids, target = _micro_batch(i)
        logits = model(ids)
        loss = F.cross_entropy(logits.reshape(-1, V).float(), target.reshape(-1), reduction="sum") / n_tokens
        loss.backward()
        total += loss.item()
    return total


def _reference(fields):
    torch.manual_seed(7)
    model = GPTModel(_config(**fields))
    loss = _steps(model, range(NUM_MICRO))
    stats = moe_layer_stats(model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return loss + stats["aux_loss"] + stats["z_loss"], grads, params, stats


def _rank(rank, world, fields_by_name):
    groups = ParallelGroups.build(ep=EP, dp=WORLD)
    ctx = TensorParallelContext(expert_group=groups.ep.group)
    out = {}
    for name, fields in fields_by_name.items():
        torch.manual_seed(7)
        model = GPTModel(_config(**fields), tp=ctx)
        local = torch.tensor(_steps(model, range(rank * MICRO, (rank + 1) * MICRO)), dtype=torch.float64)
        dist.all_reduce(local)
        stats = moe_layer_stats(model, reduce=True)
        grads, params = {}, {}
        for n, p in model.named_parameters():
            g = p.grad.clone()
            if sharding_of(p).expert_dim is not None:
                dist.all_reduce(g, group=groups.expert_dp.group)
                g = gather_full(g, groups.ep.group, partition_dim=0)
                params[n] = gather_full(p.detach(), groups.ep.group, partition_dim=0)
            else:
                dist.all_reduce(g)
                params[n] = p.detach().clone()
            grads[n] = g
        out[name] = (local.item() + stats["aux_loss"] + stats["z_loss"], grads, params, stats)
    # Megatron's dropout 0.1: a training step runs at this layout (the masks differ per rank)
    torch.manual_seed(7)
    model = GPTModel(_config(dropout=0.1, **CONFIGS["alltoall_dropping_shared"]), tp=ctx)
    model.train()
    loss = _steps(model, range(rank * MICRO, (rank + 1) * MICRO))
    stats = moe_layer_stats(model, reduce=True, reset=True)
    finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
    out["dropout"] = (loss, finite, stats)
    return out


@pytest.fixture(scope="module")
def distributed():
    return run_distributed(_rank, world_size=WORLD, args=(CONFIGS,), timeout=600)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpt_moe_ep2_dp4_matches_one_process(distributed, name):
    ref_loss, ref_grads, ref_params, ref_stats = _reference(CONFIGS[name])
    for rank in range(WORLD):
        loss, grads, params, stats = distributed[rank][name]
        assert loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-7)
        assert stats["layers"].keys() == ref_stats["layers"].keys()
        for layer, s in stats["layers"].items():
            assert s["tokens_per_expert"] == ref_stats["layers"][layer]["tokens_per_expert"]
            assert s["forwards"] == NUM_MICRO
        for n in ref_grads:
            assert torch.equal(params[n], ref_params[n]), n  # layout-independent init
            torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-6, rtol=1e-5, msg=n)
    assert ref_stats["aux_loss"] > 0 and ref_stats["z_loss"] > 0


def test_gpt_moe_with_dropout_runs(distributed):
    for rank in range(WORLD):
        loss, finite, stats = distributed[rank]["dropout"]
        assert loss > 0 and finite
        assert stats["aux_loss"] > 0 and stats["max_over_mean"] >= 1.0
        assert all(s["forwards"] == NUM_MICRO for s in stats["layers"].values())


def test_expert_parallel_rules_name_fields():
    (problem,) = expert_parallel_problems(_config(), 3)
    assert "num_moe_experts 4" in problem and "expert_model_parallel_size 3" in problem
    dense = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=V, seq_length=S)
    (problem,) = expert_parallel_problems(dense, 2)
    assert "num_moe_experts" in problem
    assert expert_parallel_problems(_config(), 2) == [] and expert_parallel_problems(dense, 1) == []
