"""Plain-PyTorch reference route of every megadlm_ext op.

Same contract and the same input checks as the compiled route (csrc/tensor_list.cpp),
TensorTable included (csrc/tensor_table.cpp);
tests force both routes and compare them. Numerics: values are cast to fp32,
scaled, combined in fp32 and rounded once into the destination dtype, which is
what the fused kernels do.
"""

from __future__ import annotations

from typing import Optional

import torch

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


def _span(t: torch.Tensor):
    """Byte range [start, end) of a tensor's storage that it touches."""
    if t.numel() == 0:
        return None
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlaps(a, b) -> bool:
    return a is not None and b is not None and a[0] < b[1] and b[0] < a[1]


def check_list(name: str, tensors, *, device=None, device_owner: str = "the flat buffer") -> list:
    """Validate a tensor-list argument (every tensor on ``device`` when given, which
    ``device_owner`` names in the message; else on the device of element 0); return it as a list."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise ValueError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    first = tensors[0].device if tensors and isinstance(tensors[0], torch.Tensor) else None
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}[{i}] is a {type(t).__name__}, not a tensor")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}[{i}] has dtype {t.dtype}; supported: float32, bfloat16, float16")
        if not t.is_contiguous():
            raise ValueError(
                f"{name}[{i}] is not contiguous (strides {tuple(t.stride())}); "
                "pass t.contiguous() (in-place ops need the original contiguous storage)"
            )
        if device is not None and t.device != device:
            raise ValueError(f"{name}[{i}] is on {t.device} but {device_owner} is on {device}")
        if device is None and t.device != first:
            raise ValueError(f"{name}[{i}] is on {t.device} but {name}[0] is on {first}")
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"{name}[{i}] is on {t.device}; megadlm_ext runs on cpu tensors "
                "(and cuda tensors in CUDA builds)"
            )
    return tensors


def check_flat(name: str, flat) -> None:
    if not isinstance(flat, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(flat).__name__}")
    if flat.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {flat.dtype}; supported: float32, bfloat16, float16")
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(flat.shape)}")


def resolve_offsets(tensors, offsets, flat_numel: Optional[int], flat_name: str = "flat") -> list:
    """Element offsets of each tensor in the flat buffer (packed when None); range-checked."""
    if offsets is None:
        out, pos = [], 0
        for t in tensors:
            out.append(pos)
            pos += t.numel()
    else:
        out = [int(o) for o in (offsets.tolist() if isinstance(offsets, torch.Tensor) else offsets)]
        if len(out) != len(tensors):
            raise ValueError(f"offsets has {len(out)} entries but there are {len(tensors)} tensors")
    spans = []
    for i, (o, t) in enumerate(zip(out, tensors)):
        if o < 0:
            raise ValueError(f"offsets[{i}] = {o} is negative")
        if flat_numel is not None and o + t.numel() > flat_numel:
            raise ValueError(
                f"tensors[{i}] ({t.numel()} elements at offset {o}) runs past the end of "
                f"{flat_name} ({flat_numel} elements)"
            )
        if t.numel():
            spans.append((o, o + t.numel(), i))
    spans.sort()
    for (a0, a1, ia), (b0, _b1, ib) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ValueError(
                f"tensors[{ia}] and tensors[{ib}] overlap in {flat_name} (offsets {a0} and {b0})"
            )
    return out


def check_no_alias(flat_name: str, flat, tensors) -> None:
    fs = _span(flat)
    for i, t in enumerate(tensors):
        if _overlaps(fs, _span(t)):
            raise ValueError(f"tensors[{i}] aliases {flat_name}: in-place ops need separate memory")


def check_distinct(tensors) -> None:
    spans = sorted((s[0], s[1], i) for i, s in ((i, _span(t)) for i, t in enumerate(tensors)) if s)
    for (_a0, a1, ia), (b0, _b1, ib) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ValueError(
                f"tensors[{ia}] and tensors[{ib}] share memory: in-place ops need distinct tensors"
            )


def _storage_ptr(t: torch.Tensor) -> int:
    """Address of a tensor's first element, read through its storage (0 when unallocated)."""
    return t.untyped_storage().data_ptr() + int(t.storage_offset()) * t.element_size() if t.numel() else 0


