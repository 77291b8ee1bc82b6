"""The extension's own NCCL communicator (``comm_backend="nccl_ext"``).

libnccl.so.2 is loaded at run time with dlopen (csrc/nccl): nothing NCCL-specific is
needed at build time. Search order: ``$MEGADLM_NCCL_LIB`` (when set, only that path),
torch's lib directory, ``site-packages/nvidia/nccl/lib`` (the nvidia-nccl wheels), then
the default loader path (``libnccl.so.2``).

Collectives run on torch's current CUDA stream of the communicator's device, so they
are ordered after the fused fold kernels launched on that stream::

    uid = megadlm_ext.nccl.unique_id() if rank == 0 else None   # broadcast it yourself,
    comm = megadlm_ext.nccl.Communicator(uid, rank, world_size, device=local_rank)
    comm.all_reduce(flat, op="avg")
    # or: comm = Communicator.from_process_group(group, device=local_rank)

On a CPU-only build ``Communicator(...)`` raises RuntimeError (use ``comm_backend="torch"``).
"""

from __future__ import annotations

import glob
import os
import site
import sys
import threading
from typing import List, Optional

import torch

try:
    from . import _C  # type: ignore[attr-defined]
except ImportError:  # not built: no communicator
    _C = None

_OPS = {"sum": 0, "avg": 4}  # ncclSum, ncclAvg
_lock = threading.Lock()
_state = {"tried": False, "ok": False, "error": ""}


def _candidates() -> List[str]:
    env = os.environ.get("MEGADLM_NCCL_LIB")
    if env:
        return [env]  # an explicit choice is never silently replaced by another library
    paths = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libnccl.so*")))
    roots = list(sys.path)
    try:
        roots += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:  # virtualenv's old site module
        pass
    for root in dict.fromkeys(roots):
        paths += sorted(glob.glob(os.path.join(root, "nvidia", "nccl", "lib", "libnccl.so*")))
    paths.append("libnccl.so.2")
    return list(dict.fromkeys(paths))


def _cuda_build() -> bool:
    return _C is not None and bool(_C.backend_info()["cuda"])


def available() -> bool:
    """True when this is a CUDA build and libnccl.so.2 was found and loaded."""
    if not _cuda_build():
        return False
    with _lock:
        if not _state["tried"]:
            ok, error = _C.nccl_load(_candidates())
            _state.update(tried=True, ok=bool(ok), error=error)
        return _state["ok"]


def _require() -> None:
    if not _cuda_build():
        raise RuntimeError(
            "comm_backend='nccl_ext' needs a CUDA build of megadlm_ext, but this build is "
            "CPU-only (megadlm_ext.backend_info()['cuda'] is False). Use comm_backend='torch' "
            "(gloo on CPU, NCCL through torch.distributed on GPU), or install a CUDA torch and "
            "rebuild with MEGADLM_EXT_CUDA=1 pip install --no-build-isolation -e ."
        )
    if not available():
        raise RuntimeError(
            "comm_backend='nccl_ext': libnccl.so.2 could not be loaded. Tried:\n"
            f"{_state['error']}Set MEGADLM_NCCL_LIB=/path/to/libnccl.so.2 (pip install "
            "nvidia-nccl-cu12 provides one) or use comm_backend='torch'."
        )


def unique_id() -> bytes:
    """A fresh 128-byte ncclUniqueId (create on one rank, share with the others)."""
    _require()
    return bytes(_C.nccl_unique_id())


def version() -> Optional[str]:
    """Version of the loaded libnccl ("2.27.3"), or None when not loaded."""
    if not available():
        return None
    code = int(_C.nccl_version())
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


class Communicator:
    """An NCCL communicator over ``world_size`` ranks on CUDA device ``device``.

    Every collective is in place or into a caller-provided output, on torch's current
    CUDA stream of ``device``; tensors must be contiguous CUDA tensors of that device,
    dtype float32/bfloat16/float16. ``op`` is "sum" or "avg".
    """

    def __init__(self, unique_id: bytes, rank: int, world_size: int, device: int):
        if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != 128:
            raise ValueError("unique_id must be the 128 bytes of megadlm_ext.nccl.unique_id()")
        if not 0 <= int(rank) < int(world_size):
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        _require()
        self.rank, self.world_size, self.device = int(rank), int(world_size), int(device)
        self._comm = _C.NcclCommunicator(bytes(unique_id), self.rank, self.world_size, self.device)

    @classmethod
    def from_process_group(cls, group=None, device: Optional[int] = None) -> Communicator:
        """Bootstrap over a torch.distributed group: rank 0 makes the id, all receive it."""
        import torch.distributed as dist

        rank, world = dist.get_rank(group), dist.get_world_size(group)
        box = [unique_id() if rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        dev = torch.cuda.current_device() if device is None else int(device)
        return cls(box[0], rank, world, dev)

    def _live(self):
        if self._comm is None:
            raise RuntimeError("this megadlm_ext.nccl.Communicator was closed")
        return self._comm

    @staticmethod
    def _op(op: str) -> int:
        if op not in _OPS:
            raise ValueError(f"op={op!r}: expected 'sum' or 'avg'")
        return _OPS[op]

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """In-place all-reduce of ``tensor``."""
        self._live().all_reduce(tensor, self._op(op))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum") -> None:
        """``output`` (numel n) receives this rank's reduced slice of ``input`` (numel n*world)."""
        self._live().reduce_scatter(output, input, self._op(op))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` (numel n*world) receives every rank's ``input`` (numel n), in rank order."""
        self._live().all_gather(output, input)

    def close(self) -> None:
        """Destroy the NCCL communicator (idempotent)."""
        if getattr(self, "_comm", None) is not None:
            self._comm.close()
            self._comm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass
