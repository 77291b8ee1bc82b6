"""megadlm_ext: fused multi-tensor ops (C++ CPU kernels, CUDA kernels) and NCCL glue.

Every op has two routes: the compiled one (``megadlm_ext._C``) and a plain-PyTorch
reference (:mod:`megadlm_ext.reference`) with the same contract and checks.
``force_reference()`` / ``MEGADLM_EXT_FORCE_REFERENCE=1`` pick the reference
(tests compare the two). If the compiled module is missing the reference route is
used and a warning is logged once; ``backend_info()["compiled"]`` says which. Every op
taking a tensor list also takes a :class:`TensorTable` (a list validated once, for
tensors that persist across steps).
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch  # noqa: F401  (loads libtorch before _C)

from . import reference as _ref

__version__ = "0.1.0"
_log = logging.getLogger("megadlm_ext")

try:
    from . import _C  # type: ignore[attr-defined]

    _IMPORT_ERROR = None
except ImportError as exc:  # not built: reference route only
    _C = None
    _IMPORT_ERROR = exc

_force_reference = os.environ.get("MEGADLM_EXT_FORCE_REFERENCE", "0") == "1"
_warned = False
if _C is not None:
    _ref.register_table_type(_C.TensorTable)  # the reference ops take compiled tables too


def _impl():
    global _warned
    if _C is None or _force_reference:
        if _C is None and not _warned:
            _log.warning(
                "megadlm_ext._C is not built (%s); using the slower PyTorch reference route", _IMPORT_ERROR
            )
            _warned = True
        return _ref
    return _C


def _route(tensors):
    """(the route to run, the tensor-list argument for it). A reference table on the compiled
    route is replaced by its compiled twin (built once, then kept with it)."""
    impl = _impl()
    if impl is _C and type(tensors) is _ref.TensorTable:
        if tensors._twin is None:
            tensors._twin = _C.TensorTable(tensors.tensors, offsets=tensors.offsets)
        tensors = tensors._twin
    return impl, tensors


class _TableType(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, _ref.TABLE_TYPES)


class TensorTable(metaclass=_TableType):
    """``TensorTable(tensors, *, offsets=None)``: a tensor list validated once, for tensors that
    persist across steps (parameters, main-grad buffers, optimizer state).

    Pass it wherever an op takes ``tensors`` (flatten, unflatten, accumulate_into, scale_,
    l2_norm, has_nonfinite, nonfinite_flag): the results are bitwise the list's, and on a known
    table an op does O(1) host work -- no list parsing; the segment table of each flat buffer
    (same address, dtype and length) is built on first use and cached in the table, and on CUDA
    so is its device copy, so an eager call is one kernel launch (see docs/extension.md).

    ``tensors`` is checked once as the list path checks it (contiguous, float32 / bfloat16 /
    float16, one device; ``unflatten`` and ``scale_`` still refuse tensors that share memory).
    ``offsets`` (None: packed) are the tensors' element offsets in every flat buffer the table
    is used with; the ops then take ``offsets=None``. The table holds the tensors and their
    storages, so nothing it points at is freed under it.

    What it assumes: the tensors keep their memory while the table is used -- no ``.data =``,
    ``set_``, ``resize_`` or ``untyped_storage().resize_`` on them (the table would go on using
    the old memory; in-place writes such as ``copy_``, ``zero_``, ``mul_`` are fine).
    ``validate()`` checks that in O(n) and raises a ValueError naming the first tensor that
    moved; ``matches(tensors)`` says whether a list holds exactly this table's tensor objects
    (an O(n) pointer comparison), for callers that rebuild a table when their list changes.

    Attributes: ``tensors`` (tuple), ``offsets`` (list or None), ``device``, ``numel`` (elements
    of all tensors), ``flat_numel`` (elements a flat buffer needs); ``len(table)``.

    This constructor returns the compiled ``megadlm_ext._C.TensorTable``, or the reference
    route's :class:`megadlm_ext.reference.TensorTable` when the compiled module is missing or
    :func:`force_reference` is on; ``isinstance(t, megadlm_ext.TensorTable)`` holds for both,
    and each route's ops take either.
    """

    def __new__(cls, tensors, *, offsets=None):
        return _impl().TensorTable(tensors, offsets=offsets)


@contextlib.contextmanager
def force_reference(enabled: bool = True):
    """Run ops through the plain-PyTorch reference route inside this block."""
    global _force_reference
    prev, _force_reference = _force_reference, enabled
    try:
        yield
    finally:
        _force_reference = prev


def backend_info() -> dict:
    """{"version", "compiled", "cuda", "nccl"}: what this build of the extension provides."""
    if _C is None:
        return {
            "version": __version__,
            "compiled": False,
            "cuda": False,
            "nccl": False,
            "error": str(_IMPORT_ERROR),
        }
    info = dict(_C.backend_info())
    info["version"] = __version__
    if info["cuda"]:  # libnccl matters only next to CUDA kernels; False on CPU builds
        from . import nccl

        info["nccl"] = nccl.available()
    return info


def flatten(tensors, out=None, *, offsets=None, scale=1.0, dtype=None):
    """Copy ``tensors`` (cast, times ``scale``) into one flat buffer at ``offsets``; return it.

    ``tensors`` (here and in every op below): a list / tuple of tensors or a
    :class:`TensorTable` (whose own offsets apply: pass ``offsets=None``)."""
    impl, tensors = _route(tensors)
    return impl.flatten(tensors, out, offsets=offsets, scale=scale, dtype=dtype)


def unflatten(flat, tensors, *, offsets=None, scale=1.0) -> None:
    """``tensors[i][:] = scale * flat[offsets[i]:offsets[i]+numel]`` (cast), in place."""
    impl, tensors = _route(tensors)
    return impl.unflatten(flat, tensors, offsets=offsets, scale=scale)


def accumulate_into(flat, tensors, *, offsets=None, scale=1.0) -> None:
    """``flat[offsets[i]:...] += scale * tensors[i]`` with fp32 arithmetic, in place."""
    impl, tensors = _route(tensors)
    return impl.accumulate_into(flat, tensors, offsets=offsets, scale=scale)


def scale_(tensors, factor) -> None:
    """Multiply every tensor by ``factor`` in place."""
    impl, tensors = _route(tensors)
    return impl.scale_(tensors, factor)


def l2_norm(tensors):
    """Global L2 norm over all tensors, accumulated in fp32; a 0-d fp32 tensor."""
    impl, tensors = _route(tensors)
    return impl.l2_norm(tensors)


def has_nonfinite(tensors) -> bool:
    """True if any element of any tensor is NaN or +-Inf."""
    impl, tensors = _route(tensors)
    return bool(impl.has_nonfinite(tensors))


def nonfinite_flag(tensors):
    """0-d int32 tensor on the tensors' device, 1 if any element is NaN or +-Inf. Unlike
    :func:`has_nonfinite` it does not sync the host: read it when the answer is needed."""
    impl, tensors = _route(tensors)
    return impl.nonfinite_flag(tensors)


def wgrad_accumulate(main_grad, grad_output, input, *, alpha=1.0) -> None:
    """Gradient-accumulation fusion's weight-gradient GEMM, in place:
    ``main_grad += alpha * grad_output^T @ input``.

    ``main_grad``: fp32, contiguous ``[out, in]``; ``grad_output`` ``[..., out]`` and
    ``input`` ``[..., in]`` (same leading dims, flattened), contiguous, one dtype (fp32, bf16
    or fp16), on main_grad's device. Products are accumulated in fp32 (beta = 1). CPU:
    ATen fp32 GEMM over upcast row chunks; CUDA: cublasGemmEx (fp32 compute and output)
    on torch's current stream. Bad arguments raise ValueError naming the tensor.
    """
    return _impl().wgrad_accumulate(main_grad, grad_output, input, alpha=alpha)


def _op(name: str):
    """The route's ``name``; a clear error when the compiled module predates the op."""
    impl = _impl()
    if not hasattr(impl, name):  # a _C built before the op existed
        raise RuntimeError(
            f"megadlm_ext._C has no {name}: it was built from older sources; rebuild it "
            "(pip install --no-build-isolation -e . or python setup.py build_ext --inplace)"
        )
    return getattr(impl, name)


