"""The shape of a data-parallel communicator, for the type checker and the reader.

``distributed/comm.py`` builds the real ones (local, torch.distributed, the extension's NCCL);
the optimizer, which sits below ``distributed``, and the wrappers' protocol name them by
this interface only.
"""

from __future__ import annotations

from typing import Literal, Optional, Protocol, overload

import torch


class Handle(Protocol):
    """An asynchronous collective in flight."""

    def wait(self) -> object: ...


class Communicator(Protocol):
    """Collectives over one group of ranks (``op``: "sum" or "avg"; in place where the
    buffers alias). ``async_op=True`` returns a :class:`Handle`, else None."""

    world_size: int
    rank: int
    supports_avg: bool

    # The async form always returns a handle: told apart for the callers that wait on it.
    @overload
    def all_reduce(self, tensor: torch.Tensor, op: str = ..., *, async_op: Literal[True]) -> Handle: ...
    @overload
    def all_reduce(self, tensor: torch.Tensor, op: str = ..., async_op: bool = ...) -> Optional[Handle]: ...

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", async_op: bool = False
    ) -> Optional[Handle]: ...

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Optional[Handle]: ...
