"""CUDA kernels against the CPU kernels (compiled route) -- GPU only."""

import math

import pytest
import torch

import megadlm_ext

from .helpers import expect_norm, packed_offsets, random_list, route

pytestmark = pytest.mark.gpu


def _lists(seed=0, n=10_500, max_numel=300):
    g = torch.Generator().manual_seed(seed)
    cpu = random_list(g, n, max_numel)
    return cpu, [t.cuda() for t in cpu]


@pytest.mark.parametrize("flat_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_ops_match_cpu(flat_dtype):
    assert megadlm_ext.backend_info()["cuda"], "CUDA device present but megadlm_ext built without CUDA"
    cpu, gpu = _lists()
    # odd gaps: most segments start misaligned, exercising the scalar heads
    offs, numel = packed_offsets(cpu, [i % 3 for i in range(len(cpu))])
    with route("compiled"):
        fc = megadlm_ext.flatten(cpu, offsets=offs, scale=0.25, dtype=flat_dtype)
        fg = megadlm_ext.flatten(gpu, offsets=offs, scale=0.25, dtype=flat_dtype)
        assert torch.equal(fg.cpu(), fc)
        megadlm_ext.accumulate_into(fc, cpu, offsets=offs, scale=-1.5)
        megadlm_ext.accumulate_into(fg, gpu, offsets=offs, scale=-1.5)
        assert torch.equal(fg.cpu(), fc)
        megadlm_ext.unflatten(fc, cpu, offsets=offs, scale=3.0)
        megadlm_ext.unflatten(fg, gpu, offsets=offs, scale=3.0)
        megadlm_ext.scale_(cpu, 0.5)
        megadlm_ext.scale_(gpu, 0.5)
        for a, b in zip(cpu, gpu):
            assert torch.equal(b.cpu(), a)
        ng = megadlm_ext.l2_norm(gpu)
        assert ng.device.type == "cuda" and ng.dtype == torch.float32
        assert math.isclose(float(ng), expect_norm(cpu), rel_tol=1e-5)
        assert megadlm_ext.has_nonfinite(gpu) is False
        gpu[-1] = torch.tensor([float("nan")], device="cuda")
        assert megadlm_ext.has_nonfinite(gpu) is True


@pytest.mark.profiler
def test_cuda_large_aligned_and_one_launch():
    """A 10k-tensor flatten is one element-kernel launch (profiler count)."""
    _, gpu = _lists(seed=1, n=10_000, max_numel=4096)
    out = torch.empty(sum(t.numel() for t in gpu), device="cuda")
    with route("compiled"):
        megadlm_ext.flatten(gpu, out)  # warm-up
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            megadlm_ext.flatten(gpu, out)
            torch.cuda.synchronize()
    kernels = [
        e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "megadlm" in e.name
    ]
    assert len(kernels) == 1, [e.name for e in kernels]
    assert torch.equal(out, torch.cat([t.float().reshape(-1) for t in gpu]))
