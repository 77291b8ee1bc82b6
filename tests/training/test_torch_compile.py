"""--use-torch-compile through the real trainer (``megadlms.pretrain.run``, gloo, CPU inductor):
each transformer layer compiled, the loss and grad-norm curves those of the eager run within
float tolerance, with DDP (the default), FSDP2 and selective / full recompute on one rank, and
tensor + sequence parallelism on two (with gradient-accumulation fusion, whose linears run
eagerly between the compiled pieces, and without it, where the layer is one graph holding the
TP collectives). Dropout is 0: inductor draws its own random numbers, so dropout masks differ
from eager."""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed

TINY = (
    "--difflm-objective llada --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 3e-3 --seed 7 --attention-dropout 0 "
    "--hidden-dropout 0 --mock-data --num-workers 0 --log-interval 1 --eval-interval 100 --eval-iters 0"
).split()
FSDP2 = "--use-torch-fsdp2 --untie-embeddings-and-output-weights --no-gradient-accumulation-fusion".split()
FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()
CASES = {
    "ddp": [],
    "ddp_full_recompute": FULL,
    "fsdp2_selective_recompute": [*FSDP2, "--recompute-activations"],
}


def _job(rank, world):
    from megadlms.models.compile import compile_seconds
    from megadlms.pretrain import run

    out = {}
    for name, flags in CASES.items():
        eager, compiled = run(TINY + flags), run(TINY + flags + ["--use-torch-compile"])
        out[name] = [(dict(r.losses), dict(r.grad_norms)) for r in (eager, compiled)]
    out["compile_seconds"] = compile_seconds()
    return out


TP = "--tensor-model-parallel-size 2 --sequence-parallel".split()
# dp2 first: the tp2 runs then recompile the same layer code for half the heads, with dynamic
# ints (the recompile that once turned the attention's GQA switch into a SymBool graph break).
TP_CASES = {"dp2": [], "tp2_sp": TP, "tp2_sp_unfused": [*TP, "--no-gradient-accumulation-fusion"]}


def _tp_job(rank, world):
    from torch._dynamo.utils import counters

    from megadlms.pretrain import run

    out = {}
    for name, flags in TP_CASES.items():
        counters.clear()
        eager, compiled = run(TINY + flags), run(TINY + flags + ["--use-torch-compile"])
        out[name] = [(dict(r.losses), dict(r.grad_norms)) for r in (eager, compiled)]
        out[name + "_graph_breaks"] = list(counters["graph_break"])  # one reason text per kind
    return out


@pytest.fixture(scope="module")
def curves():
    return run_distributed(_job, 1, timeout=900)[0]


@pytest.fixture(scope="module")
def tp_curves():
    return run_distributed(_tp_job, 2, timeout=900)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_curves_match_eager(curves, case):
    (losses, norms), (c_losses, c_norms) = curves[case]
    assert sorted(losses) == sorted(c_losses) == [1, 2, 3]
    assert losses == pytest.approx(c_losses, rel=1e-5), (losses, c_losses)
    assert norms == pytest.approx(c_norms, rel=1e-4), (norms, c_norms)


def test_the_layers_were_compiled(curves):
    assert curves["compile_seconds"] > 0  # dynamo + inductor ran (not an eager fallback)


@pytest.mark.parametrize("case", list(TP_CASES))
def test_compiled_tensor_parallel_curves_match_eager(tp_curves, case):
    (losses, norms), (c_losses, c_norms) = tp_curves[case]
    assert sorted(losses) == sorted(c_losses) == [1, 2, 3]
    assert losses == pytest.approx(c_losses, rel=1e-5), (losses, c_losses)
    assert norms == pytest.approx(c_norms, rel=1e-4), (norms, c_norms)


def test_only_the_fused_linears_split_a_compiled_layer(tp_curves):
    # Without fusion the TP layer (its collectives included) compiles as one graph; with it each
    # fused linear is a deliberate split (parallel/linear_impl.py), nothing else breaks the graph.
    assert tp_curves["tp2_sp_unfused_graph_breaks"] == []
    reasons = tp_curves["tp2_sp_graph_breaks"]
    assert reasons and all("_fused_linear" in r for r in reasons), "\n---\n".join(reasons)