def grouped_gemm(a, b, batch_sizes, *, trans_a=False, trans_b=False, out=None, accumulate=False, alpha=1.0):
    """Grouped GEMM of the MoE experts: one call for all groups (experts), the rows of ``a``
    grouped in order, ``batch_sizes[g]`` rows for group g (a 1-D int64 cpu tensor, sum = rows
    of ``a``, zeros allowed). Returns ``out``.

    - ``trans_a=False``: ``a [T, k]``, ``b [G, k, n]`` (or ``[G, n, k]`` with ``trans_b``);
      ``out [T, n]`` has rows of group g = ``alpha * a_g @ b_g`` (``a_g @ b_g^T``).
    - ``trans_a=True``: ``a [T, k]``, ``b [T, n]``; ``out [G, k, n]``, ``out_g = alpha * a_g^T @ b_g``
      (a group without rows gives zeros) -- the weight gradient.

    ``a``/``b`` contiguous, one dtype (fp32, bf16, fp16), one device. ``out`` (optional) is
    of a's dtype or fp32 (e.g. a DDP ``main_grad``); ``accumulate=True`` adds into it.
    Products are accumulated in fp32 and rounded once into ``out``. CPU: a loop of ATen
    GEMMs in C++ (16-bit operands upcast); CUDA: a loop of cublasGemmEx (fp32 compute) on
    torch's current stream. Bad arguments raise ValueError naming the tensor.
    """
    return _op("grouped_gemm")(
        a, b, batch_sizes, trans_a=trans_a, trans_b=trans_b, out=out, accumulate=accumulate, alpha=alpha
    )


