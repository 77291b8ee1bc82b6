"""The names of the step's profiler ranges, one place for every layer that marks one.

``traced(name)`` is ``torch.profiler.record_function``: a torch profiler trace
(``--use-pytorch-profiler``) shows it as a named range, and under ``emit_nvtx`` (the nsys path
of ``--profile``) it becomes an NVTX range of the same name. With no profiler running it only
costs the call (no tensor is touched, no number changes). The names follow Megatron's timers
(``forward-compute``, ``backward-compute``, ``optimizer``).
"""

from __future__ import annotations

from torch.profiler import record_function

__all__ = ["BACKWARD", "FORWARD", "OPTIMIZER", "PIPELINE_P2P", "grad_sync", "param_gather", "traced"]

FORWARD = "forward-compute"
"""One micro-batch's forward (a pipeline chunk's forward under pp > 1)."""
BACKWARD = "backward-compute"
"""One micro-batch's backward (DDP's bucket collectives launch inside it when ready)."""
OPTIMIZER = "optimizer"
"""The optimizer step: grad norm, clipping, update (and the distributed optimizer's gathers)."""
PIPELINE_P2P = "pipeline-send-recv"
"""One batched point-to-point exchange between neighbouring pipeline stages."""


def grad_sync(index: int, collective: str) -> str:
    """The range of bucket ``index``'s gradient collective launch (``all-reduce`` or
    ``reduce-scatter``; asynchronous: the wait is in ``finish_grad_sync``)."""
    return f"grad-sync bucket {index} {collective}"


def param_gather(index: int) -> str:
    """The range of bucket ``index``'s parameter all-gather launch (distributed optimizer)."""
    return f"param-gather bucket {index} all-gather"


def traced(name: str) -> record_function:
    """A profiler range named ``name`` (a context manager)."""
    return record_function(name)