class TensorTable:
    """The reference route's ``TensorTable`` (``megadlm_ext.TensorTable`` builds this one when
    the compiled module is missing or ``force_reference`` is on): the compiled class's
    contract in plain Python. The ops below take it (or a compiled table) wherever they take
    a list; they re-check its tensors on every call, as this route does for a list.
    """

    def __init__(self, tensors, *, offsets=None):
        tensors = check_list("tensors", tensors)
        offs = resolve_offsets(tensors, offsets, None, "the flat buffer")
        self._tensors = tuple(tensors)
        self._offsets = None if offsets is None else offs
        # the storages too, as the compiled table holds them (a .data = swap frees nothing)
        self._storages = [t.untyped_storage() for t in tensors]
        self._seen = [(_storage_ptr(t), t.numel(), t.dtype) for t in tensors]
        self._device = tensors[0].device if tensors else torch.device("cpu")
        self._numel = sum(t.numel() for t in tensors)
        self._flat_numel = max((o + t.numel() for o, t in zip(offs, tensors)), default=0)
        self._twin = None  # the compiled table of the same tensors (megadlm_ext builds it)

    tensors = property(lambda self: self._tensors, doc="The tensors (a tuple).")
    offsets = property(lambda self: None if self._offsets is None else list(self._offsets))
    device = property(lambda self: self._device, doc="The tensors' device.")
    numel = property(lambda self: self._numel, doc="Elements of all tensors.")
    flat_numel = property(lambda self: self._flat_numel, doc="Elements a flat buffer needs.")

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        extra = ", offsets" if self._offsets is not None else ""
        return f"TensorTable({len(self)} tensors, {self._numel} elements, {self._device}{extra})"

    def validate(self) -> None:
        """ValueError naming the first tensor whose memory, size, dtype or layout changed."""
        for i, (t, (ptr, n, dtype)) in enumerate(zip(self._tensors, self._seen)):
            if t.dtype != dtype:
                why = f"is now {t.dtype}, was {dtype}"
            elif t.numel() != n:
                why = f"has {t.numel()} elements, had {n}"
            elif t.device != self._device:
                why = f"is now on {t.device}, was on {self._device}"
            elif not t.is_contiguous():
                why = "is no longer contiguous"
            elif n and _storage_ptr(t) != ptr:
                why = f"data moved from 0x{ptr:x} to 0x{_storage_ptr(t):x}"
            else:
                continue
            raise ValueError(
                f"TensorTable.validate: tensors[{i}] {why} since the table was built (its storage was "
                "replaced or reallocated: .data =, set_, resize_); build a new TensorTable from the "
                "current tensors"
            )

    def matches(self, tensors) -> bool:
        """True iff ``tensors`` is a list/tuple of exactly this table's tensor objects, in order."""
        return (
            isinstance(tensors, (list, tuple))
            and len(tensors) == len(self._tensors)
            and all(a is b for a, b in zip(tensors, self._tensors))
        )


TABLE_TYPES: tuple = (TensorTable,)


def register_table_type(cls) -> None:
    """Let the ops below take tables of ``cls`` too (megadlm_ext registers the compiled class)."""
    global TABLE_TYPES
    if cls not in TABLE_TYPES:
        TABLE_TYPES = (*TABLE_TYPES, cls)


def _unpack(tensors, offsets):
    """(list, offsets) of a tensor-list argument that may be a TensorTable of either route."""
    if not isinstance(tensors, TABLE_TYPES):
        return tensors, offsets
    if offsets is not None:
        raise ValueError(
            "offsets must be None with a TensorTable: the table carries its own "
            "(TensorTable(tensors, offsets=...))"
        )
    return list(tensors.tensors), tensors.offsets


def flatten(tensors, out=None, *, offsets=None, scale=1.0, dtype=None) -> torch.Tensor:
    tensors, offsets = _unpack(tensors, offsets)
    tensors = check_list("tensors", tensors, device=None if out is None else out.device)
    if out is not None:
        check_flat("out", out)
        if dtype is not None and dtype != out.dtype:
            raise ValueError(f"dtype={dtype} disagrees with out.dtype={out.dtype}")
    if tensors and out is None:
        dev = tensors[0].device
        for i, t in enumerate(tensors):
            if t.device != dev:
                raise ValueError(f"tensors[{i}] is on {t.device} but tensors[0] is on {dev}")
    offs = resolve_offsets(tensors, offsets, None if out is None else out.numel(), "out")
    if out is None:
        if dtype is None:
            dts = {t.dtype for t in tensors}
            dtype = dts.pop() if len(dts) == 1 else torch.float32
        n = max((o + t.numel() for o, t in zip(offs, tensors)), default=0)
        dev = tensors[0].device if tensors else torch.device("cpu")
        out = (torch.zeros if offsets is not None else torch.empty)(n, dtype=dtype, device=dev)
    else:
        check_no_alias("out", out, tensors)
    for o, t in zip(offs, tensors):
        if t.numel():
            v = t.reshape(-1).float()
            if scale != 1.0:
                v = v * scale
            out[o : o + t.numel()].copy_(v)
    return out