# ---- fused transformer ops (python/megadlms/ops wraps them in autograd Functions) ------------
def rope(x, cos, sin, *, backward=False):
    """Rotary embedding in one pass, Megatron's non-interleaved ("rotate half") form:
    ``x * cos + cat(-x2, x1) * sin`` for ``x [B, S, heads, D]`` (any strides: a view of the
    qkv projection is read in place) and fp32 ``cos``/``sin`` ``[B or 1, S, 1, D]``; math in
    fp32, the result a new contiguous tensor of x's dtype. ``backward=True`` applies the
    transpose of that map (the gradient; the inverse rotation when cos/sin repeat their halves,
    as RotaryEmbedding's do). No cat, no neg, no cast of cos/sin."""
    return _op("rope")(x, cos, sin, backward=backward)


def swiglu(h):
    """``silu(gate) * up`` of ``h [..., 2F] = [gate | up]`` (contiguous) in one pass; fp32
    math, one rounding into h's dtype; returns ``[..., F]``."""
    return _op("swiglu")(h)


def swiglu_backward(h, grad_out):
    """Gradient of :func:`swiglu` with respect to ``h`` (``[..., 2F]``, one pass, silu
    recomputed from ``h``) given ``grad_out [..., F]`` (contiguous, h's dtype)."""
    return _op("swiglu_backward")(h, grad_out)


def add_rmsnorm(x, h, weight, eps):
    """Residual add + RMSNorm in one pass: returns ``(sum, y, rstd)`` with ``sum = x + h``
    (rounded to the dtype: the residual stream), ``y = sum * rstd * weight`` and the fp32
    ``rstd = 1 / sqrt(mean(sum^2) + eps)`` per row ``[...]``. ``x``, ``h`` ``[..., H]`` and
    ``weight [H]``: contiguous, one dtype, one device; statistics in fp32."""
    return _op("add_rmsnorm")(x, h, weight, eps)


def add_rmsnorm_backward(grad_sum, grad_y, sum, weight, rstd):  # noqa: A002 - the op's argument name
    """Gradients of :func:`add_rmsnorm` given those of both outputs: returns ``(grad_x,
    grad_weight)``; ``grad_x`` is also the gradient of ``h`` (``sum = x + h``). The weight
    gradient is reduced over every row (CUDA: per-block fp32 partials summed by a second
    kernel in a fixed order; deterministic)."""
    return _op("add_rmsnorm_backward")(grad_sum, grad_y, sum, weight, rstd)


def adamw_step(
    params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step, model_params=None
) -> None:
    """One AdamW step (torch's math, decoupled weight decay) over lists of tensors, in place:
    one kernel launch for all of them on CUDA, a C++ kernel on CPU.

    Per element, in fp32 registers: ``p *= 1 - lr*weight_decay``; ``m = beta1*m + (1-beta1)*g``;
    ``v = beta2*v + (1-beta2)*g*g``; ``p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)`` with
    ``bc_i = 1 - beta_i**step``. ``step`` is the number of this update (1 for the first, as
    torch's AdamW counts after its increment). The parameter is updated from the unrounded
    new moments; the moments are stored rounded (to nearest even) to their dtypes after.

    - ``params``: fp32 main params, written. ``grads``: fp32 or bf16, read.
    - ``exp_avgs`` / ``exp_avg_sqs``: fp32, bf16 or fp16, stored unscaled, written.
    - ``model_params`` (optional): bf16 / fp16 copies written from the new fp32 params in the
      same pass (what ``copy_main_to_model`` does next, without re-reading the param).

    One entry per parameter in every list, each the parameter's number of elements (any
    shape), contiguous, on params[0]'s device; one dtype per list (call once per dtype
    combination); no two tensors may share memory. Every op rounds once to fp32 (no FMA):
    the CPU kernel, the CUDA kernel and the reference route are bitwise equal. Launched on
    torch's current stream, no host sync; the scalars are fixed at the call (a captured
    CUDA graph replays the same step number). Bad arguments raise ValueError naming the list
    and index.
    """
    _op("adamw_step")(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        model_params=model_params,
    )
