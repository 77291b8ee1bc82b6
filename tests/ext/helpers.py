"""Pure-PyTorch expectations for tests/ext, written independently of megadlm_ext.reference.

Numerics the contract promises: each element is cast to fp32, multiplied by ``scale``
in fp32, (added to the fp32 value of the destination for accumulate) and rounded once
into the destination dtype -- exactly what these torch expressions compute.
"""

import contextlib

import torch

import megadlm_ext

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROUTES = ("compiled", "reference")


@contextlib.contextmanager
def route(name: str):
    """Run megadlm_ext ops through the compiled (_C) or the reference route."""
    if name == "compiled":
        assert megadlm_ext.backend_info()["compiled"], megadlm_ext.backend_info()
    with megadlm_ext.force_reference(name == "reference"):
        yield


@contextlib.contextmanager
def eagerly():
    """The ops of the block run once, eagerly, on a side stream ordered after the current
    stream's work and before whatever is queued next: the warm-up before a CUDA-graph capture
    of the same ops. CUDA loads a kernel at its first launch (lazy module loading, the
    default), and a first launch inside a capture would load it while the stream is
    captured. The same op on the same dtypes warms the captured kernel; tensors of the same
    shapes but new pointers keep the segment-table miss a test may want under capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream().wait_stream(side)


def packed_offsets(tensors, gaps=None):
    """Offsets of a layout with optional gap (in elements) before each tensor."""
    offs, pos = [], 0
    for i, t in enumerate(tensors):
        pos += gaps[i] if gaps else 0
        offs.append(pos)
        pos += t.numel()
    return offs, pos


def expect_flatten(tensors, offsets, numel, dtype, scale, base=None):
    out = torch.zeros(numel, dtype=dtype) if base is None else base.clone()
    for o, t in zip(offsets, tensors):
        out[o : o + t.numel()] = (t.float().reshape(-1) * scale).to(dtype)
    return out


def expect_accumulate(flat, tensors, offsets, scale):
    out = flat.clone()
    for o, t in zip(offsets, tensors):
        seg = out[o : o + t.numel()]
        seg.copy_((seg.float() + t.float().reshape(-1) * scale).to(flat.dtype))
    return out


def expect_norm(tensors) -> float:
    if not tensors:
        return 0.0
    return float(torch.cat([t.double().reshape(-1) for t in tensors]).norm())


def random_list(gen, n, max_numel, dtypes=DTYPES):
    """n random tensors (shapes 0-D..2-D, 0-element ones included) of mixed dtypes."""
    out = []
    for _ in range(n):
        numel = int(torch.randint(0, max_numel + 1, (1,), generator=gen))
        dt = dtypes[int(torch.randint(0, len(dtypes), (1,), generator=gen))]
        shape = (numel,) if numel % 3 else ((1, numel) if numel else (0,))
        out.append((torch.randn(shape, generator=gen) * 3).to(dt))
    return out
