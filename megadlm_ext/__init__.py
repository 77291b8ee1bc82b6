"""megadlm_ext: fused multi-tensor ops (C++ CPU kernels, CUDA kernels) and NCCL glue.

Every op has two routes: the compiled one (``megadlm_ext._C``) and a plain-PyTorch
reference (:mod:`megadlm_ext.reference`) with the same contract and checks.
``force_reference()`` / ``MEGADLM_EXT_FORCE_REFERENCE=1`` pick the reference
(tests compare the two). If the compiled module is missing the reference route is
used and a warning is logged once; ``backend_info()["compiled"]`` says which.
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
    """Copy ``tensors`` (cast, times ``scale``) into one flat buffer at ``offsets``; return it."""
    return _impl().flatten(tensors, out, offsets=offsets, scale=scale, dtype=dtype)


def unflatten(flat, tensors, *, offsets=None, scale=1.0) -> None:
    """``tensors[i][:] = scale * flat[offsets[i]:offsets[i]+numel]`` (cast), in place."""
    return _impl().unflatten(flat, tensors, offsets=offsets, scale=scale)


def accumulate_into(flat, tensors, *, offsets=None, scale=1.0) -> None:
    """``flat[offsets[i]:...] += scale * tensors[i]`` with fp32 arithmetic, in place."""
    return _impl().accumulate_into(flat, tensors, offsets=offsets, scale=scale)


def scale_(tensors, factor) -> None:
    """Multiply every tensor by ``factor`` in place."""
    return _impl().scale_(tensors, factor)


def l2_norm(tensors):
    """Global L2 norm over all tensors, accumulated in fp32; a 0-d fp32 tensor."""
    return _impl().l2_norm(tensors)


def has_nonfinite(tensors) -> bool:
    """True if any element of any tensor is NaN or +-Inf."""
    return bool(_impl().has_nonfinite(tensors))


def nonfinite_flag(tensors):
    """0-d int32 tensor on the tensors' device, 1 if any element is NaN or +-Inf. Unlike
    :func:`has_nonfinite` it does not sync the host: read it when the answer is needed."""
    return _impl().nonfinite_flag(tensors)


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
    impl = _impl()
    if not hasattr(impl, "grouped_gemm"):  # a _C built before the op existed
        raise RuntimeError(
            "megadlm_ext._C has no grouped_gemm: it was built from older sources; rebuild it "
            "(pip install --no-build-isolation -e . or python setup.py build_ext --inplace)"
        )
    return impl.grouped_gemm(
        a, b, batch_sizes, trans_a=trans_a, trans_b=trans_b, out=out, accumulate=accumulate, alpha=alpha
    )


# ---- fused transformer ops (python/megadlms/ops wraps them in autograd Functions) ------------
def _op(name: str):
    impl = _impl()
    if not hasattr(impl, name):  # a _C built before the op existed
        raise RuntimeError(
            f"megadlm_ext._C has no {name}: it was built from older sources; rebuild it "
            "(pip install --no-build-isolation -e . or python setup.py build_ext --inplace)"
        )
    return getattr(impl, name)


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
