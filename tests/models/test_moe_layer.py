"""MoELayer under expert parallelism (gloo, CPU): ep = 2 and 4 against one process holding
every expert, both dispatchers, dropless and with token dropping; the dispatchers' round
trip is exact; an expert without tokens; determinism. Each rank has its own tokens (its
micro-batch); the one-process reference runs the ep = 1 layer on every rank's tokens."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megadlms.models import TransformerConfig
from megadlms.models.moe import MoELayer, build_dispatcher
from megadlms.models.transformer import MLP
from megadlms.parallel.sharding import sharding_of
from tests.dist_utils import run_distributed

H, E, T = 8, 8, 12


def _config(**kw) -> TransformerConfig:
    base = dict(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=2,
        vocab_size=16,
        seq_length=T,
        num_moe_experts=E,
        ffn_hidden_size=16,
        moe_ffn_hidden_size=6,
        moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=0.001,
        swiglu=True,
    )
    base.update(kw)
    return TransformerConfig(**base)


def _layer(config, group=None, shared=False) -> MoELayer:
    torch.manual_seed(0)
    shared_mlp = None
    if shared:
        shared_mlp = MLP(TransformerConfig(**{**_base_fields(config), "ffn_hidden_size": 4}))
    layer = MoELayer(config, expert_group=group, shared_experts=shared_mlp)
    torch.manual_seed(1)
    layer.init_weights(0.3, 0.2, lambda p, s: nn.init.normal_(p, std=s))
    return layer


def _base_fields(config):
    keys = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length", "swiglu")  # dense
    return {k: getattr(config, k) for k in keys}


def _inputs(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, T // 2, H, generator=g)
    return x, torch.randn(2, T // 2, H, generator=g)  # input, output cotangent


def _run(layer, x, cot):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    (out * cot).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _reference(config, world, shared):
    """ep = 1 on every rank's tokens: outputs and input grads per rank, parameter grads summed."""
    layer = _layer(config, shared=shared)
    outs, xgrads, total = [], [], None
    for r in range(world):
        out, xg, grads = _run(layer, *_inputs(r))
        layer.zero_grad()
        outs.append(out)
        xgrads.append(xg)
        total = grads if total is None else {n: total[n] + g for n, g in grads.items()}
    return layer, outs, xgrads, total


CASES = [
    dict(moe_token_dispatcher_type=kind, **drop)
    for kind in ("allgather", "alltoall")
    for drop in (
        {},
        {"moe_expert_capacity_factor": 1.0},
        {"moe_expert_capacity_factor": 0.5, "moe_token_drop_policy": "position"},
        {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True},
    )
]


def _close(got, want, what):
    """1e-6 relative to the tensor's scale: the fp32 rounding of sums taken in another order
    (rows of every rank in one grouped GEMM vs one rank at a time)."""
    scale = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got, want, atol=1e-6 * scale, rtol=1e-6, msg=what)


def _check_case(rank, world, group, fields, shared):
    config = _config(**fields)
    ref_layer, ref_outs, ref_xgrads, ref_grads = _reference(config, world, shared)
    layer = _layer(config, group, shared=shared)
    El = E // world
    lo = rank * El
    full = dict(ref_layer.named_parameters())
    for name, p in layer.named_parameters():  # layout-independent init
        want = full[name][lo : lo + El] if sharding_of(p).expert_dim is not None else full[name]
        assert torch.equal(p.detach(), want.detach()), name
    out, xgrad, grads = _run(layer, *_inputs(rank))
    _close(out, ref_outs[rank], "output")
    _close(xgrad, ref_xgrads[rank], "input grad")
    for name, p in layer.named_parameters():
        g = grads[name]
        if sharding_of(p).expert_dim is not None:
            want = ref_grads[name][lo : lo + El]  # the experts saw every rank's tokens
        else:
            dist.all_reduce(g, group=group)  # replicated: summed over the ranks (DDP's job)
            want = ref_grads[name]
        _close(g, want, f"{fields} {name}")


