"""The extension's own NCCL communicator (``comm_backend="nccl_ext"``).

libnccl.so.2 is loaded at run time with dlopen (csrc/nccl): nothing NCCL-specific is
needed at build time. Search order: ``$MEGADLM_NCCL_LIB`` (when set, only that path),
torch's lib directory, the ``nvidia/nccl/lib`` directory of the nvidia-nccl wheels in
the site-packages directories (never the working directory or other ``sys.path``
entries), then the default loader path (``libnccl.so.2``). A library older than NCCL
2.14 is refused at load, with the minimum named.

Each communicator owns a CUDA stream. A collective first makes that stream wait for
the work already queued on torch's current stream (so it sees the fused fold kernel's
output), runs there, and returns an :class:`NcclWork`; ``work.wait()`` makes the
current stream wait for it -- no host sync -- so backward keeps running while buckets
reduce::

    uid = megadlm_ext.nccl.unique_id() if rank == 0 else None   # broadcast it yourself,
    comm = megadlm_ext.nccl.Communicator(uid, rank, world_size, device=local_rank)
    work = comm.all_reduce(flat, op="avg")
    work.wait()
    # or: comm = Communicator.from_process_group(group, device=local_rank)

Communicators still open at interpreter exit are closed then (``close_at_exit``).
Never hangs: init is non-blocking and gives up after ``timeout`` seconds (aborting the
communicator); a watchdog thread polls NCCL's async error and the collectives'
completion, and aborts the communicator when one fails or takes longer than
``timeout``. Every later call then raises :class:`NcclError` naming the rank and the
collective. On a CPU-only build ``Communicator(...)`` raises RuntimeError (use
``comm_backend="torch"``).
"""

from __future__ import annotations

import atexit
import glob
import logging
import os
import site
import threading
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

try:
    from . import _C  # type: ignore[attr-defined]
except ImportError:  # not built: no communicator
    _C = None

_OPS = {"sum": 0, "avg": 4}  # ncclSum, ncclAvg
_lock = threading.Lock()
_state: Dict[str, Any] = {"tried": False, "ok": False, "error": ""}
DEFAULT_TIMEOUT_S = 600.0  # torch's NCCL default (10 minutes)
CLOSE_GRACE_S = 30.0  # close(): in-flight work + flush, then abort (a dead peer cannot hold it)
EXIT_GRACE_S = 5.0  # the same at interpreter exit
_log = logging.getLogger(__name__)
_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()  # communicators to close at exit (each close() is idempotent)


def close_at_exit(comm):
    """Close ``comm`` (anything with ``close(grace_s)``) when Python exits, if it is still
    alive then: NCCL is flushed and destroyed (or aborted after ``EXIT_GRACE_S``) before
    the CUDA runtime unloads. Communicator does this itself. Returns ``comm``."""
    _OPEN.add(comm)
    return comm


@atexit.register
def _close_open_communicators() -> None:
    for comm in list(_OPEN):
        try:
            comm.close(EXIT_GRACE_S)
        except Exception as exc:  # exit must go on; say what was left behind
            _log.warning("megadlm_ext.nccl: closing a communicator at exit failed: %s", exc)


# Same names on an unbuilt extension, so `except nccl.NcclError` always works. The type checker
# reads the Python classes (the compiled ones have the same shape).
if _C is None or TYPE_CHECKING:

    class NcclError(RuntimeError):
        """An NCCL failure: async error, abort, timeout or a refused call."""

    class NcclTimeoutError(NcclError):
        """NCCL init or a collective did not finish within the timeout."""

    NcclWork: Any = None
else:
    NcclError = _C.NcclError
    NcclTimeoutError = _C.NcclTimeoutError
    NcclWork = _C.NcclWork


def _site_dirs() -> List[str]:
    try:
        dirs = site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:  # virtualenv's old site module
        dirs = []
    # Only real directories: never "" (the working directory) or relative entries, so
    # a stray libnccl next to the user's script cannot be picked up.
    return [d for d in dict.fromkeys(dirs) if os.path.isabs(d)]


def _candidates() -> List[str]:
    env = os.environ.get("MEGADLM_NCCL_LIB")
    if env:
        return [env]  # an explicit choice is never silently replaced by another library
    paths = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libnccl.so*")))
    for root in _site_dirs():
        paths += sorted(glob.glob(os.path.join(root, "nvidia", "nccl", "lib", "libnccl.so*")))
    paths.append("libnccl.so.2")
    return list(dict.fromkeys(paths))


def _cuda_build() -> bool:
    return _C is not None and bool(_C.backend_info()["cuda"])


def available() -> bool:
    """True when this is a CUDA build and a libnccl.so.2 >= 2.14 was found and loaded."""
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
            "comm_backend='nccl_ext': no usable libnccl.so.2 (NCCL >= "
            f"{_version_string(_C.nccl_min_version)}). Tried:\n{_state['error']}"
            "Set MEGADLM_NCCL_LIB=/path/to/libnccl.so.2 (pip install nvidia-nccl-cu12 provides "
            "one) or use comm_backend='torch'."
        )


