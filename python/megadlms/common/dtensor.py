"""One answer to "is this a DTensor, and what is its local tensor?".

FSDP2's parameters, gradients and optimizer state are DTensors; every other tensor here is a
plain ``torch.Tensor``. ``DTensor`` is imported once, here: without it (torch < 2.4, or a torch
built without distributed) nothing is a DTensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

_DTENSOR: Optional[type]
try:
    from torch.distributed.tensor import DTensor as _DTENSOR
except ImportError:  # torch < 2.4: no DTensor, and no FSDP2 either
    _DTENSOR = None


def is_dtensor(t: Any) -> TypeGuard[DTensor]:
    """Whether ``t`` is a DTensor (False for plain tensors and anything else)."""
    return _DTENSOR is not None and isinstance(t, _DTENSOR)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (``to_local()``, differentiable), else ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t
