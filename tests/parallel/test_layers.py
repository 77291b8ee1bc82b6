"""TP layers and the vocab-parallel cross-entropy on 2 gloo ranks against their unsharded
torch counterparts (nn.Linear, nn.Embedding, F.cross_entropy): forward, input grads and
parameter grads within 1e-6 in fp32, with and without sequence parallelism.

One 2-rank job computes every comparison (a module fixture); each test asserts its own."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from megadlms.parallel import (
    ColumnParallelLinear,
    ParallelGroups,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    normal_init,
    vocab_parallel_cross_entropy,
)
from tests.dist_utils import run_distributed

B, S, IN, OUT, VOCAB, SEED = 2, 4, 8, 6, 10, 1234
TOL = 1e-6


def _gen(seed=SEED):
    return torch.Generator().manual_seed(seed)


def _diff(a, b):
    return (a.detach() - b.detach()).abs().max().item()


def _ref_linear():
    ref = nn.Linear(IN, OUT)
    normal_init()(ref.weight, _gen())  # the same draws the TP layers make for the full weight
    with torch.no_grad():
        ref.bias.copy_(torch.randn(OUT, generator=_gen(7)))
    return ref


def _column_case(rank, group, *, gather_output, sp):
    x = torch.randn(B, S, IN, generator=_gen(1), requires_grad=True)
    w_out = torch.randn(B, S, OUT, generator=_gen(2))
    ref = _ref_linear()
    y_ref = ref(x)
    (y_ref * w_out).sum().backward()

    layer = ColumnParallelLinear(
        IN, OUT, tp_group=group, gather_output=gather_output, sequence_parallel=sp, generator=_gen()
    )
    init_exact = torch.equal(layer.weight, ref.weight.detach().chunk(2, 0)[rank])
    with torch.no_grad():
        layer.bias.copy_(ref.bias.chunk(2, 0)[rank])
    x_in = (x.detach().chunk(2, 1)[rank] if sp else x.detach()).clone().requires_grad_()
    y = layer(x_in)
    y_expect = y_ref if gather_output else y_ref.chunk(2, -1)[rank]
    w = w_out if gather_output else w_out.chunk(2, -1)[rank]
    (y * w).sum().backward()
    x_grad_expect = x.grad.chunk(2, 1)[rank] if sp else x.grad
    return {
        "init_exact": init_exact,
        "out": _diff(y, y_expect),
        "x_grad": _diff(x_in.grad, x_grad_expect),
        "w_grad": _diff(layer.weight.grad, ref.weight.grad.chunk(2, 0)[rank]),
        "b_grad": _diff(layer.bias.grad, ref.bias.grad.chunk(2, 0)[rank]),
    }


def _row_case(rank, group, *, input_is_parallel, sp):
    x = torch.randn(B, S, IN, generator=_gen(3), requires_grad=True)
    w_out = torch.randn(B, S, OUT, generator=_gen(4))
    ref = _ref_linear()
    y_ref = ref(x)
    (y_ref * w_out).sum().backward()

    layer = RowParallelLinear(
        IN, OUT, tp_group=group, input_is_parallel=input_is_parallel, sequence_parallel=sp, generator=_gen()
    )
    init_exact = torch.equal(layer.weight, ref.weight.detach().chunk(2, 1)[rank])
    with torch.no_grad():
        layer.bias.copy_(ref.bias)
    x_in = (x.detach().chunk(2, -1)[rank] if input_is_parallel else x.detach()).clone().requires_grad_()
    y = layer(x_in)
    y_expect, w = (y_ref.chunk(2, 1)[rank], w_out.chunk(2, 1)[rank]) if sp else (y_ref, w_out)
    # Without sp every rank holds the full output and the same (replicated) loss, as in Megatron.
    (y * w).sum().backward()
    allreduce_sequence_parallel_grads(layer, group)
    x_grad_expect = x.grad.chunk(2, -1)[rank] if input_is_parallel else x.grad
    return {
        "init_exact": init_exact,
        "out": _diff(y, y_expect),
        "x_grad": _diff(x_in.grad, x_grad_expect),
        "w_grad": _diff(layer.weight.grad, ref.weight.grad.chunk(2, 1)[rank]),
        "b_grad": _diff(layer.bias.grad, ref.bias.grad),
    }


def _embedding_case(rank, group, *, sp):
    ids = torch.tensor([[0, 9, 4, 5], [7, 2, 5, 4]])  # both vocab halves, both boundaries
    w_out = torch.randn(B, S, IN, generator=_gen(5))
    ref = nn.Embedding(VOCAB, IN)
    normal_init()(ref.weight, _gen())
    y_ref = ref(ids)
    (y_ref * w_out).sum().backward()

    layer = VocabParallelEmbedding(VOCAB, IN, tp_group=group, sequence_parallel=sp, generator=_gen())
    init_exact = torch.equal(layer.weight, ref.weight.detach().chunk(2, 0)[rank])
    y = layer(ids)
    y_expect, w = (y_ref.chunk(2, 1)[rank], w_out.chunk(2, 1)[rank]) if sp else (y_ref, w_out)
    (y * w).sum().backward()
    w_grad_expect = ref.weight.grad.chunk(2, 0)[rank]
    return {
        "init_exact": init_exact,
        "out": _diff(y, y_expect),
        "w_grad": _diff(layer.weight.grad, w_grad_expect),
    }


def _cross_entropy_case(rank, group, *, scale):
    logits = (scale * torch.randn(B, S, VOCAB, generator=_gen(6))).requires_grad_()
    target = torch.tensor([[0, 9, 4, 5], [7, 2, 5, 4]])
    g = torch.rand(B, S, generator=_gen(8))
    ref = F.cross_entropy(logits.view(-1, VOCAB), target.view(-1), reduction="none").view(B, S)
    (ref * g).sum().backward()
    local = logits.detach().chunk(2, -1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, group)
    (loss * g).sum().backward()
    # Relative to the logit scale: fp32 rounding of |logits| ~ 50 is ~50x coarser.
    return {
        "loss": _diff(loss, ref) / scale,
        "logits_grad": _diff(local.grad, logits.grad.chunk(2, -1)[rank]),
    }


def _all_cases(rank, world):
    group = ParallelGroups.build(tp=2).tp.group
    out = {}
    for sp in (False, True):
        out[f"column_sp{sp}"] = _column_case(rank, group, gather_output=False, sp=sp)
        out[f"row_sp{sp}"] = _row_case(rank, group, input_is_parallel=True, sp=sp)
        out[f"embedding_sp{sp}"] = _embedding_case(rank, group, sp=sp)
    out["column_gather_output"] = _column_case(rank, group, gather_output=True, sp=False)
    out["row_input_not_parallel"] = _row_case(rank, group, input_is_parallel=False, sp=False)
    out["cross_entropy"] = _cross_entropy_case(rank, group, scale=1.0)
    out["cross_entropy_large_logits"] = _cross_entropy_case(rank, group, scale=50.0)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_cases, world_size=2, timeout=180)


def _assert_case(results, name):
    for rank, res in enumerate(results):
        case = res[name]
        if "init_exact" in case:
            assert case.pop("init_exact"), f"{name} rank {rank}: shard of the full init differs"
        for key, diff in case.items():
            assert diff <= TOL, f"{name} rank {rank}: {key} differs by {diff}"


@pytest.mark.parametrize("sp", [False, True])
def test_column_parallel_linear(results, sp):
    _assert_case(results, f"column_sp{sp}")


def test_column_parallel_linear_gather_output(results):
    _assert_case(results, "column_gather_output")


@pytest.mark.parametrize("sp", [False, True])
def test_row_parallel_linear(results, sp):
    _assert_case(results, f"row_sp{sp}")


def test_row_parallel_linear_input_not_parallel(results):
    _assert_case(results, "row_input_not_parallel")


@pytest.mark.parametrize("sp", [False, True])
def test_vocab_parallel_embedding(results, sp):
    _assert_case(results, f"embedding_sp{sp}")


@pytest.mark.parametrize("case", ["cross_entropy", "cross_entropy_large_logits"])
def test_vocab_parallel_cross_entropy(results, case):
    _assert_case(results, case)


def test_single_process_layers_equal_torch():
    # tp_group=None: the plain computation, and the same init as the full layer.
    ref = _ref_linear()
    col = ColumnParallelLinear(IN, OUT, tp_group=None, generator=_gen())
    row = RowParallelLinear(IN, OUT, tp_group=None, generator=_gen())
    emb = VocabParallelEmbedding(VOCAB, IN, tp_group=None, generator=_gen())
    assert torch.equal(col.weight, ref.weight) and torch.equal(row.weight, ref.weight)
    assert torch.equal(emb.weight, _ref_embedding_weight())
    x = torch.randn(B, S, IN, generator=_gen(1))
    with torch.no_grad():
        col.bias.copy_(ref.bias)
    assert _diff(col(x), ref(x)) == 0.0
    logits, target = (
        torch.randn(B, S, VOCAB, generator=_gen(6)),
        torch.randint(0, VOCAB, (B, S), generator=_gen(9)),
    )
    expect = F.cross_entropy(logits.view(-1, VOCAB), target.view(-1), reduction="none").view(B, S)
    assert _diff(vocab_parallel_cross_entropy(logits, target, None), expect) <= TOL


def _ref_embedding_weight():
    w = torch.empty(VOCAB, IN)
    normal_init()(w, _gen())
    return w


def test_layer_errors():
    with pytest.raises(ValueError, match="gather_output=True cannot be combined with sequence_parallel"):
        ColumnParallelLinear(IN, OUT, tp_group=None, gather_output=True, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel=True needs input_is_parallel=True"):
        RowParallelLinear(IN, OUT, tp_group=None, input_is_parallel=False, sequence_parallel=True)
    with pytest.raises(ValueError, match="need target of shape"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long), None)
