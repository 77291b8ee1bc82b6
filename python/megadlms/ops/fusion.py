"""The device rule of the fused elementwise kernels (rotary embedding, SwiGLU, residual add +
RMSNorm), in one place.

Fusion exists to cut GPU kernel launches and memory traffic: with its flag on (the default,
as in Megatron) a fused path runs on CUDA tensors. On CPU tensors the model runs the unfused
torch ops exactly as before the fused kernels existed, so a CPU run is bitwise what it was.
Tests run the fused kernels on CPU (the extension's compiled CPU route) inside
:func:`fused_kernels_on_cpu` to compare them with the unfused ops.

The switch is process-wide, not thread-local: activation recomputation re-runs a forward
from inside the backward (on autograd's thread), and must take the path the first forward
took.
"""

from __future__ import annotations

import contextlib
import logging

import torch

_log = logging.getLogger(__name__)
_force_cpu = False
_declined: set[tuple[str, str]] = set()


@contextlib.contextmanager
def fused_kernels_on_cpu(enabled: bool = True):
    """Inside this block the fused paths also run on CPU tensors (their flags still apply).
    For tests and debugging: a CPU training run outside it never takes them."""
    global _force_cpu
    prev, _force_cpu = _force_cpu, enabled
    try:
        yield
    finally:
        _force_cpu = prev


def fusion_applies(enabled: bool, *tensors: torch.Tensor) -> bool:
    """The device rule: True when the fused path's flag is on and every tensor is a CUDA
    tensor, or a CPU tensor inside :func:`fused_kernels_on_cpu`."""
    if not enabled:
        return False
    kind = "cpu" if _force_cpu else None
    return all(t.is_cuda or t.device.type == kind for t in tensors)


def decline_once(what: str, why: str) -> None:
    """A fused path that applies by flag and device but cannot take these inputs: the unfused
    ops run instead (the same numbers up to rounding; only speed differs), logged once."""
    if (what, why) not in _declined:
        _declined.add((what, why))
        _log.warning("%s: the unfused ops run instead of the fused kernel: %s", what, why)
