"""Where the main params live, for :class:`~megadlms.optimizer.optimizer.MixedPrecisionOptimizer`
(one layout object per optimizer; the third, ``ShardedBufferLayout``, is distrib_optimizer.py's):

* :class:`ReplicaLayout` — our DDP (or a plain module): every rank holds full fp32 main params
  (the model params themselves when they are fp32).
* :class:`DTensorLayout` — FSDP2: the (fp32, sharded) DTensor params are the main params.

Each layout turns the wrapper's reduced gradients into main grads, exports and imports values by
parameter name (the checkpoint format), and copies the updated main params back to the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from megadlms.common.dtensor import is_dtensor, local_tensor

from .grid import GridReductions


@dataclass(eq=False)
class Entry:
    """One optimized tensor: ``main`` is (a piece of) the parameter named ``fqn``."""

    fqn: str
    param: torch.nn.Parameter
    main: torch.Tensor
    owns_main: bool = False  # main is a separate fp32 copy (counts as optimizer memory)


def no_weight_decay(fqn: str, param: torch.Tensor) -> bool:
    """Megatron's rule: biases and 1-D parameters (norm weights) get no weight decay."""
    return fqn.endswith(".bias") or param.dim() == 1


class ReplicaLayout:
    """Full fp32 main params on every rank (our DDP, or a module without a wrapper)."""

    sharded = False
    # Precision-aware optimizer: the reduced grad is handed over as it is (buffer dtype, no
    # copy) in main.decoupled_grad (MixedPrecisionOptimizer sets this).
    decoupled_grads = False
    keep_buffer_grads = False  # main_grads_dtype bf16: no fp32 copy of a bf16 grad buffer
    grads_persist = False  # set by collect_grads

    def __init__(
        self,
        named_params: Dict[torch.nn.Parameter, str],
        wrapper,
        *,
        fp32_copies: bool,
        grid: Optional[GridReductions] = None,
    ) -> None:
        self.wrapper = wrapper
        self.grid = grid if grid is not None else GridReductions(None)
        self.entries: List[Entry] = []
        for p, fqn in named_params.items():
            # fp32 params are their own main params (no copy); bf16/fp16 ones get an fp32 master,
            # or small updates would round away in the low-precision weight.
            main = p.detach().clone().float() if fp32_copies and p.dtype != torch.float32 else p
            self.entries.append(Entry(fqn, p, main, owns_main=main is not p))
        self.device = next(iter(named_params)).device if named_params else torch.device("cpu")
        self._in_norm: List[bool] = []  # per collected grad: counts in the norm (grid.py)

    def all_fqns(self):
        return [(e.fqn, e.param) for e in self.entries]

    def collect_grads(self) -> List[torch.Tensor]:
        """Point every main param's .grad at the reduced gradient (fp32 view or copy).

        Sets ``grads_persist``: every grad handed over is a DDP buffer's ``main_grad`` view
        itself (no copy, no new view object), so the same tensors come back next step and the
        optimizer keeps their TensorTable (grad_tables.py)."""
        grads = []
        self._in_norm = []
        persist = True
        for e in self.entries:
            g = self.wrapper.main_grad(e.param) if self.wrapper is not None else e.param.grad
            if g is None:
                e.main.grad = None
                continue
            view = getattr(e.param, "main_grad", None)
            self._in_norm.append(self.grid.counts_in_norm(e.param, replicated=True))
            if self.decoupled_grads:
                # main_grads_dtype fp32 with a 16-bit buffer (--fp16): fp32 copies, as without it
                g = g if self.keep_buffer_grads or g.dtype == torch.float32 else g.float()
                got = e.main.decoupled_grad = _shaped(g, e.main.shape)  # type: ignore[attr-defined]
            elif e.main is e.param:
                # Our DDP already left the reduced view in param.grad: reassign only when it is another
                # tensor. torch.optim needs grad dtype == param dtype, hence the cast (fp32 buffer).
                if e.param.grad is None or e.param.grad.data_ptr() != g.data_ptr():
                    e.param.grad = g if g.dtype == e.param.dtype else g.to(e.param.dtype)
                got = e.param.grad
            else:
                e.main.grad = _shaped(g if g.dtype == torch.float32 else g.float(), e.main.shape)
                got = e.main.grad
            grads.append(got)
            persist = persist and view is not None and got is view
        self.grads_persist = persist
        return grads

    def norm_and_clip_tensors(self, grads):
        """Norm: each TP shard and each replicated parameter once (grid.py); clip: all."""
        return [g for g, keep in zip(grads, self._in_norm) if keep], grads

    def all_reduce_sum(self):
        # Gradients are already identical on every dp rank; over a grid, sum the TP shards
        # (and, with expert parallelism, the experts over the world: grid.py).
        return self.grid.norm_sum()

    def any_rank(self, flag: bool) -> bool:
        # Without a grid every dp rank holds the same reduced grads: the local answer is everyone's.
        return self.grid.any_rank(flag, self.device) if self.grid.spans_world else flag

    def copy_main_to_model(self) -> None:
        with torch.no_grad():
            for e in self.entries:
                if e.main is not e.param:
                    e.param.copy_(e.main)

    def export(self, values: Dict[int, torch.Tensor], dtype=torch.float32) -> Dict[str, torch.Tensor]:
        return {self.entries[i].fqn: t.view(self.entries[i].param.shape) for i, t in values.items()}

    def local_piece(self, i: int, full: torch.Tensor) -> torch.Tensor:
        e = self.entries[i]
        return full_plain(full).reshape(e.main.shape)

    # Every rank holds whole (TP-local) tensors: its sharded state is its full state.
    export_local = export
    piece_of = local_piece

    def reload_main_from_model(self, i: int) -> None:
        e = self.entries[i]
        if e.main is not e.param:
            e.main.data.copy_(e.param.detach())


