"""What the optimizer reads of a data-parallel wrapper (:class:`GradientSource`).

This layer sits below ``megadlms.distributed`` and does not import it; the wrappers'
``DataParallel`` protocol (``distributed/protocol.py``) extends :class:`GradientSource`, so
every wrapper is one. ``optimizer_layout`` tells the optimizer where the reduced gradients
are ("replicated", "bucket_shards", "dtensor": the protocol's docstring).

A plain module (one process, no wrapper) is adapted once, by :func:`as_gradient_source`, into
:class:`LocalGradients`: past that point the optimizer sees only the protocol.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Protocol, runtime_checkable

import torch

from megadlms.common.collectives import Communicator
from megadlms.common.enums import OptimizerLayout
from megadlms.parallel.groups import ParallelGroups


@runtime_checkable
class GradientSource(Protocol):
    """The members of a data-parallel wrapper the optimizer uses."""

    optimizer_layout: OptimizerLayout
    """Where the reduced gradients are: "replicated", "bucket_shards" or "dtensor"."""
    comm: Optional[Communicator]
    """Communicator over the data-parallel group ("dtensor": the ranks of the shards); None
    on one process without a wrapper."""
    shard_comm: Optional[Communicator]
    """Communicator over the ranks sharing one sharded copy of the optimizer state."""
    parallel: Optional[ParallelGroups]
    """The run's ``ParallelGroups`` over a tensor-/pipeline-parallel grid, else None."""

    def named_trainable_parameters(self) -> Dict[torch.nn.Parameter, str]:
        """Each trainable parameter once, with its name in the unwrapped model."""

    def main_grad(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """ "replicated": the reduced gradient of ``param`` (None if it has none)."""

    @property
    def grad_buckets(self) -> List:
        """ "bucket_shards": the gradient buckets."""

    def zero_grad_buffer(self) -> None:
        """Zero the gradients before a step's first micro-batch."""

    def start_param_sync(self, *, force_sync: bool = False) -> None:
        """ "bucket_shards": gather the updated parameter shards."""


class LocalGradients:
    """A plain module as a :class:`GradientSource`: one process, every gradient is the
    parameter's own ``.grad`` ("replicated", nothing to communicate)."""

    optimizer_layout = OptimizerLayout.REPLICATED
    # one process: the replicated layout never communicates
    comm: Optional[Communicator] = None
    shard_comm: Optional[Communicator] = None
    parallel: Optional[ParallelGroups] = None
    grad_buckets: List = []

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def named_trainable_parameters(self) -> Dict[torch.nn.Parameter, str]:
        return {p: n for n, p in self.module.named_parameters() if p.requires_grad}

    def main_grad(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        return param.grad

    def zero_grad_buffer(self) -> None:
        """Nothing to zero: the optimizer's ``zero_grad`` drops every ``.grad`` itself."""

    def start_param_sync(self, *, force_sync: bool = False) -> None:
        """Nothing to gather."""


def as_gradient_source(model) -> GradientSource:
    """``model`` itself when it is a data-parallel wrapper (it implements the protocol), else
    :class:`LocalGradients` over the plain module: the one place a caller's model is told
    apart, so that the optimizer's code past it has no such branch."""
    if isinstance(model, GradientSource):
        return model
    return LocalGradients(model)