def unique_id() -> bytes:
    """A fresh 128-byte ncclUniqueId (create on one rank, share with the others)."""
    _require()
    return bytes(_C.nccl_unique_id())


def _version_string(code: int) -> str:
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def version() -> Optional[str]:
    """Version of the loaded libnccl ("2.27.3"), or None when not loaded."""
    if not available():
        return None
    return _version_string(int(_C.nccl_version()))


def _check_timeout(timeout: float) -> float:
    timeout = float(timeout)
    if not timeout > 0:
        raise ValueError(f"timeout={timeout} must be a positive number of seconds")
    return timeout


class Communicator:
    """An NCCL communicator over ``world_size`` ranks on CUDA device ``device``.

    Collectives are in place or into a caller-provided output; tensors must be
    contiguous CUDA tensors of ``device``, dtype float32/bfloat16/float16; ``op`` is
    "sum" or "avg". Each returns an :class:`NcclWork` (``wait()``: the current stream
    waits for it; ``is_completed()``). ``timeout`` (seconds) bounds init and every
    collective; past it the communicator is aborted and calls raise
    :class:`NcclTimeoutError` / :class:`NcclError`.
    """

    def __init__(
        self, unique_id: bytes, rank: int, world_size: int, device: int, timeout: float = DEFAULT_TIMEOUT_S
    ):
        if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != 128:
            raise ValueError("unique_id must be the 128 bytes of megadlm_ext.nccl.unique_id()")
        if not 0 <= int(rank) < int(world_size):
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        timeout = _check_timeout(timeout)
        _require()
        self.rank, self.world_size, self.device = int(rank), int(world_size), int(device)
        self._comm = close_at_exit(
            _C.NcclCommunicator(bytes(unique_id), self.rank, self.world_size, self.device, timeout)
        )

    @classmethod
    def from_process_group(
        cls, group=None, device: Optional[int] = None, timeout: Optional[float] = None
    ) -> Communicator:
        """Bootstrap over a torch.distributed group: rank 0 makes the id, all receive it.

        ``timeout`` defaults to the group's own timeout (``init_process_group(timeout=)``,
        i.e. ``--distributed-timeout-minutes``).
        """
        import torch.distributed as dist

        rank, world = dist.get_rank(group), dist.get_world_size(group)
        box = [unique_id() if rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        dev = torch.cuda.current_device() if device is None else int(device)
        uid = box[0]
        assert uid is not None  # every rank holds rank 0's id after the broadcast
        return cls(uid, rank, world, dev, group_timeout(group) if timeout is None else timeout)

    def _live(self):
        if self._comm is None:
            raise NcclError("this megadlm_ext.nccl.Communicator was closed")
        return self._comm

    @staticmethod
    def _op(op: str) -> int:
        if op not in _OPS:
            raise ValueError(f"op={op!r}: expected 'sum' or 'avg'")
        return _OPS[op]

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum"):
        """In-place all-reduce of ``tensor``; returns its NcclWork."""
        return self._live().all_reduce(tensor, self._op(op))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum"):
        """``output`` (numel n) receives this rank's reduced slice of ``input`` (numel n*world)."""
        return self._live().reduce_scatter(output, input, self._op(op))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor):
        """``output`` (numel n*world) receives every rank's ``input`` (numel n), in rank order."""
        return self._live().all_gather(output, input)

    def abort(self, why: str = "aborted by the caller") -> None:
        """Abort now (unblocks every rank's pending NCCL kernels); later calls raise ``why``."""
        self._live().abort(why)

    def error(self) -> str:
        """Why the communicator failed ("" while healthy)."""
        return self._live().error()

    def close(self, grace: float = CLOSE_GRACE_S) -> None:
        """Flush and destroy the NCCL communicator, without the GIL (idempotent). In-flight
        collectives and the flush get ``grace`` seconds (at most the timeout); past that
        the communicator is aborted instead (a dead peer would never let a flush finish)."""
        if getattr(self, "_comm", None) is not None:
            comm, self._comm = self._comm, None
            comm.close(float(grace))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass


def group_timeout(group=None) -> float:
    """Seconds of ``group``'s timeout (set by ``init_process_group(timeout=...)``)."""
    import torch.distributed as dist

    g = group if group is not None else dist.group.WORLD
    for device in ("cuda", "cpu"):
        try:
            if g is not None:
                return float(g._get_backend(torch.device(device)).options._timeout.total_seconds())
        except (AttributeError, RuntimeError, ValueError):
            continue
    try:
        store = dist.distributed_c10d._get_default_store()
        return float(store.timeout.total_seconds())  # type: ignore[attr-defined]  # not in torch's stubs
    except (AttributeError, RuntimeError, ValueError):
        return DEFAULT_TIMEOUT_S
