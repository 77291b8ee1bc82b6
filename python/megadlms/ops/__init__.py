"""Compute ops with autograd over the compiled extension (``megadlm_ext``).

- :func:`grouped_matmul` (:mod:`megadlms.ops.grouped_gemm`): the MoE experts' grouped GEMM.
- The transformer's fused elementwise work, each beside the unfused torch ops it replaces and
  chosen by the device rule of :mod:`megadlms.ops.fusion` (fused on CUDA tensors when the
  flag is on; CPU runs the unfused ops, bitwise as before; :func:`fused_kernels_on_cpu`
  forces the kernels on CPU for tests): :func:`apply_rotary` (:mod:`.rotary`), :func:`swiglu`
  (:mod:`.swiglu`), :func:`residual_add_norm` (:mod:`.add_rmsnorm`).
"""

from .add_rmsnorm import fused_add_rmsnorm, residual_add_norm
from .fusion import fused_kernels_on_cpu, fusion_applies
from .grouped_gemm import grouped_matmul
from .rotary import apply_rotary, fused_rotary
from .swiglu import fused_swiglu, swiglu

__all__ = [
    "apply_rotary",
    "fused_add_rmsnorm",
    "fused_kernels_on_cpu",
    "fused_rotary",
    "fused_swiglu",
    "fusion_applies",
    "grouped_matmul",
    "residual_add_norm",
    "swiglu",
]
