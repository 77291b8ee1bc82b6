"""Activation recomputation on one process (tp1): with Megatron's dropout 0.1 (attention
dropout through the model-parallel tracker, hidden dropout through the default generator)
full-uniform, full-block and selective recomputation give BITWISE the losses and gradients
of no recomputation over two accumulated micro-batches, and leave every RNG stream where it
would be; without the RNG replay the gradients differ (the check sees the masks). The MoE
layers' logging sums are not counted twice. What autograd saves per layer shrinks in the
order none > selective > full, full keeping only the layer input, and the benchmark's
fitted formula (benchmarks/activation_memory.py) reproduces a measurement it was not fitted
on. Megatron's flag rules name the flags, and the model's guard raises the same rule."""

from __future__ import annotations

import shlex

import pytest
import torch

import megadlms.models.recompute as recompute
from benchmarks.activation_memory import fit_formula, formula_bytes, per_layer_bytes
from megadlms.config import parse_config
from megadlms.models import GPTModel, TransformerConfig
from megadlms.parallel import TensorParallelContext, model_parallel_manual_seed

V, S, B = 64, 16, 2
VARIANTS = {
    "full_uniform_1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_uniform_2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full_block_2": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "selective": dict(recompute_granularity="selective"),
}
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)


def _train(extra=None, **recompute_fields):
    """Two accumulated micro-batches (train mode, dropout 0.1): losses, grads, RNG states."""
    cfg = TransformerConfig(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=V,
        seq_length=S,
        position_embedding_type="rope",
        **(extra or {}),
        **recompute_fields,
    )
    tracker = model_parallel_manual_seed(11, 0)
    model = GPTModel(cfg, tp=TensorParallelContext(rng_tracker=tracker)).train()
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):
        ids = torch.randint(0, V, (B, S), generator=g)
        loss = model(ids, torch.arange(S).expand(B, S)).float().square().mean()
        loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    rng = (torch.get_rng_state(), tracker.get_states())
    stats = [m.stats_tensors() for m in model.modules() if hasattr(m, "stats_tensors")]
    return losses, grads, rng, stats


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference():
    return _train()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_recompute_is_bitwise_with_dropout(reference, name):
    losses, grads, rng, _ = _train(**VARIANTS[name])
    ref_losses, ref_grads, ref_rng, _ = reference
    assert not torch.equal(ref_losses[0], ref_losses[1])
    assert _same(losses, ref_losses)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[k], ref_grads[k]) for k in grads)
    assert torch.equal(rng[0], ref_rng[0])
    assert _same(list(rng[1].values()), list(ref_rng[1].values()))


def test_without_rng_replay_the_grads_differ(reference, monkeypatch):
    monkeypatch.setattr(recompute, "set_all_rng_states", lambda states, tracker: None)
    for name in ("full_uniform_1", "selective"):
        _, grads, _, _ = _train(**VARIANTS[name])
        assert any(not torch.equal(grads[k], reference[1][k]) for k in grads), name


def test_moe_with_recompute_is_bitwise_and_counts_stats_once():
    ref = _train(MOE)
    got = _train(MOE, **VARIANTS["full_uniform_1"])
    assert _same(got[0], ref[0]) and all(torch.equal(got[1][k], ref[1][k]) for k in ref[1])
    assert ref[3] and all(_same(a, b) for a, b in zip(got[3], ref[3]))
    assert ref[3][0][0][2].item() == 2  # two forwards recorded, not four


def test_saved_activation_bytes_shrink_and_the_formula_fits():
    h, a, f, s = 64, 4, 64, 96  # not among the fitted shapes
    got = {
        lever: per_layer_bytes(h, a, f, s, lever, torch.bfloat16, 0.1)
        for lever in ("none", "selective", "full")
    }
    assert got["none"] > got["selective"] > got["full"] == s * h * 2  # full: the bf16 layer input
    coef, residual = fit_formula("none", torch.bfloat16, 0.1)
    assert residual < 1e-3 and round(formula_bytes(coef, h, a, f, s)) == got["none"]  # exact counts


BASE = shlex.split(
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --mock-data "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3"
)
FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
RULES = [
    (
        "--recompute-granularity full",
        1,
        "--recompute-granularity full needs --recompute-method uniform or block",
    ),
    (
        "--recompute-granularity full --recompute-method block",
        1,
        "needs --recompute-num-layers between 1 and",
    ),
    (
        "--recompute-granularity full --recompute-method block --recompute-num-layers 3 "
        "--pipeline-model-parallel-size 2",
        2,
        "layers per pipeline stage, 2 (got 3)",
    ),
    ("--recompute-granularity selective --recompute-method uniform", 1, "drop --recompute-method"),
    ("--recompute-activations --recompute-num-layers 2", 1, "--recompute-granularity selective takes no"),
    (f"{FULL} --distribute-saved-activations", 1, "needs --tensor-model-parallel-size > 1 (got 1)"),
    (
        "--distribute-saved-activations --tensor-model-parallel-size 2",
        2,
        "needs --recompute-granularity full",
    ),
    (
        f"{FULL} --distribute-saved-activations --tensor-model-parallel-size 2 --sequence-parallel",
        2,
        "--distribute-saved-activations cannot be used with --sequence-parallel",
    ),
]


@pytest.mark.parametrize("flags,world,needle", RULES)
def test_rules_name_the_flags(flags, world, needle):
    with pytest.raises(ValueError, match="invalid arguments") as err:
        parse_config(BASE + flags.split(), world_size=world)
    assert needle in str(err.value), str(err.value)


def test_valid_commands_and_the_alias():
    cfg = parse_config(BASE + ["--recompute-activations"], world_size=1).model
    assert cfg.recompute_granularity == "selective"
    cfg = parse_config(
        BASE + f"{FULL} --distribute-saved-activations --tensor-model-parallel-size 2".split(), world_size=2
    )
    assert (
        cfg.model.recompute_method,
        cfg.model.recompute_num_layers,
        cfg.model.distribute_saved_activations,
    ) == (
        "uniform",
        1,
        True,
    )


def test_model_guard_states_the_same_rule():
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=V,
        seq_length=S,
        recompute_granularity="full",
    )
    with pytest.raises(
        ValueError, match="recompute_granularity full needs recompute_method uniform or block"
    ):
        GPTModel(cfg)
