"""Compute ops with autograd over the compiled extension (``megadlm_ext``).

- :func:`grouped_matmul` (:mod:`megadlms.ops.grouped_gemm`): the MoE experts' grouped GEMM.
"""

from .grouped_gemm import grouped_matmul

__all__ = ["grouped_matmul"]