def unflatten(flat, tensors, *, offsets=None, scale=1.0) -> None:
    tensors, offsets = _unpack(tensors, offsets)
    check_flat("flat", flat)
    tensors = check_list("tensors", tensors, device=flat.device)
    offs = resolve_offsets(tensors, offsets, flat.numel())
    check_no_alias("flat", flat, tensors)
    check_distinct(tensors)
    for o, t in zip(offs, tensors):
        if t.numel():
            v = flat[o : o + t.numel()].float()
            if scale != 1.0:
                v = v * scale
            t.view(-1).copy_(v)


def accumulate_into(flat, tensors, *, offsets=None, scale=1.0) -> None:
    tensors, offsets = _unpack(tensors, offsets)
    check_flat("flat", flat)
    tensors = check_list("tensors", tensors, device=flat.device)
    offs = resolve_offsets(tensors, offsets, flat.numel())
    check_no_alias("flat", flat, tensors)
    for o, t in zip(offs, tensors):
        if t.numel():
            dst = flat[o : o + t.numel()]
            v = t.reshape(-1).float()
            if scale != 1.0:
                v = v * scale
            dst.copy_(dst.float() + v)


def scale_(tensors, factor) -> None:
    tensors, _ = _unpack(tensors, None)
    tensors = check_list("tensors", tensors)
    check_distinct(tensors)
    for t in tensors:
        if t.numel():
            t.copy_(t.float() * float(factor))


def l2_norm(tensors) -> torch.Tensor:
    tensors, _ = _unpack(tensors, None)
    tensors = check_list("tensors", tensors)
    dev = tensors[0].device if tensors else torch.device("cpu")
    acc = torch.zeros((), dtype=torch.float32, device=dev)
    for t in tensors:
        if t.numel():
            acc += t.float().pow(2).sum()
    return acc.sqrt()


def nonfinite_flag(tensors) -> torch.Tensor:
    tensors, _ = _unpack(tensors, None)
    tensors = check_list("tensors", tensors)
    device = tensors[0].device if tensors else torch.device("cpu")
    flags = [(~torch.isfinite(t)).any() for t in tensors if t.numel()]
    bad = torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool, device=device)
    return bad.to(torch.int32)


def has_nonfinite(tensors) -> bool:
    tensors, _ = _unpack(tensors, None)
    tensors = check_list("tensors", tensors)
    return any(t.numel() and not bool(torch.isfinite(t).all()) for t in tensors)


