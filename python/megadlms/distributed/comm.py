"""One small interface over the data-parallel collectives.

``build_communicator(backend, group)`` returns an object with

    all_reduce(tensor, op="sum"|"avg", async_op=False) -> handle | None   (in place)
    reduce_scatter(output, input, op="sum"|"avg", async_op=False) -> handle | None
    all_gather(output, input, async_op=False) -> handle | None
    world_size, rank, supports_avg

A handle has ``wait()``. Backends:

* ``"torch"``: torch.distributed on ``group`` (gloo on CPU, NCCL on GPU), with the
  single-tensor collectives (``reduce_scatter_single``/``all_gather_single``; the older
  ``*_tensor`` names on torch versions that lack them).
* ``"nccl_ext"``: ``megadlm_ext.nccl.Communicator``, the extension's own NCCL
  communicator, bootstrapped with a unique id broadcast over ``group``. Each collective
  runs on the communicator's own CUDA stream, after the work already queued on the
  current stream (the fold kernel of the bucket), so it overlaps the rest of backward;
  the handle's ``wait()`` makes the current stream wait for it (no host sync), and a
  blocking call (``async_op=False``) does that wait before returning. Init and every
  collective are bounded by the group's timeout (``--distributed-timeout-minutes``): a
  watchdog aborts the communicator and later calls raise an error naming the rank and
  the collective. GPU only: on CPU asking for it raises a RuntimeError.

A one-rank world (or no process group at all) gets a local communicator that copies,
so every wrapper works unchanged on one process.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megadlms.common.enums import CommBackend
from megadlms.parallel.mappings import all_gather_single, reduce_scatter_single

_log = logging.getLogger(__name__)


def _check_op(op: str) -> str:
    if op not in ("sum", "avg"):
        raise ValueError(f"collective op must be 'sum' or 'avg', got {op!r}")
    return op


class _Done:
    """Handle of an operation that has already completed (or is stream-ordered)."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class LocalCommunicator:
    """World of one rank: every collective is the identity (copies where buffers differ)."""

    world_size, rank, supports_avg = 1, 0, True

    def all_reduce(self, tensor, op="sum", async_op=False):
        _check_op(op)
        return _Done() if async_op else None

    def reduce_scatter(self, output, input, op="sum", async_op=False):
        _check_op(op)
        # The wrappers' in-place form (the output is rank 0's slice of the input) is already
        # done on one rank.
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return _Done() if async_op else None

    def all_gather(self, output, input, async_op=False):
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return _Done() if async_op else None


class TorchCommunicator:
    """torch.distributed collectives on ``group``."""

    def __init__(self, group) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.supports_avg = self._probe_avg()

    def _probe_avg(self) -> bool:
        # Older gloo builds reject ReduceOp.AVG (torch 2.13's accepts it). The check raises
        # locally before any communication, so every rank takes the same branch.
        if dist.get_backend(self.group) != "gloo":
            return True
        try:
            dist.all_reduce(torch.zeros(1), op=dist.ReduceOp.AVG, group=self.group)
            return True
        except (RuntimeError, ValueError):
            _log.info("gloo has no ReduceOp.AVG here: averaging by pre-dividing by the world size")
            return False

    @staticmethod
    def _op(op: str):
        return dist.ReduceOp.AVG if _check_op(op) == "avg" else dist.ReduceOp.SUM

    def all_reduce(self, tensor, op="sum", async_op=False):
        return dist.all_reduce(tensor, op=self._op(op), group=self.group, async_op=async_op)

    def reduce_scatter(self, output, input, op="sum", async_op=False):
        return reduce_scatter_single(output, input, op=self._op(op), group=self.group, async_op=async_op)

    def all_gather(self, output, input, async_op=False):
        return all_gather_single(output, input, group=self.group, async_op=async_op)


class NcclExtCommunicator:
    """megadlm_ext's NCCL communicator: collectives on its own stream, bounded by a timeout."""

    supports_avg = True

    def __init__(self, group, timeout: float | None = None) -> None:
        fix = (
            "use comm_backend='torch' (--comm-backend torch), or run on CUDA devices with "
            "megadlm_ext built with CUDA and a loadable libnccl.so.2"
        )
        if not torch.cuda.is_available():
            raise RuntimeError(f"comm_backend='nccl_ext' needs a CUDA device, and none is available: {fix}")
        try:
            from megadlm_ext import nccl as ext_nccl
        except ImportError as exc:
            raise RuntimeError(
                f"comm_backend='nccl_ext': megadlm_ext.nccl is unavailable ({exc}): {fix}"
            ) from exc
        if not ext_nccl.available():
            raise RuntimeError(f"comm_backend='nccl_ext': this megadlm_ext build has no NCCL: {fix}")
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # The group's own timeout (init_process_group(timeout=...), i.e.
        # --distributed-timeout-minutes) bounds the NCCL init and every collective.
        self.timeout = ext_nccl.group_timeout(group) if timeout is None else float(timeout)
        self._comm = ext_nccl.Communicator.from_process_group(
            group, device=torch.cuda.current_device(), timeout=self.timeout
        )

    @staticmethod
    def _finish(work, async_op):
        # Blocking call: the current stream waits for the collective (no host sync).
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce(self, tensor, op="sum", async_op=False):
        return self._finish(self._comm.all_reduce(tensor, _check_op(op)), async_op)

    def reduce_scatter(self, output, input, op="sum", async_op=False):
        return self._finish(self._comm.reduce_scatter(output, input, _check_op(op)), async_op)

    def all_gather(self, output, input, async_op=False):
        return self._finish(self._comm.all_gather(output, input), async_op)

    def abort(self, why: str = "aborted by the caller") -> None:
        """Abort the NCCL communicator (unblocks peers' pending kernels); later calls raise."""
        self._comm.abort(why)

    def close(self) -> None:
        """Flush and destroy the NCCL communicator (without the GIL)."""
        self._comm.close()


def resolve_group(process_group):
    """The process group to use: the given one, else WORLD, else None (no distributed run)."""
    if process_group is not None:
        return process_group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def build_communicator(backend: CommBackend, group):
    """Communicator for ``backend`` (a :class:`CommBackend` or its value) over ``group``
    (None: one process)."""
    if backend not in tuple(CommBackend):
        raise ValueError(f"comm_backend must be 'torch' or 'nccl_ext', got {backend!r}")
    if backend == CommBackend.NCCL_EXT:
        if group is None:
            raise RuntimeError(
                "comm_backend='nccl_ext' needs an initialised process group "
                "(launch with torchrun) to broadcast the NCCL unique id"
            )
        return NcclExtCommunicator(group)
    if group is None or dist.get_world_size(group) == 1:
        return LocalCommunicator()
    return TorchCommunicator(group)


def sum_in_place(comm, tensors) -> None:
    """Sum ``tensors`` over ``comm``'s ranks in place, one all-reduce per dtype instead of one
    per tensor (every rank must pass the same list). cat copies, hence the copy back."""
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        comm.all_reduce(flat, "sum")
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
