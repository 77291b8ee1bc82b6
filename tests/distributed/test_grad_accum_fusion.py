"""Gradient-accumulation fusion (ColumnParallelLinear / RowParallelLinear with
``gradient_accumulation_fusion=True``) under our DistributedDataParallel: the same main_grad as
without fusion, with no_sync micro-batches, overlapped small buckets, the distributed
optimizer, tp=2 (+ sequence parallelism) and dp=2 on gloo; no weight-sized gradient tensor is
made in backward; a clear error without the wrapper."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megadlms.parallel.layers import ColumnParallelLinear, RowParallelLinear
from tests.dist_utils import run_distributed

H, FF, B, S = 16, 40, 3, 6  # weight numel H*FF = 640; activations B*S*{H,FF} differ from it


class Net(torch.nn.Module):
    """Two Megatron MLP blocks (column -> gelu -> dropout -> row, residual) and a norm."""

    def __init__(self, fusion, *, tp_group=None, sp=False, dtype=None, dropout=0.1):
        super().__init__()
        g = torch.Generator().manual_seed(1234)
        kw = dict(tp_group=tp_group, sequence_parallel=sp, generator=g, dtype=dtype)
        kw["gradient_accumulation_fusion"] = fusion
        self.cols = torch.nn.ModuleList(ColumnParallelLinear(H, FF, **kw) for _ in range(2))
        self.rows = torch.nn.ModuleList(RowParallelLinear(FF, H, **kw) for _ in range(2))
        self.norm = torch.nn.LayerNorm(H, dtype=dtype)
        self.dropout = dropout

    def forward(self, x):
        for col, row in zip(self.cols, self.rows):
            h = F.dropout(F.gelu(col(x)), self.dropout, self.training)
            x = x + row(h)
        return self.norm(x)


def _inputs(n, seed, dtype=None, seq=S):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, seq, H, generator=g, dtype=dtype) for _ in range(n)]


def _step(model, xs, seed=0):
    """One step of len(xs) micro-batches (all but the last under no_sync); returns main grads."""
    model.zero_grad_buffer()
    for i, x in enumerate(xs):
        torch.manual_seed(seed + i)  # the same dropout masks with and without fusion
        ctx = model.no_sync() if i < len(xs) - 1 else _null()
        with ctx:
            model(x).float().pow(2).mean().backward()
    model.finish_grad_sync()
    return {n: p.main_grad.clone() for p, n in model.param_names.items()}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _pair(cfg, **net_kw):
    return [DistributedDataParallel(Net(f, **net_kw), cfg) for f in (False, True)]


def _max_rel(a, b):
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)).item() for k in b)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(overlap_grad_reduce=True, bucket_size=700),
        dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=700),
    ],
    ids=["plain", "overlap-buckets", "distopt"],
)
def test_fp32_fused_equals_unfused_over_3_microbatches(cfg):
    off, on = _pair(DistributedDataParallelConfig(**cfg))
    if cfg.get("bucket_size"):
        assert len(on.buckets) >= 3
    xs = _inputs(3, seed=1)
    g_off, g_on = _step(off, xs), _step(on, xs)
    for name in g_off:  # fp32: the GEMM differs from autograd's only in where it adds
        torch.testing.assert_close(g_on[name], g_off[name], rtol=1e-6, atol=1e-7, msg=name)
    # a second step (buffers zeroed, views re-attached) gives the same again
    torch.testing.assert_close(_step(on, xs), g_on, rtol=0, atol=0)


def test_bf16_params_fp32_grads_close_to_unfused():
    off, on = _pair(DistributedDataParallelConfig(grad_reduce_in_fp32=True), dtype=torch.bfloat16)
    xs = _inputs(3, seed=2, dtype=torch.bfloat16)
    g_off, g_on = _step(off, xs), _step(on, xs)
    # Unfused rounds each micro-batch's weight gradient to bf16 (relative 2^-9) before the fp32
    # fold; fused accumulates fp32 products. Bias/norm grads are computed alike (same ops).
    assert _max_rel(g_on, g_off) < 3 * 2**-8
    for name in g_off:
        if not name.endswith("weight") or "norm" in name:
            torch.testing.assert_close(g_on[name], g_off[name], rtol=0, atol=0, msg=name)


def test_fused_matches_plain_torch_grads_fp32():
    """Independent reference: plain autograd on the unwrapped, unfused net (param.grad)."""
    ref = Net(False)
    xs = _inputs(3, seed=3)
    for i, x in enumerate(xs):
        torch.manual_seed(i)
        ref(x).float().pow(2).mean().backward()
    on = DistributedDataParallel(Net(True), DistributedDataParallelConfig())
    g_on = _step(on, xs)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(g_on[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)


class _WeightSizedAllocs(TorchDispatchMode):
    """Counts op outputs with `numel` elements that own fresh storage (not a view/in-place)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ptrs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (
                isinstance(t, torch.Tensor)
                and t.numel() == self.numel
                and t.untyped_storage().data_ptr() not in ptrs
            ):
                if t.untyped_storage().nbytes() >= self.numel * t.element_size():
                    self.count += 1
        return out