def check_wgrad(main_grad, grad_output, input) -> None:
    """The checks of ``wgrad_accumulate`` (the compiled route words them the same way)."""
    for name, t in (("main_grad", main_grad), ("grad_output", grad_output), ("input", input)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if main_grad.dtype != torch.float32:
        raise ValueError(
            f"wgrad_accumulate: main_grad must be float32 (the fp32 gradient buffer), got {main_grad.dtype}"
        )
    if main_grad.dim() != 2 or not main_grad.is_contiguous():
        raise ValueError(
            f"wgrad_accumulate: main_grad must be a contiguous 2-D [out, in] tensor, got shape "
            f"{list(main_grad.shape)}" + ("" if main_grad.is_contiguous() else " (not contiguous)")
        )
    for name, t in (("grad_output", grad_output), ("input", input)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"wgrad_accumulate: {name} has dtype {t.dtype}; supported: float32, bfloat16, float16"
            )
        if t.dim() < 1:
            raise ValueError(f"wgrad_accumulate: {name} must have at least one dim")
        if not t.is_contiguous():
            raise ValueError(
                f"wgrad_accumulate: {name} is not contiguous (strides {tuple(t.stride())}); "
                f"pass {name}.contiguous()"
            )
        if t.device != main_grad.device:
            raise ValueError(
                f"wgrad_accumulate: {name} is on {t.device} but main_grad is on {main_grad.device}"
            )
    if grad_output.dtype != input.dtype:
        raise ValueError(
            f"wgrad_accumulate: grad_output is {grad_output.dtype} but input is {input.dtype}; "
            "they must have the same dtype"
        )
    if grad_output.shape[-1] != main_grad.shape[0] or input.shape[-1] != main_grad.shape[1]:
        raise ValueError(
            f"wgrad_accumulate: main_grad {list(main_grad.shape)} must be [grad_output.shape[-1], "
            f"input.shape[-1]] = [{grad_output.shape[-1]}, {input.shape[-1]}]"
        )
    if grad_output.shape[:-1] != input.shape[:-1]:
        raise ValueError(
            f"wgrad_accumulate: grad_output {list(grad_output.shape)} and input {list(input.shape)} "
            "must have the same leading dims"
        )


def wgrad_accumulate(main_grad, grad_output, input, *, alpha=1.0) -> None:
    check_wgrad(main_grad, grad_output, input)
    go = grad_output.reshape(-1, grad_output.shape[-1])
    x = input.reshape(-1, input.shape[-1])
    with torch.no_grad():
        main_grad.addmm_(go.t().float(), x.float(), alpha=alpha)


def _check_grouped_tensor(t, name: str, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"grouped_gemm: {name} has dtype {t.dtype}; supported: float32, bfloat16, float16")
    if t.dim() != dim:
        raise ValueError(f"grouped_gemm: {name} must be {dim}-D, got shape {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(
            f"grouped_gemm: {name} is not contiguous (strides {tuple(t.stride())}); pass {name}.contiguous()"
        )


def check_grouped(a, b, batch_sizes, trans_a: bool, trans_b: bool) -> list:
    """The checks of ``grouped_gemm`` (the compiled route words them the same way); returns
    the shape of the result."""
    _check_grouped_tensor(a, "a", 2)
    _check_grouped_tensor(b, "b", 2 if trans_a else 3)
    if b.dtype != a.dtype:
        raise ValueError(f"grouped_gemm: a is {a.dtype} but b is {b.dtype}; they must have the same dtype")
    if b.device != a.device:
        raise ValueError(f"grouped_gemm: b is on {b.device} but a is on {a.device}")
    bs = batch_sizes
    if (
        not isinstance(bs, torch.Tensor)
        or bs.dtype != torch.int64
        or bs.dim() != 1
        or bs.device.type != "cpu"
        or not bs.is_contiguous()
    ):
        got = (
            f"{bs.dtype} {list(bs.shape)} on {bs.device}"
            if isinstance(bs, torch.Tensor)
            else type(bs).__name__
        )
        raise ValueError(
            "grouped_gemm: batch_sizes must be a contiguous 1-D int64 cpu tensor (the rows of each group), "
            f"got {got}"
        )
    sizes = bs.tolist()
    for g, s in enumerate(sizes):
        if s < 0:
            raise ValueError(f"grouped_gemm: batch_sizes[{g}] = {s} is negative")
    if sum(sizes) != a.shape[0]:
        raise ValueError(f"grouped_gemm: batch_sizes sum to {sum(sizes)} but a has {a.shape[0]} rows")
    groups = len(sizes)
    if trans_a:
        if trans_b:
            raise ValueError("grouped_gemm: trans_a and trans_b together are not supported")
        if b.shape[0] != a.shape[0]:
            raise ValueError(
                f"grouped_gemm: with trans_a, a {list(a.shape)} and b {list(b.shape)} must have the same rows"
            )
        return [groups, a.shape[1], b.shape[1]]
    inner = b.shape[2] if trans_b else b.shape[1]
    if b.shape[0] != groups or inner != a.shape[1]:
        want = f"[{groups}, n, {a.shape[1]}]" if trans_b else f"[{groups}, {a.shape[1]}, n]"
        raise ValueError(
            f"grouped_gemm: b {list(b.shape)} must be {want} for a {list(a.shape)} and {groups} batch_sizes"
            + (" (trans_b)" if trans_b else "")
        )
    return [a.shape[0], b.shape[1] if trans_b else b.shape[2]]


def grouped_gemm(a, b, batch_sizes, *, trans_a=False, trans_b=False, out=None, accumulate=False, alpha=1.0):
    shape = check_grouped(a, b, batch_sizes, trans_a, trans_b)
    if out is None:
        if accumulate:
            raise ValueError("grouped_gemm: accumulate=True needs out")
        out = torch.empty(shape, dtype=a.dtype, device=a.device)
    else:
        if out.dtype not in (a.dtype, torch.float32):
            raise ValueError(
                f"grouped_gemm: out is {out.dtype}; it must be {a.dtype} (a's dtype) or torch.float32"
            )
        if list(out.shape) != shape or not out.is_contiguous():
            raise ValueError(
                f"grouped_gemm: out must be a contiguous {shape} tensor, got {list(out.shape)}"
                + ("" if out.is_contiguous() else " (not contiguous)")
            )
        if out.device != a.device:
            raise ValueError(f"grouped_gemm: out is on {out.device} but a is on {a.device}")
    row = 0
    with torch.no_grad():
        for g, rows in enumerate(batch_sizes.tolist()):
            ag = a[row : row + rows].float()
            if trans_a:
                res, dst = ag.t() @ b[row : row + rows].float(), out[g]
            else:
                bg = b[g].float()
                res, dst = ag @ (bg.t() if trans_b else bg), out[row : row + rows]
            res = res * alpha
            dst.copy_(dst.float() + res if accumulate else res)
            row += rows
    return out


# The reference routes of other families of ops, each in its own file: the fused AdamW step,
# the fused transformer ops.
from .reference_adam import adamw_step  # noqa: E402, F401
from .reference_fused import (  # noqa: E402, F401
    add_rmsnorm,
    add_rmsnorm_backward,
    rope,
    swiglu,
    swiglu_backward,
)
