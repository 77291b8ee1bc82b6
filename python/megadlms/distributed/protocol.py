"""The one interface every data-parallel wrapper implements (docs/architecture.md).

The trainer and the optimizer use a wrapper only through :class:`DataParallel`; they
never ask which class it is. Both of ours implement it: ``DistributedDataParallel``
(Megatron-style grad buffers) and ``TorchFullyShardedDataParallel`` (FSDP2).

How a gradient is reduced is the wrapper's business; what the optimizer needs to know is
``optimizer_layout``:

* ``"replicated"``: every rank holds the full reduced gradient of every parameter
  (``main_grad(p)``); the optimizer keeps full (fp32) main params.
* ``"bucket_shards"``: the distributed optimizer. Gradients live in ``grad_buckets``; rank
  r owns ``bucket.shard_range(r, dp)`` of every bucket, reduced there by reduce-scatter;
  after the step the updated shards are gathered back by ``start_param_sync()``.
* ``"dtensor"``: FSDP2. Parameters and gradients are DTensors sharded on dim 0; they are
  the optimizer's main params and grads.

``comm`` (see ``comm.py``) is the data-parallel communicator; ``shard_comm`` the one over
the ranks among which the optimizer state is sharded (``"bucket_shards"``: the data-parallel
group, or one distributed-optimizer instance of it; ``"dtensor"``: the data-parallel group).
``parallel`` is the ``megadlms.parallel.ParallelGroups`` of a tensor-/pipeline-parallel run
(None for plain data parallelism): the optimizer reads the model-parallel group and the
tensor-parallel rank from it, to count every gradient element once in the norm and to make
every skip decision on all ranks of the grid.
"""

from __future__ import annotations

from typing import Any, ContextManager, Dict, Iterator, List, Optional, Protocol, runtime_checkable

import torch

from megadlms.common.collectives import Communicator
from megadlms.common.enums import OptimizerLayout
from megadlms.optimizer.source import GradientSource
from megadlms.parallel.groups import ParallelGroups

from .config import DistributedDataParallelConfig

OPTIMIZER_LAYOUTS = tuple(m.value for m in OptimizerLayout)


@runtime_checkable
class DataParallel(GradientSource, Protocol):
    """What the trainer and the optimizer may call on a data-parallel wrapper (the optimizer's
    part, ``GradientSource``, is declared in the optimizer layer, which does not import this
    one; it is repeated here with the wrapper-side details)."""

    module: torch.nn.Module
    """The wrapped model (``unwrap_model`` peels every wrapper)."""
    ddp_config: DistributedDataParallelConfig
    optimizer_layout: OptimizerLayout
    """One of ``OPTIMIZER_LAYOUTS`` (module docstring)."""
    comm: Communicator
    """Communicator over the data-parallel group: ``world_size``, ``rank``, ``all_reduce``,
    ``all_gather`` (``comm.py``)."""
    shard_comm: Communicator
    """Communicator over the ranks sharing one sharded copy of the optimizer state: rank r of
    it owns ``bucket.shard_range(r, shard_comm.world_size)`` (``"bucket_shards"``); ``comm``
    unless distributed-optimizer instances split the data-parallel group. A bucket that
    carries a ``reduce_group`` (our DDP: expert buckets over expert_dp) is sharded over
    ``bucket.reduce_group.shard_comm`` instead."""
    parallel: Optional[ParallelGroups]
    """The run's ``ParallelGroups`` (tp, dp, mp, ... axes) when the wrapper was built over a
    tensor-/pipeline-parallel grid, else None (plain data parallelism)."""

    @property
    def chunks(self) -> List[DataParallel]:
        """The per-chunk wrappers the step's schedule runs, in stage order: ``[self]`` for
        one model, a pipeline rank's chunk wrappers for ``ModelChunks``."""

    def forward(self, *args, **kwargs): ...

    # The torch.nn.Module surface the step and the schedules use (every wrapper is a Module).
    training: bool

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...

    def no_sync(self) -> ContextManager:
        """Accumulate gradients locally; the next synced backward reduces the sum."""

    def start_grad_sync(self) -> None:
        """Launch every gradient collective not launched yet."""

    def finish_grad_sync(self) -> None:
        """Wait for the gradient collectives; afterwards the reduced gradients are final.
        With ``check_for_nan_in_grad`` a NaN/Inf on any rank raises on every rank."""

    def zero_grad_buffer(self) -> None:
        """Zero the gradients before a step's first micro-batch."""

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every local gradient (or gradient shard) in place."""

    def broadcast_params(self) -> None:
        """Make every replica equal to data-parallel rank 0's (no-op where nothing is replicated)."""

    def named_trainable_parameters(self) -> Dict[torch.nn.Parameter, str]:
        """Each trainable parameter once (tied weights once), in registration order, with
        its fully qualified name in the unwrapped model."""

    def main_grad(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """``"replicated"`` layout: the reduced gradient of ``param`` (None if it has none)."""

    @property
    def grad_buckets(self) -> List:
        """``"bucket_shards"`` layout: the gradient buckets (``param_and_grad_buffer.Bucket``)."""

    def start_param_sync(self, *, force_sync: bool = False) -> None:
        """``"bucket_shards"`` layout: all-gather the updated parameter shards (async with
        ``overlap_param_gather``: forward pre-hooks wait for them)."""

    def finish_param_sync(self) -> None:
        """Wait for every parameter gather in flight. Whoever reads parameters outside a
        forward (norms, checkpoints, evaluation helpers) calls it first: a gather in flight
        writes them at an unknown moment (docs/ddp.md, "Overlapped collectives")."""

    def state_dict(self, *args, **kwargs): ...

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False): ...