def _round_trip(rank, world, group, kind):
    """top-1 with weight 1 and identity experts: combine(dispatch(x)) is x bit for bit, and
    rank e's rows are exactly every rank's tokens of its experts (expert, source rank, token)."""
    xs = [torch.randn(9 + r, H, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    maps = []
    for r, x in enumerate(xs):
        expert = torch.randint(0, E, (x.shape[0],), generator=torch.Generator().manual_seed(50 + r))
        maps.append(nn.functional.one_hot(expert, E).bool())
    d = build_dispatcher(kind, E, group)
    rows, counts, handle = d.dispatch(xs[rank], maps[rank].float(), maps[rank])
    El = E // world
    want, want_counts = [], []
    for e in range(rank * El, (rank + 1) * El):
        picked = [x[m[:, e]] for x, m in zip(xs, maps)]
        want.append(torch.cat(picked))
        want_counts.append(sum(len(p) for p in picked))
    assert torch.equal(rows, torch.cat(want))
    assert counts.tolist() == want_counts
    assert torch.equal(d.combine(rows, handle), xs[rank])


def _empty_expert(rank, world, group, kind):
    """Expert 0 gets no token anywhere: every rank still finishes (no hang), its grads are 0,
    and the result equals the one-process reference."""
    config = _config(moe_token_dispatcher_type=kind, moe_router_topk=2)
    layer = _layer(config, group)
    ref = _layer(config)
    for lay in (layer, ref):
        with torch.no_grad():
            lay.router.weight[0] = -100.0  # logits of expert 0: -100 * sum(x) with x > 0 below
    x = _inputs(rank)[0].abs() + 0.1
    cot = _inputs(rank)[1]
    out, _, grads = _run(layer, x, cot)
    ref_out, _, ref_grads = _run(ref, x, cot)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    tokens = layer.stats_tensors()[1].clone()
    dist.all_reduce(tokens, group=group)
    assert tokens[0] == 0 and tokens.sum() == 2 * T // 2 * 2 * world
    if rank == 0:  # rank 0 holds expert 0
        for name in ("experts.linear_fc1.weight", "experts.linear_fc2.weight"):
            assert torch.count_nonzero(grads[name][0]) == 0
            assert torch.count_nonzero(grads[name][1:]) > 0


def _determinism(rank, world, group):
    config = _config(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.0)
    runs = []
    for _ in range(2):
        layer = _layer(config, group)
        x, cot = _inputs(rank)
        out, xg, grads = _run(layer, x, cot)
        routing = layer.router(x.reshape(-1, H)).routing.routing_map_TE
        runs.append((out, xg, routing, grads))
    a, b = runs
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    assert all(torch.equal(a[3][n], b[3][n]) for n in a[3])


def _all_cases(rank, world):
    group = dist.new_group(list(range(world)))
    for i, fields in enumerate(CASES):
        _check_case(rank, world, group, fields, shared=i == 0)
    for kind in ("allgather", "alltoall"):
        _round_trip(rank, world, group, kind)
        _empty_expert(rank, world, group, kind)
    _determinism(rank, world, group)
    return True


@pytest.mark.parametrize("ep", [2, 4])
def test_moe_layer_expert_parallel_matches_one_process(ep):
    assert run_distributed(_all_cases, world_size=ep, timeout=600) == [True] * ep


def test_one_process_dispatchers_agree():
    """At ep = 1 both dispatchers are the same local permutation: bitwise equal results."""
    results = []
    for kind in ("allgather", "alltoall"):
        config = _config(moe_token_dispatcher_type=kind)
        results.append(_run(_layer(config), *_inputs(0)))
    (oa, xa, ga), (ob, xb, gb) = results
    assert torch.equal(oa, ob) and torch.equal(xa, xb)
    assert all(torch.equal(ga[n], gb[n]) for n in ga)
