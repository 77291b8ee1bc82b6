"""MoE router: top-k routing, capacity dropping and the aux losses against hand-written
references (plain Python loops over tokens and experts), and the config rules."""

from __future__ import annotations

import math

import pytest
import torch

from megadlms.common.errors import ConfigError
from megadlms.models import GPTModel, TransformerConfig
from megadlms.models.config import tensor_parallel_problems
from megadlms.models.moe.router import (
    AuxLossAutoScaler,
    TopKRouter,
    aux_loss_scores,
    expert_capacity,
    switch_load_balancing_loss,
    topk_routing,
    z_loss,
)
from megadlms.parallel.sharding import ParamSharding, sharding_of


def _logits(T=12, E=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, E, generator=g)


def _ref_topk(logits, k, score, pre_softmax):
    """Per token: the k experts and their weights, computed with Python lists."""
    out = []
    for row in logits.tolist():
        idx = sorted(range(len(row)), key=lambda e: -row[e])[:k]
        if score == "softmax" and pre_softmax:
            z = sum(math.exp(v) for v in row)
            w = {e: math.exp(row[e]) / z for e in idx}
        elif score == "softmax":
            z = sum(math.exp(row[e]) for e in idx)
            w = {e: math.exp(row[e]) / z for e in idx}
        else:
            s = {e: 1 / (1 + math.exp(-row[e])) for e in idx}
            tot = sum(s.values()) if k > 1 else 1.0
            w = {e: s[e] / tot for e in idx}
        out.append(w)
    return out


@pytest.mark.parametrize(
    "score,pre_softmax,k",
    [("softmax", False, 2), ("softmax", True, 2), ("sigmoid", False, 2), ("sigmoid", False, 1)],
)
def test_topk_matches_reference(score, pre_softmax, k):
    logits = _logits()
    r = topk_routing(logits, k, score_function=score, pre_softmax=pre_softmax)
    ref = _ref_topk(logits, k, score, pre_softmax)
    for t, w in enumerate(ref):
        assert set(r.routing_map_TE[t].nonzero().flatten().tolist()) == set(w)
        for e in range(logits.shape[1]):
            assert r.probs_TE[t, e].item() == pytest.approx(w.get(e, 0.0), abs=1e-6)
    counts = [sum(e in w for w in ref) for e in range(logits.shape[1])]
    assert r.tokens_per_expert_E.tolist() == counts


def _ref_capacity(ref, E, capacity, policy, pad):
    """Each expert keeps ``capacity`` tokens: the highest weights (earlier token on ties) or the
    earliest routed ones; with ``pad`` it is filled up with unrouted tokens (weight 0)."""
    keep = {}
    T = len(ref)
    for e in range(E):
        routed = [t for t in range(T) if e in ref[t]]
        if policy == "probs":
            order = sorted(range(T), key=lambda t: (-ref[t].get(e, 0.0), t))
        else:
            order = routed + [t for t in range(T) if t not in routed]
        chosen = order[:capacity]
        keep[e] = set(chosen) if pad else set(chosen) & set(routed)
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_capacity_dropping_matches_reference(policy, pad):
    T, E, k, factor = 16, 4, 2, 0.75
    logits = _logits(T, E, seed=3)
    r = topk_routing(logits, k, capacity_factor=factor, drop_policy=policy, pad_to_capacity=pad)
    capacity = math.ceil(T * k / E * factor)
    assert expert_capacity(T, E, k, factor) == capacity == 6
    ref = _ref_topk(logits, k, "softmax", False)
    keep = _ref_capacity(ref, E, capacity, policy, pad)
    for e in range(E):
        got = set(r.routing_map_TE[:, e].nonzero().flatten().tolist())
        assert got == keep[e], (e, got, keep[e])
        for t in range(T):
            want = ref[t].get(e, 0.0) if t in keep[e] else 0.0
            assert r.probs_TE[t, e].item() == pytest.approx(want, abs=1e-6)
        if pad:
            assert len(got) == capacity
    # the aux loss sees the tokens chosen before dropping
    assert r.tokens_per_expert_E.tolist() == [sum(e in w for w in ref) for e in range(E)]
    assert sum(len(v) for v in keep.values()) < T * k or pad  # something was dropped


def test_dropless_keeps_everything_and_large_capacity_is_dropless():
    logits = _logits(10, 4)
    free = topk_routing(logits, 2)
    big = topk_routing(logits, 2, capacity_factor=10.0)
    assert torch.equal(free.routing_map_TE, big.routing_map_TE)
    assert torch.equal(free.probs_TE, big.probs_TE)
    assert int(free.routing_map_TE.sum()) == 20


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_loss_formula(score):
    T, E, k, coeff = 12, 6, 2, 0.01
    logits = _logits(T, E, seed=5)
    r = topk_routing(logits, k, score_function=score)
    scores = aux_loss_scores(logits, score)
    got = switch_load_balancing_loss(scores, r.tokens_per_expert_E, k, coeff)
    rows = logits.tolist()
    total = 0.0
    for e in range(E):
        if score == "softmax":
            p_e = sum(math.exp(row[e]) / sum(math.exp(v) for v in row) for row in rows)
        else:
            sig = [[1 / (1 + math.exp(-v)) for v in row] for row in rows]
            p_e = sum(s[e] / sum(s) for s in sig)
        total += p_e * int(r.tokens_per_expert_E[e])
    assert got.item() == pytest.approx(E * coeff / (k * T * T) * total, rel=1e-5)
    # balanced routing with uniform scores gives coeff exactly (the Switch normalisation)
    uniform = torch.full((8, 4), 0.25)
    assert switch_load_balancing_loss(uniform, torch.full((4,), 4), 2, 0.1).item() == pytest.approx(0.1)