@pytest.mark.parametrize("grad_fp32", [False, True], ids=["grad-view", "fp32-grads"])
@pytest.mark.parametrize("set_to_none", [False, True])
def test_no_weight_sized_tensor_in_backward(grad_fp32, set_to_none):
    dtype = torch.bfloat16 if grad_fp32 else None
    cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_fp32)
    counts = {}
    for fusion in (False, True):
        model = DistributedDataParallel(Net(fusion, dtype=dtype, dropout=0.0), cfg)
        model.zero_grad_buffer()
        if set_to_none:  # what torch.optim's zero_grad leaves
            for p in model.parameters():
                p.grad = None
        out = model(_inputs(1, seed=4, dtype=dtype)[0]).float().pow(2).mean()
        with _WeightSizedAllocs(H * FF) as mode:
            out.backward()
        counts[fusion] = mode.count
        model.finish_grad_sync()
        for col, row in zip(model.module.cols, model.module.rows):
            for w in (col.weight, row.weight):
                assert w.grad is None or w.grad.data_ptr() == w.main_grad.data_ptr()
                assert getattr(w, "grad_added_to_main_grad", False) is False
    assert counts[False] >= 4, counts  # one wgrad per linear without fusion
    assert counts[True] == 0, counts


class TiedNet(torch.nn.Module):
    """A fused output layer whose weight is also an embedding table (Megatron's tied head)."""

    def __init__(self, fusion, dtype=None):
        super().__init__()
        g = torch.Generator().manual_seed(99)
        self.head = ColumnParallelLinear(
            H, FF, tp_group=None, bias=False, generator=g, dtype=dtype, gradient_accumulation_fusion=fusion
        )
        self.head.weight.zero_out_wgrad = True  # what a model with tied weights sets

    def forward(self, ids):
        return self.head(F.embedding(ids, self.head.weight)[..., :H] * 1.5)


@pytest.mark.parametrize("grad_fp32", [False, True], ids=["grad-view", "fp32-grads"])
def test_tied_weight_keeps_its_ordinary_gradient(grad_fp32):
    dtype = torch.bfloat16 if grad_fp32 else None
    ids = torch.randint(0, FF, (B, S), generator=torch.Generator().manual_seed(3))
    cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_fp32)
    grads = []
    for fusion in (False, True):
        model = DistributedDataParallel(TiedNet(fusion, dtype), cfg)
        for _ in range(2):  # a second step: the flag and param.grad were reset
            model.zero_grad_buffer()
            with model.no_sync():
                model(ids).float().pow(2).mean().backward()
            model(ids).float().pow(2).mean().backward()
            model.finish_grad_sync()
        grads.append(model.module.head.weight.main_grad.clone())
    tol = dict(rtol=1e-6, atol=1e-7) if not grad_fp32 else dict(rtol=0, atol=3 * 2**-8 * grads[0].abs().max())
    torch.testing.assert_close(grads[1], grads[0], **tol)


def test_tied_weight_without_zero_out_wgrad_is_an_error():
    net = TiedNet(True, torch.bfloat16)
    del net.head.weight.zero_out_wgrad
    model = DistributedDataParallel(net, DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    ids = torch.randint(0, FF, (B, S), generator=torch.Generator().manual_seed(3))
    with pytest.raises(RuntimeError, match=r"head.weight got an ordinary gradient.*zero_out_wgrad"):
        model(ids).float().pow(2).mean().backward()


def test_missing_main_grad_is_a_clear_error():
    net = Net(True)
    with pytest.raises(RuntimeError, match="ColumnParallelLinear.*--no-gradient-accumulation-fusion"):
        net(_inputs(1, seed=5)[0])
    with torch.no_grad():  # inference needs no main_grad
        net(_inputs(1, seed=5)[0])
    net.eval()
    with pytest.raises(RuntimeError, match="DistributedDataParallel wrapper"):
        net.rows[0](torch.randn(2, FF))


def _dist_cases(rank, world):
    out = {}
    # tp=2 (+ sequence parallelism), DDP over a data-parallel group of size 1 per rank
    dp_groups = [dist.new_group([r]) for r in range(world)]
    for sp in (False, True):
        cfg = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=300)
        off, on = [
            DistributedDataParallel(
                Net(f, tp_group=dist.group.WORLD, sp=sp), cfg, process_group=dp_groups[rank]
            )
            for f in (False, True)
        ]
        xs = _inputs(3, seed=6, seq=S if not sp else S)
        if sp:
            xs = [x.chunk(world, 1)[rank].contiguous() for x in xs]
        out[f"tp2_sp{sp}"] = _max_rel(_step(on, xs), _step(off, xs))
    # dp=2 (tp=1), averaging mode (1/dp folded), overlap + tiny buckets, +- distributed optimizer
    for distopt in (False, True):
        for fp32 in (False, True):
            cfg = DistributedDataParallelConfig(
                overlap_grad_reduce=True,
                bucket_size=700,
                use_distributed_optimizer=distopt,
                grad_reduce_in_fp32=not fp32,
            )
            dtype = None if fp32 else torch.bfloat16
            off, on = _pair(cfg, dtype=dtype)
            xs = _inputs(3, seed=7 + rank, dtype=dtype)
            out[f"dp2_distopt{distopt}_fp32{fp32}"] = _max_rel(_step(on, xs), _step(off, xs))
    return out


def test_tp2_and_dp2_on_gloo():
    results = run_distributed(_dist_cases, world_size=2, timeout=240)
    for res in results:
        for key, rel in res.items():
            bound = 1e-6 if "fp32True" in key or key.startswith("tp2") else 3 * 2**-8
            assert rel < bound, (key, rel)


@pytest.mark.gpu
def test_cuda_bf16_fused_close_to_unfused():
    cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=700)
    off, on = [DistributedDataParallel(Net(f, dtype=torch.bfloat16).cuda(), cfg) for f in (False, True)]
    xs = [x.cuda() for x in _inputs(3, seed=8, dtype=torch.bfloat16)]
    g_off, g_on = _step(off, xs), _step(on, xs)
    assert _max_rel(g_on, g_off) < 3 * 2**-8
