"""megadlm_ext.adamw_step (the fused AdamW step): both routes against torch's single-tensor
AdamW (fp32: 1e-6 relative per element over several steps), the compiled route bitwise the
reference route for every storage-dtype combination, and every refused argument, named the
same way by both routes and refused before anything is written. CPU here; the CUDA kernel
against the CPU one in the GPU tests at the end."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import megadlm_ext

from .helpers import eagerly, route

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
SIZES = (0, 1, 7, 33, 1000, 4099, (17, 31))
GRADS = (torch.float32, torch.bfloat16)
MOMENTS = (torch.float32, torch.bfloat16, torch.float16)
MODEL = (None, torch.bfloat16, torch.float16)


def _state(sizes, gdt=torch.float32, mdt=torch.float32, vdt=torch.float32, model=None, seed=0, device="cpu"):
    """Params, grads per step (3 steps), moments (already non-zero: a step has run) and model
    params, on ``device``; values of realistic magnitudes, moments stored in their dtypes."""
    g = torch.Generator().manual_seed(seed)
    ps, ms, vs, mps = [], [], [], []
    grads = [[] for _ in range(3)]
    for s in sizes:
        shape = s if isinstance(s, tuple) else (s,)
        ps.append(torch.randn(shape, generator=g))
        for k in range(3):
            grads[k].append((torch.randn(shape, generator=g) * 1e-2).to(gdt))
        ms.append((torch.randn(shape, generator=g) * 1e-3).to(mdt))
        vs.append((torch.rand(shape, generator=g) * 1e-4).to(vdt))
        mps.append(None if model is None else torch.zeros(shape, dtype=model))
    move = lambda ts: [t if t is None else t.to(device) for t in ts]  # noqa: E731
    return move(ps), [move(gs) for gs in grads], move(ms), move(vs), move(mps)


def _run(ps, grads, ms, vs, mps, wd=0.1, first_step=4):
    for k, gs in enumerate(grads):
        megadlm_ext.adamw_step(
            ps, gs, ms, vs, **HYPER, weight_decay=wd, step=first_step + k,
            model_params=None if mps[0] is None else mps,
        )  # fmt: skip


def _clone(ts):
    return [t if t is None else t.clone() for t in ts]


@pytest.mark.parametrize("name", ["compiled", "reference"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_torch_single_tensor_adamw(name, wd):
    ps, grads, _, _, _ = _state(SIZES)
    ref = [torch.nn.Parameter(p.clone()) for p in ps]
    topt = torch.optim.AdamW(
        ref, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"], weight_decay=wd,
        foreach=False,
    )  # fmt: skip
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    with route(name):
        for k in range(5):
            gs = grads[k % 3]
            for p, gr in zip(ref, gs):
                p.grad = gr.clone()
            topt.step()
            megadlm_ext.adamw_step(ps, gs, ms, vs, **HYPER, weight_decay=wd, step=k + 1)
    # 1e-6 relative per element, relative to the size of the terms that made it: a param near
    # zero is the difference of its old value and updates of size ~lr, an exp_avg near zero a
    # sum of terms of either sign (the two steps order their fp32 operations differently).
    for p, m, v, q in zip(ps, ms, vs, ref):
        st = topt.state[q]
        assert bool(((p - q.detach()).abs() <= 1e-6 * (q.detach().abs() + HYPER["lr"])).all())
        m_terms = float(st["exp_avg"].abs().max()) if m.numel() else 0.0
        assert bool(((m - st["exp_avg"]).abs() <= 1e-6 * (st["exp_avg"].abs() + m_terms)).all())
        torch.testing.assert_close(v, st["exp_avg_sq"], rtol=1e-6, atol=0)


def _routes_after_3_steps(state, name):
    ps, grads, ms, vs, mps = (x if i == 1 else _clone(x) for i, x in enumerate(state))
    with route(name):
        _run(ps, grads, ms, vs, mps)
    return ps, ms, vs, mps


@pytest.mark.parametrize("gdt", GRADS)
@pytest.mark.parametrize("mdt", MOMENTS)
@pytest.mark.parametrize("vdt", MOMENTS)
def test_compiled_is_bitwise_the_reference_for_every_dtype_combination(gdt, mdt, vdt):
    for model in MODEL:
        state = _state(SIZES, gdt, mdt, vdt, model, seed=3)
        compiled = _routes_after_3_steps(state, "compiled")
        reference = _routes_after_3_steps(state, "reference")
        for a_list, b_list in zip(compiled, reference):
            for a, b in zip(a_list, b_list):
                if a is not None:
                    assert a.dtype == b.dtype and torch.equal(a, b), (gdt, mdt, vdt, model)
        ps, ms, vs, mps = compiled
        assert [m.dtype for m in ms] == [mdt] * len(ms) and [v.dtype for v in vs] == [vdt] * len(vs)
        if model is not None:  # the model copy is the new fp32 param rounded once
            assert all(torch.equal(mp, p.to(model)) for p, mp in zip(ps, mps))


@pytest.mark.parametrize("name", ["compiled", "reference"])
def test_param_moves_with_the_unrounded_moments(name):
    """TE's order: the param is updated from the new fp32 moments, which are rounded only
    when stored. From the same (representable) start, the first step's param is therefore
    bitwise the same whatever the moments' dtypes -- even where an fp16 moment rounds to 0."""
    p0 = torch.full((37,), 1e-6)
    g = torch.full((37,), 1e-9)  # 0.1 * g = 1e-10: below fp16's smallest subnormal
    v0 = torch.full((37,), 2.0**-20)  # exact in every dtype
    results = {}
    for mdt, vdt in itertools.product(MOMENTS, MOMENTS):
        p, m, v = p0.clone(), torch.zeros(37, dtype=mdt), v0.to(vdt, copy=True)
        with route(name):
            megadlm_ext.adamw_step([p], [g], [m], [v], **HYPER, weight_decay=0.0, step=1)
        results[mdt, vdt] = p
        if mdt == torch.float16:
            assert torch.equal(m, torch.zeros_like(m))
    assert not torch.equal(results[torch.float32, torch.float32], p0)
    assert all(torch.equal(p, results[torch.float32, torch.float32]) for p in results.values())