def _shaped(t: torch.Tensor, shape) -> torch.Tensor:
    """``t`` viewed as ``shape``: ``t`` itself when it has it (the same object every step)."""
    return t if t.shape == shape else t.view(shape)


def full_plain(t):
    """A full plain tensor from a plain tensor or a DTensor."""
    return t.full_tensor() if is_dtensor(t) else t


class DTensorLayout:
    """FSDP2: parameters are fp32 DTensors sharded by fully_shard; they are the main params."""

    sharded = True
    grads_persist = False  # fully_shard hands over new gradient tensors every step

    def __init__(
        self, named_params: Dict[torch.nn.Parameter, str], comm, grid: Optional[GridReductions] = None
    ) -> None:
        # The wrapper's shard communicator: the ranks holding different pieces (dp, or one HSDP
        # instance, whose replicas hold the same pieces and are left out of the norm's sum).
        self.comm = comm
        # Over a tensor-parallel grid: TP-replicated parameters count on TP rank 0 only, and the
        # squared norm is summed over the model-parallel group as well (grid.py).
        self.grid = grid if grid is not None else GridReductions(None)
        self._in_norm: List[bool] = []
        self.entries = []
        for p, fqn in named_params.items():
            if p.dtype != torch.float32:
                raise ValueError(
                    f"FSDP2 parameter {fqn} is {p.dtype}: keep FSDP2 params in fp32 and "
                    "use mixed_precision_policy(bf16=True) for bf16 compute"
                )
            self.entries.append(Entry(fqn, p, p))
        self.device = next(iter(named_params)).device if named_params else torch.device("cpu")

    def all_fqns(self):
        return [(e.fqn, e.param) for e in self.entries]

    def collect_grads(self) -> List[torch.Tensor]:
        grads = [(e, e.param.grad) for e in self.entries if e.param.grad is not None]
        self._in_norm = [self.grid.counts_in_norm(e.param) for e, _ in grads]
        return [g for _, g in grads if g is not None]

    @staticmethod
    def _is_sharded(t) -> bool:
        return any(pl.is_shard() for pl in getattr(t, "placements", ()))

    def norm_and_clip_tensors(self, grads):
        """Local shards for the norm (replicated tensors counted on rank 0 only) and for clipping."""
        rank0 = self.comm.rank == 0
        norm, clip = [], []
        for g, counts in zip(grads, self._in_norm):
            local = local_tensor(g)
            if not local.is_contiguous():
                raise RuntimeError("FSDP2 gradient shard is not contiguous; cannot clip it in place")
            clip.append(local)
            # A Replicate placement has the same values on every rank: counted on rank 0 only, or
            # the summed square would count it dp times.
            if counts and (not is_dtensor(g) or self._is_sharded(g) or rank0):
                norm.append(local)
        return norm, clip

    def all_reduce_sum(self):
        shard_sum = None if self.comm.world_size == 1 else (lambda t: self.comm.all_reduce(t, "sum"))
        return self.grid.norm_sum(shard_sum)

    def any_rank(self, flag: bool) -> bool:
        return flag  # fp16 is rejected for FSDP2; the norm is already global

    def copy_main_to_model(self) -> None:
        return None

    def export(self, values: Dict[int, torch.Tensor], dtype=torch.float32) -> Dict[str, torch.Tensor]:
        return {self.entries[i].fqn: t for i, t in values.items()}

    def local_piece(self, i: int, full) -> torch.Tensor:
        """The value to store for entry i: a DTensor laid out like the parameter."""
        p = self.entries[i].param
        if not is_dtensor(p):
            raise TypeError(f"{self.entries[i].fqn}: the dtensor layout's parameters are DTensors")
        if is_dtensor(full):
            if tuple(full.placements) == tuple(p.placements) and full.device_mesh == p.device_mesh:
                return full
            return full.redistribute(p.device_mesh, p.placements)
        from torch.distributed.tensor import distribute_tensor

        full = full.to(device=p.to_local().device, dtype=torch.float32)
        # Older torch has no src_data_rank: the fallback scatters from rank 0 (same values).
        try:  # every rank holds the full tensor: slice locally, no scatter
            return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        except TypeError:
            return distribute_tensor(full, p.device_mesh, p.placements)

    # The DTensors are the sharded state: DCP writes and reads only their local shards.
    export_local = export
    piece_of = local_piece

    def reload_main_from_model(self, i: int) -> None:
        return None