def test_z_loss_formula():
    logits = _logits(7, 5, seed=2)
    want = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 7 * 0.003
    assert z_loss(logits, 0.003).item() == pytest.approx(want, rel=1e-5)


def test_aux_loss_autoscaler_backward():
    """The activation's value is unchanged; its backward adds ``scale * d(aux)``."""
    x = torch.randn(5, 3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    aux = (w**2).sum()
    y = AuxLossAutoScaler.apply(x * 2, aux, 0.25)
    assert torch.equal(y, x * 2)
    y.sum().backward()
    assert torch.allclose(w.grad, 0.25 * 2 * w)
    assert torch.allclose(x.grad, torch.full_like(x, 2.0))


def _config(**kw):
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=32, seq_length=8)
    base.update(kw)
    return TransformerConfig(**base)


def test_router_grad_equals_scaled_loss_grads():
    """Router backward: d(main) + scale * d(aux + z), checked against losses added explicitly."""
    c = _config(num_moe_experts=4, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    router = TopKRouter(c)
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))
    out = router(x, aux_loss_scale=0.5)
    (out.routing.probs_TE * torch.arange(4.0)).sum().backward()
    got = router.weight.grad.clone()
    router.weight.grad = None
    logits = x @ router.weight.t()
    r = topk_routing(logits, 2)
    aux = switch_load_balancing_loss(torch.softmax(logits, -1), r.tokens_per_expert_E, 2, 0.1)
    total = (r.probs_TE * torch.arange(4.0)).sum() + 0.5 * (aux + z_loss(logits, 0.01))
    total.backward()
    assert torch.allclose(got, router.weight.grad, atol=1e-6)
    assert out.aux_loss.item() == pytest.approx(aux.item())


def test_moe_config_rules_name_fields():
    with pytest.raises(ConfigError) as exc:
        _config(
            num_moe_experts=4,
            moe_router_topk=5,
            moe_router_score_function="relu",
            moe_layer_freq=[1, 0, 1],
            moe_pad_expert_input_to_capacity=True,
        )
    text = str(exc.value)
    for name in (
        "moe_router_topk",
        "moe_router_score_function",
        "moe_layer_freq",
        "moe_pad_expert_input_to_capacity",
    ):
        assert name in text
    c = _config(num_moe_experts=4, moe_layer_freq=2, ffn_hidden_size=24)
    assert c.moe_ffn_hidden_size == 24
    assert [c.is_moe_layer(i) for i in range(2)] == [True, False]
    assert [_config(num_moe_experts=4, moe_layer_freq=[0, 1]).is_moe_layer(i) for i in range(2)] == [
        False,
        True,
    ]
    assert not _config().is_moe_layer(0)
    (problem,) = tensor_parallel_problems(c, 2)
    assert "num_moe_experts" in problem and "tensor_model_parallel_size" in problem


def test_moe_layer_freq_builds_dense_and_moe_layers_and_roundtrips():
    c = _config(num_moe_experts=4, moe_layer_freq=[0, 1])
    model = GPTModel(c)
    names = dict(model.named_parameters())
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names
    assert names["decoder.layers.1.mlp.experts.linear_fc1.weight"].shape == (4, 4 * 16, 16)
    w = names["decoder.layers.1.mlp.experts.linear_fc2.weight"]
    assert sharding_of(w) == ParamSharding(expert_dim=0)
    assert TransformerConfig.from_dict(c.to_dict()) == c


def test_flops_count_the_routed_and_shared_experts():
    """An MoE layer costs k experts + the shared expert per token: the dense model with that
    MLP width has the same FLOPs; a dense layer of moe_layer_freq keeps its own width."""
    from megadlms.models import num_floating_point_operations as flops

    moe = _config(
        num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=12, moe_shared_expert_intermediate_size=8
    )
    assert flops(moe, 2, 8) == flops(_config(ffn_hidden_size=2 * 12 + 8), 2, 8)
    half = _config(num_moe_experts=8, moe_ffn_hidden_size=12, moe_layer_freq=[1, 0], ffn_hidden_size=40)
    both = [flops(_config(ffn_hidden_size=w), 2, 8) for w in (24, 40)]
    assert flops(half, 2, 8) == pytest.approx(sum(both) / 2)