@pytest.mark.parametrize("name", ["compiled", "reference"])
def test_empty_lists_and_empty_tensors_are_no_ops(name):
    e = torch.zeros(0)
    p = torch.ones(3)
    with route(name):
        megadlm_ext.adamw_step([], [], [], [], **HYPER, weight_decay=0.1, step=1)
        megadlm_ext.adamw_step([e], [e.clone()], [e.clone()], [e.clone()], **HYPER, weight_decay=0.1, step=1)
        megadlm_ext.adamw_step(
            [e, p], [e.clone(), torch.ones(3)], [e.clone(), torch.zeros(3)], [e.clone(), torch.zeros(3)],
            **HYPER, weight_decay=0.0, step=1,
        )  # fmt: skip
    assert torch.allclose(p, torch.full((3,), 1 - HYPER["lr"]), rtol=1e-5)


def _args(**change):
    ps, grads, ms, vs, _ = _state((5, 7, 3))
    kw = dict(params=ps, grads=grads[0], exp_avgs=ms, exp_avg_sqs=vs, **HYPER, weight_decay=0.1, step=1)
    return {**kw, **change}


def _swap(name, i, make):
    """Arguments with entry i of list `name` replaced by make(arguments)."""
    kw = _args()
    kw[name] = list(kw[name])
    kw[name][i] = make(kw)
    return kw


# (message regex, arguments, both routes word it identically). The list parsing shared with
# the other ops prints dtypes and strides in each language's own spelling.
BAD = [
    ("grads has 2 tensors but params has 3", lambda: _args(grads=_args()["grads"][:2]), True),
    ("params[0] has dtype torch.bfloat16; params must be float32",
     lambda: _args(params=[t.bfloat16() for t in _args()["params"]]), True),
    ("grads[0] has dtype torch.float16; grads must be float32 or bfloat16",
     lambda: _args(grads=[t.half() for t in _args()["grads"]]), True),
    ("exp_avgs[2] is torch.bfloat16 but exp_avgs[0] is torch.float32: one dtype per list",
     lambda: _swap("exp_avgs", 2, lambda kw: kw["exp_avgs"][2].bfloat16()), True),
    ("model_params[0] has dtype torch.float32; model_params must be bfloat16 or float16",
     lambda: _args(model_params=[torch.zeros(n) for n in (5, 7, 3)]), True),
    ("exp_avg_sqs[1] has 6 elements but params[1] has 7", lambda: _swap("exp_avg_sqs", 1, lambda kw: torch.zeros(6)), True),
    ("params[1] and exp_avgs[1] share memory", lambda: _swap("exp_avgs", 1, lambda kw: kw["params"][1]), True),
    ("params[0] and grads[2] share memory", lambda: _swap("grads", 2, lambda kw: kw["params"][0][:3]), True),
    ("lr must be a finite number >= 0, got -1.0", lambda: _args(lr=-1.0), True),
    ("beta1 must be in [0, 1), got 1.0", lambda: _args(beta1=1.0), True),
    ("beta2 must be in [0, 1), got nan", lambda: _args(beta2=math.nan), True),
    ("eps must be a finite number >= 0, got inf", lambda: _args(eps=math.inf), True),
    ("weight_decay must be a finite number >= 0, got -0.1", lambda: _args(weight_decay=-0.1), True),
    ("step must be >= 1", lambda: _args(step=0), True),
    ("grads[1] is not contiguous", lambda: _swap("grads", 1, lambda kw: torch.zeros(7, 2)[:, 0]), False),
    ("exp_avgs must be a list or tuple of tensors, got Tensor", lambda: _args(exp_avgs=torch.zeros(3)), True),
    ("exp_avg_sqs[0] is a int, not a tensor", lambda: _args(exp_avg_sqs=[1, 2, 3]), True),
    ("grads[0] has dtype", lambda: _args(grads=[torch.zeros(n, dtype=torch.int64) for n in (5, 7, 3)]), False),
]  # fmt: skip


