"""The model's fused elementwise paths (megadlms/ops: rotary embedding, SwiGLU, residual add +
RMSNorm) against the unfused torch ops they replace.

The device rule: on CPU the model runs the unfused ops whatever the flags say (bitwise the same
run; the fused kernels are never called). Forced onto CPU with ``fused_kernels_on_cpu()``, each
autograd Function matches the unfused ops -- forward outputs and every gradient, fp32 within
1e-6, bf16/fp16 by the dtype's epsilon (tests/ext/fused_helpers.py) -- on the strided q/k views
SelfAttention hands it; the whole model matches too (RoPE, GQA, QK-layernorm, SwiGLU, RMSNorm;
dense and MoE), dropout masks are unchanged, activation recomputation (full and selective)
reproduces the fused forward bitwise, a LayerNorm model stays unfused, parameter names are
unchanged. On 2 gloo ranks: tensor + sequence parallelism (the norm weights' partial gradients
declared as before), FSDP2 in fp32 and with a bf16 policy, and a DTensor norm weight.
Pipeline parallelism runs these same TransformerLayer modules per stage (no test of its own).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import megadlm_ext
from megadlms.models import GPTModel, TransformerConfig
from megadlms.ops import apply_rotary, fused_kernels_on_cpu, residual_add_norm, swiglu
from megadlms.parallel import TensorParallelContext, model_parallel_manual_seed
from tests.dist_utils import run_distributed
from tests.ext.fused_helpers import check_fused, rel_err, rope_angles

V, S, B = 64, 16, 2
FUSION_FLAGS = ("apply_rope_fusion", "bias_swiglu_fusion", "residual_rmsnorm_fusion")
LLAMA = dict(
    position_embedding_type="rope",
    swiglu=True,
    normalization="RMSNorm",
    num_query_groups=2,
    qk_layernorm=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)


def _config(dropout=0.0, fused=True, **kw):
    flags = dict.fromkeys(FUSION_FLAGS, fused)
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=V, seq_length=S)
    return TransformerConfig(
        **{**base, **LLAMA, **flags, **kw}, attention_dropout=dropout, hidden_dropout=dropout
    )


def _run(model, steps=1, seed=1):
    """Losses and gradients of ``steps`` accumulated micro-batches (a squared-logit loss)."""
    g = torch.Generator().manual_seed(seed)
    model.zero_grad(set_to_none=True)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, V, (B, S), generator=g)
        loss = model(ids, torch.arange(S).expand(B, S)).float().square().mean()
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _model(cfg, seed=0, tracker_seed=None):
    torch.manual_seed(seed)
    tracker = model_parallel_manual_seed(tracker_seed, 0) if tracker_seed is not None else None
    return GPTModel(cfg, tp=TensorParallelContext(rng_tracker=tracker))


def _max_grad_err(a, b):
    assert a.keys() == b.keys()
    return max(rel_err(a[n], b[n]) for n in a)


# ---- the device rule ---------------------------------------------------------------------------
def test_cpu_runs_the_unfused_ops_whatever_the_flags(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a fused kernel ran on CPU outside fused_kernels_on_cpu()")

    for op in ("rope", "swiglu", "swiglu_backward", "add_rmsnorm", "add_rmsnorm_backward"):
        monkeypatch.setattr(megadlm_ext, op, refuse)
    on = _run(_model(_config(dropout=0.1, fused=True), tracker_seed=5).train(), steps=2)
    off = _run(_model(_config(dropout=0.1, fused=False), tracker_seed=5).train(), steps=2)
    assert torch.equal(on[0], off[0])
    assert all(torch.equal(on[1][n], off[1][n]) for n in on[1])


def test_flags_off_keep_the_unfused_ops_even_when_forced(monkeypatch):
    monkeypatch.setattr(megadlm_ext, "rope", None)  # calling any of them would raise
    monkeypatch.setattr(megadlm_ext, "swiglu", None)
    monkeypatch.setattr(megadlm_ext, "add_rmsnorm", None)
    with fused_kernels_on_cpu():
        _run(_model(_config(fused=False)))


# ---- each fused Function against the unfused ops -----------------------------------------------
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _both(fn, inputs, grad_outs):
    """(outputs, input grads) of fn unfused, fused (forced on CPU), and unfused in float64."""
    results = []
    for fused, cast in ((False, None), (True, None), (False, torch.float64)):
        # Parameters: leaves a module can also hold (the norm's weight)
        leaves = [nn.Parameter((t.to(cast) if cast else t).detach().clone()) for t in inputs]
        with fused_kernels_on_cpu():
            outs = fn(*leaves, fused=fused)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, [g.to(cast) if cast else g for g in grad_outs])
        results.append(([o.detach() for o in outs], [t.grad for t in leaves]))
    return results


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("groups", [2, 4], ids=["gqa", "mha"])
def test_rotary_function_on_views_of_qkv(dtype, groups):
    """q and k as SelfAttention makes them (k, and q without GQA, strided views of the qkv
    output); the gradients flow back into qkv."""
    N, D = 4, 16
    per = N // groups
    qkv = torch.randn(B, S, groups * (per + 2) * D).to(dtype)
    cos, sin = rope_angles(B, S, D)  # fp32: the unfused ops cast them to x's dtype (exactly for float64)

    def fn(qkv_, fused):
        q, k, _ = torch.split(qkv_.view(B, S, groups, (per + 2) * D), [per * D, D, D], dim=-1)
        q = q.reshape(B, S, N, D)
        assert k.is_contiguous() is False and q.is_contiguous() == (groups != N)
        return apply_rotary(q, cos, sin, fused=fused), apply_rotary(k, cos, sin, fused=fused)

    grads = [torch.randn(B, S, N, D).to(dtype), torch.randn(B, S, groups, D).to(dtype)]
    (u, gu), (f, gf), (t, gt) = _both(fn, [qkv], grads)
    check_fused(f[0], u[0], t[0], "rotary q")
    check_fused(f[1], u[1], t[1], "rotary k")
    check_fused(gf[0], gu[0], gt[0], "grad of qkv")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_function(dtype):
    h = (torch.randn(B, S, 48) * 3).to(dtype)
    g = torch.randn(B, S, 24).to(dtype)
    (u, gu), (f, gf), (t, gt) = _both(swiglu, [h], [g])
    check_fused(f[0], u[0], t[0], "swiglu forward")
    check_fused(gf[0], gu[0], gt[0], "swiglu grad")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_residual_rmsnorm_function(dtype):
    H = 40
    norm = nn.RMSNorm(H, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(H))
    x, h, gs, gy = (torch.randn(B, S, H).to(dtype) for _ in range(4))
    w = norm.weight.detach().to(dtype)

    def fn(x_, h_, w_, fused):
        n = nn.RMSNorm(H, eps=1e-6, dtype=w_.dtype)
        n.weight = w_
        return residual_add_norm(x_, h_, n, fused=fused)

    (u, gu), (f, gf), (t, gt) = _both(fn, [x, h, w], [gs, gy])
    assert torch.equal(f[0], u[0])  # the residual stream: bitwise x + h
    check_fused(f[1], u[1], t[1], "normalised output")
    for i, name in enumerate(("x", "h", "weight")):
        check_fused(gf[i], gu[i], gt[i], f"grad of {name}")


def test_layernorm_models_stay_unfused(monkeypatch):
    monkeypatch.setattr(megadlm_ext, "add_rmsnorm", None)
    with fused_kernels_on_cpu():
        _run(_model(_config(normalization="LayerNorm")))


# ---- the whole model --------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_model_fused_matches_unfused_fp32(variant):
    extra = dict(num_moe_experts=4, moe_router_topk=2, moe_shared_expert_intermediate_size=16)
    cfg = _config(**(extra if variant == "moe" else {}))
    unfused = _run(_model(cfg))
    with fused_kernels_on_cpu():
        fused = _run(_model(cfg))
    assert rel_err(fused[0], unfused[0]) < 1e-6
    assert _max_grad_err(fused[1], unfused[1]) < 1e-5  # two layers of 1e-6 ops, through the chain rule


def test_model_fused_matches_unfused_bf16_with_dropout():
    """Megatron's dropout 0.1 stays torch's, before the fused add: the same masks (the RNG
    streams end where the unfused run's end), so only rounding differs."""
    cfg = _config(dropout=0.1)
    unfused_model = _model(cfg, tracker_seed=3).to(torch.bfloat16).train()
    unfused = _run(unfused_model)
    rng_unfused = torch.get_rng_state()
    with fused_kernels_on_cpu():
        fused = _run(_model(cfg, tracker_seed=3).to(torch.bfloat16).train())
    assert torch.equal(torch.get_rng_state(), rng_unfused)
    assert rel_err(fused[0], unfused[0]) < 4 * torch.finfo(torch.bfloat16).eps


@pytest.mark.parametrize(
    "recompute",
    [
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        dict(recompute_granularity="selective"),
    ],
    ids=["full", "selective"],
)
def test_recompute_reruns_the_fused_forward_bitwise(recompute):
    with fused_kernels_on_cpu():
        plain = _run(_model(_config(dropout=0.1), tracker_seed=7).train(), steps=2)
        again = _run(_model(_config(dropout=0.1, **recompute), tracker_seed=7).train(), steps=2)
    assert torch.equal(plain[0], again[0])
    assert all(torch.equal(plain[1][n], again[1][n]) for n in plain[1])


def test_no_new_parameters_and_checkpoints_load_across_the_flags():
    on, off = _model(_config(fused=True)), _model(_config(fused=False), seed=1)
    assert list(on.state_dict()) == list(off.state_dict())
    on.load_state_dict(off.state_dict())  # strict: same names and shapes
    assert all(torch.equal(a, b) for a, b in zip(on.state_dict().values(), off.state_dict().values()))


# ---- 2 ranks: TP + SP, FSDP2, a DTensor norm weight --------------------------------------------
def _tp_sp(rank, group):
    from megadlms.parallel import allreduce_sequence_parallel_grads, gather_full, shard_spec, sharding_of

    out = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = GPTModel(_config(), tp=TensorParallelContext(group=group, sequence_parallel=True))
        with fused_kernels_on_cpu(fused):
            loss, grads = _run(model)
        allreduce_sequence_parallel_grads(model, group)
        params = dict(model.named_parameters())
        out[fused] = {
            "loss": loss,
            "grads": {
                n: p.grad if shard_spec(p) is None else gather_full(p.grad, group, *shard_spec(p))
                for n, p in params.items()
            },
            "partial": sorted(n for n, p in params.items() if sharding_of(p).tp_partial_grad),
        }
    return out


_CALLS: dict = {}


def _counting() -> dict:
    """Counts the calls of megadlm_ext's fused ops from now on (wrappers installed once per rank
    process, counts cleared here); returns the live counts."""
    for name in ("rope", "swiglu", "swiglu_backward", "add_rmsnorm", "add_rmsnorm_backward"):
        op = getattr(megadlm_ext, name)
        if not getattr(op, "counted", False):

            def counted(*a, _op=op, _name=name, **k):
                _CALLS[_name] = _CALLS.get(_name, 0) + 1
                return _op(*a, **k)

            counted.counted = True
            setattr(megadlm_ext, name, counted)
    _CALLS.clear()
    return _CALLS


def _fsdp2(rank, world, policy):
    from megadlms.distributed import TorchFullyShardedDataParallel
    from megadlms.distributed.fsdp2 import mixed_precision_policy

    calls = _counting()
    losses = {}
    for fused in (False, True):
        torch.manual_seed(0)
        mp = mixed_precision_policy(True, grad_reduce_in_fp32=True) if policy == "bf16" else None
        model = TorchFullyShardedDataParallel(GPTModel(_config()), mixed_precision=mp)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        steps = []
        for _ in range(2):
            ids = torch.randint(0, V, (B, S), generator=g)
            model.zero_grad_buffer()
            with fused_kernels_on_cpu(fused):
                loss = model(ids, torch.arange(S).expand(B, S)).float().square().mean()
                loss.backward()
            model.finish_grad_sync()
            opt.step()
            steps.append(loss.detach())
        losses[fused] = torch.stack(steps)
    losses["calls"] = dict(calls)
    return losses


def _dtensor_weight(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    H = 24
    torch.manual_seed(3)  # the same values on every rank
    x, h, gy = (torch.randn(B, S, H) for _ in range(3))
    w = 1 + 0.3 * torch.randn(H)
    plain = nn.RMSNorm(H, eps=1e-6)
    plain.weight = nn.Parameter(w.clone())
    (plain(x + h) * gy).sum().backward()
    norm = nn.RMSNorm(H, eps=1e-6)
    norm.weight = nn.Parameter(distribute_tensor(w.clone(), mesh, [Replicate()]))
    with fused_kernels_on_cpu():
        _, y = residual_add_norm(x, h, norm, fused=True)
    (y * gy).sum().backward()
    grad = norm.weight.grad
    return {
        "y": rel_err(y.detach(), plain(x + h).detach()),
        "grad_is_dtensor": isinstance(grad, DTensor),
        "grad": rel_err(grad.to_local(), plain.weight.grad),
    }


def _world(rank, world):
    import torch.distributed as dist

    return {
        "tp_sp": _tp_sp(rank, dist.group.WORLD),
        "fsdp2_fp32": _fsdp2(rank, world, "fp32"),
        "fsdp2_bf16": _fsdp2(rank, world, "bf16"),
        "dtensor": _dtensor_weight(rank, world),
    }


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_world, world_size=2)


def test_tensor_and_sequence_parallel_fused_matches_unfused(two_ranks):
    for r in two_ranks:
        unfused, fused = r["tp_sp"][False], r["tp_sp"][True]
        assert fused["partial"] == unfused["partial"] and any("layernorm" in n for n in fused["partial"])
        assert rel_err(fused["loss"], unfused["loss"]) < 1e-6
        assert _max_grad_err(fused["grads"], unfused["grads"]) < 1e-5


def test_fsdp2_fused_matches_unfused(two_ranks):
    for r in two_ranks:
        assert rel_err(r["fsdp2_fp32"][True], r["fsdp2_fp32"][False]) < 1e-6
        assert rel_err(r["fsdp2_bf16"][True], r["fsdp2_bf16"][False]) < 4 * torch.finfo(torch.bfloat16).eps
        # every fused op ran under both policies (bf16: the rotary angles arrive cast to bf16)
        for policy in ("fsdp2_fp32", "fsdp2_bf16"):
            assert set(r[policy]["calls"]) == {
                "rope",
                "swiglu",
                "swiglu_backward",
                "add_rmsnorm",
                "add_rmsnorm_backward",
            }


def test_dtensor_norm_weight_uses_its_local_tensor(two_ranks):
    for r in two_ranks:
        d = r["dtensor"]
        assert d["grad_is_dtensor"] and d["y"] < 1e-6 and d["grad"] < 1e-6