@pytest.mark.parametrize("message,make,same", BAD, ids=[b[0][:40] for b in BAD])
def test_bad_arguments_are_refused_by_name_before_any_write(message, make, same):
    errors = []
    for name in ("compiled", "reference"):
        kw = make()
        before = [t.clone() for t in kw["params"]]
        with route(name), pytest.raises(ValueError) as info:
            megadlm_ext.adamw_step(**kw)
        assert message in str(info.value), (name, str(info.value))
        errors.append(str(info.value))
        assert all(torch.equal(a, b) for a, b in zip(before, kw["params"]))
    if same:
        assert errors[0] == errors[1]


# ------------------------------------------------------------------ GPU (CUDA kernel vs CPU kernel)
def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    assert megadlm_ext.backend_info()["cuda"], "CUDA device present but megadlm_ext built without CUDA"


def _to_cuda(state, shift=0):
    """The state on the GPU; with `shift`, every tensor is a view starting `shift` elements
    past an aligned place (scalar heads, vector bodies, scalar tails)."""
    ps, grads, ms, vs, mps = state

    def place(t):
        if t is None:
            return None
        buf = torch.zeros(t.numel() + 16, dtype=t.dtype, device="cuda")
        view = buf[shift : shift + t.numel()].view(t.shape)
        view.copy_(t)
        return view

    return ([place(t) for t in ps], [[place(t) for t in gs] for gs in grads], [place(t) for t in ms],
            [place(t) for t in vs], [place(t) for t in mps])  # fmt: skip


def _assert_same(cpu, gpu, what):
    for ca, ga in zip((cpu[0], cpu[2], cpu[3], cpu[4]), (gpu[0], gpu[2], gpu[3], gpu[4])):
        for c, g in zip(ca, ga):
            if c is not None:
                assert torch.equal(g.cpu(), c), what


@pytest.mark.gpu
@pytest.mark.parametrize("gdt,mdt,vdt", list(itertools.product(GRADS, MOMENTS, MOMENTS)))
def test_cuda_matches_cpu_bitwise(gdt, mdt, vdt):
    _gpu()
    sizes = list(SIZES) + [70_001, 8192 * 3 + 5]
    for model, shift in zip(MODEL, (0, 1, 3)):
        cpu = _state(sizes, gdt, mdt, vdt, model, seed=5)
        gpu = _to_cuda(cpu, shift)
        with route("compiled"):
            _run(*cpu)
            _run(*gpu)
        torch.cuda.synchronize()
        _assert_same(cpu, gpu, (gdt, mdt, vdt, model, shift))


@pytest.mark.gpu
def test_cuda_many_tensors_one_launch_cached_table_side_stream():
    _gpu()
    sizes = [1 + (i * 37) % 3000 for i in range(3000)]
    cpu = _state(sizes, torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16, seed=7)
    gpu = _to_cuda(cpu)
    stats = megadlm_ext._C._cuda_table_cache_stats
    megadlm_ext._C._cuda_clear_table_cache()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with route("compiled"):
        _run(*cpu)
        with torch.cuda.stream(side):
            _run(*gpu)  # 3 steps over one table: 1 upload, then 2 cache hits
        assert stats()[:2] == (2, 1)
        side.synchronize()
        _assert_same(cpu, gpu, "3 steps")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            megadlm_ext.adamw_step(gpu[0], gpu[1][0], gpu[2], gpu[3], **HYPER, weight_decay=0.1, step=9)
            torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("megadlm_adamw_kernel" in n for n in names) == 1, names


@pytest.mark.gpu
@pytest.mark.cuda_graph
def test_cuda_graph_capture_replays_the_step():
    _gpu()
    dts = (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16)
    ps, grads, ms, vs, mps = _to_cuda(_state((5, 4099, 70_001), *dts, seed=9))
    eager = [_clone(x) for x in (ps, ms, vs, mps)]
    kw = dict(**HYPER, weight_decay=0.1, step=3)
    with eagerly(), route("compiled"):  # the captured call once outside capture, on other tensors
        megadlm_ext.adamw_step(_clone(ps), grads[0], _clone(ms), _clone(vs), **kw, model_params=_clone(mps))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), route("compiled"):
        megadlm_ext.adamw_step(ps, grads[0], ms, vs, **kw, model_params=mps)
    for _ in range(2):  # the captured step (fixed scalars) replayed twice == two eager calls
        graph.replay()
        with route("compiled"):
            megadlm_ext.adamw_step(eager[0], grads[0], eager[1], eager[2], **kw, model_params=eager[3])
    torch.cuda.synchronize()
    for got, want in zip((ps, ms, vs, mps), eager):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
