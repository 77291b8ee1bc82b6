"""The distributed optimizer's layout: fp32 main params and Adam state for this rank's shard.

Design (Megatron-core ``optimizer/distrib_optimizer.py``, reduced to what we need):

Sharding. Our DDP lays gradients out in buckets whose length is a multiple of
lcm(dp, 128) (parameters start on 64-element boundaries). Rank r owns the contiguous
range ``[r * L/dp, (r+1) * L/dp)`` of EVERY bucket of length L. A parameter may straddle
shard boundaries, so this rank's share of it is a single contiguous piece (a parameter
lives in one bucket); each piece becomes one fp32 1-D main param and one AdamW entry.
Padding elements belong to no piece: they are reduced and gathered but never updated.

Phases of one step:
  1. backward: DDP folds each bucket and reduce-scatters it; the rank's shard of
     ``bucket.grad_data`` then holds the averaged gradient (nothing else is valid).
  2. ``step``: main grads are views of (or fp32 copies from) that shard; unscale /
     overflow check (all-reduced), global norm = sqrt(all-reduce of local squared norms),
     clip, AdamW on the pieces.
  3. the updated pieces are cast into the DDP param buffer with one ``megadlm_ext.flatten``
     call per bucket (on a ``TensorTable`` of the bucket's pieces built at construction: no
     per-step parsing), then every bucket is all-gathered in place into the param buffer,
     which the model parameters view (``overlap_param_gather``: launched here, waited for
     by forward pre-hooks bucket by bucket).

Buffer reuse: main grads are views of the grad buffer (no copy) when it is fp32
(``grad_reduce_in_fp32`` or fp32 params); with fp32 params the main params ARE views of
the param buffer's shard (updated in place, as Megatron does), and the all-gather writes
straight into the parameters. Memory per rank: 4 bytes (main param, only for bf16/fp16
params) + 8 bytes (exp_avg, exp_avg_sq) per owned element, ~1/dp of the replicated one.

Checkpoints: ``state_dict()`` gathers every bucket's state (one bucket at a time, fp32) so
each parameter's state has its full logical shape on every rank — a transient cost of
one bucket of fp32 per state key plus the full-shape copies (12 bytes/param with
fp32_param). ``load_state_dict`` slices this rank's pieces out of full tensors, so any dp
size (and DDP/FSDP2 checkpoints) can be loaded. ``sharded_state_dict()`` instead hands out
this rank's pieces as they are (:class:`FlatPiece`: one contiguous range of the param's
flattened local tensor, empty for a param this rank holds nothing of), with no collective;
``load_sharded_state_dict`` takes pieces of the same ranges back (``piece_of``).

Instances (``num_distributed_optimizer_instances`` N): the shards are taken within the
wrapper's ``shard_comm`` (dp/N consecutive dp ranks), so each instance holds one full copy of
the state, ~1/(dp/N) of the replicated one per rank; the instances stay identical because
their shards' gradients were all-reduced across them. Norm sums run over ``shard_comm`` (not
across instances: they hold the same numbers).

Over a TP grid (the wrapper's ``parallel``) the norm counts every TP shard once and every
replicated parameter on TP rank 0 only, summed over the model-parallel group too, and the
fp16 overflow vote spans the world (``grid.py``).

Expert buckets (expert parameters: ``ParamSharding.expert_dim`` set): each bucket carries its DDP
``reduce_group``; an expert bucket is sharded over the expert-data-parallel group (its
``shard_comm``), so rank r of that group owns ``shard_range(r, expert_dp)`` of it. The norm
then sums over the world (``grid.py``: every shard counts once, the experts of every EP rank
included).

One rank: the shard is the whole bucket and every collective is a local copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

import megadlm_ext as ext

from .grid import GridReductions
from .layouts import Entry, full_plain


@dataclass(frozen=True, eq=False)
class FlatPiece:
    """This rank's part of one state tensor of the distributed optimizer: elements
    ``[start, stop)`` of the parameter's LOCAL tensor (its TP shard) flattened row-major.

    ``tensor`` is 1-D with ``stop - start`` elements (empty, with ``start == stop == 0``, when this
    rank holds none of the parameter); ``shape`` is the parameter's local shape. The tensor may
    be the optimizer's live state (no copy): write it out before the next step."""

    tensor: torch.Tensor
    start: int
    stop: int
    shape: Tuple[int, ...]


class ShardedBufferLayout:
    """Main params = this rank's pieces of every DDP bucket (see module docstring)."""

    sharded = True
    decoupled_grads = False  # precision-aware: the buffer's shard as it is, in main.decoupled_grad
    keep_buffer_grads = False  # main_grads_dtype bf16 (set by MixedPrecisionOptimizer)

    def __init__(
        self,
        wrapper,
        names: Dict[torch.nn.Parameter, str],
        grid: Optional[GridReductions] = None,
        *,
        main_in_model: bool = False,
    ) -> None:
        self.wrapper = wrapper  # a DataParallel with optimizer_layout "bucket_shards"
        self.comm = wrapper.shard_comm  # the ranks sharing one copy
        self.grid = grid if grid is not None else GridReductions(None)
        self.buckets = wrapper.grad_buckets
        self.device = self.buckets[0].grad_data.device if self.buckets else torch.device("cpu")
        self.entries: List[Entry] = []
        self.pieces = []  # per entry: (bucket, start in bucket, start in param, numel)
        for bucket in self.buckets:
            lo, hi = self._shard_range(bucket)
            for p, off in zip(bucket.params, bucket.offsets):
                # The param's range intersected with this rank's shard; empty for most params at large dp.
                a, b = max(off, lo), min(off + p.numel(), hi)
                if a < b:
                    piece = p.detach().reshape(-1)[a - off : b - off]
                    # fp32 params (or main params kept in the optimizer state: main_params_dtype fp16):
                    # the optimizer updates the param buffer's piece in place.
                    if p.dtype == torch.float32 or main_in_model:
                        self.entries.append(Entry(names[p], p, piece, owns_main=False))
                    else:
                        self.entries.append(Entry(names[p], p, piece.float().clone(), owns_main=True))
                    self.pieces.append((bucket, a, a - off, b - a))
        self._names = names
        # This rank's shard of each piece's gradient: made once, so collect_grads hands the
        # optimizer the same tensors every step (their TensorTable is then kept: grad_tables.py).
        self._grad_views = [bucket.grad_data[a : a + n] for bucket, a, _, n in self.pieces]
        self.grads_persist = False  # set by collect_grads
        self._cast_tables = self._build_cast_tables()

    def _shard_comm(self, bucket):
        """The ranks ``bucket`` is sharded over (expert buckets: the expert-dp group)."""
        group = bucket.reduce_group
        return group.shard_comm if group is not None else self.comm

    def _shard_range(self, bucket):
        comm = self._shard_comm(bucket)
        return bucket.shard_range(comm.rank, comm.world_size)

    def all_fqns(self):
        return [(fqn, p) for p, fqn in self._names.items()]  # registration order, as elsewhere

    def collect_grads(self) -> List[torch.Tensor]:
        """Each piece's main grad; ``grads_persist`` afterwards: all of them are the buffer
        views themselves (no copy)."""
        grads = []
        persist = True
        for e, view in zip(self.entries, self._grad_views):
            if self.decoupled_grads:
                # bf16 main grads: the buffer's shard itself (upcast per piece by the step);
                # fp32 main grads from a 16-bit buffer (--fp16): an fp32 copy, as without it
                g = view if self.keep_buffer_grads or view.dtype == torch.float32 else view.float()
                e.main.decoupled_grad = g  # type: ignore[attr-defined]  # read by the precision-aware AdamW
            else:
                # fp32 buffer: a view, no copy. bf16/fp16 buffer: an fp32 copy, since the optimizer
                # math (unscale, clip, AdamW) runs in fp32.
                g = view if view.dtype == torch.float32 else view.float()
                e.main.grad = g
            grads.append(g)
            persist = persist and g is view
        self.grads_persist = persist
        return grads

    def norm_and_clip_tensors(self, grads):
        """Norm: each TP shard and each replicated parameter once (grid.py); clip: all."""
        return [g for g, e in zip(grads, self.entries) if self.grid.counts_in_norm(e.param)], grads

    def all_reduce_sum(self):
        # the shards of the dp group (of this instance), then the model-parallel sum; with
        # expert parallelism one sum over the world (grid.py)
        shard_sum = (lambda t: self.comm.all_reduce(t, "sum")) if self.comm.world_size > 1 else None
        return self.grid.norm_sum(shard_sum)

    def any_rank(self, flag: bool) -> bool:
        if self.grid.spans_world:
            return self.grid.any_rank(flag, self.device)
        if self.comm.world_size == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        self.comm.all_reduce(t, "sum")
        return bool(t.item() > 0)

    def _build_cast_tables(self) -> list:
        """(bucket, TensorTable of the fp32 main pieces at their offsets in the bucket) for every
        bucket with separate main params. The pieces and the param buffers live as long as the
        optimizer and are only written in place (the step, load_state_dict's copy_), so each
        table is built once."""
        by_bucket: Dict[int, list] = {}
        for e, (bucket, a, _, _) in zip(self.entries, self.pieces):
            if not e.owns_main:
                continue  # already a view of the param buffer
            by_bucket.setdefault(id(bucket), [bucket, [], []])  # index: unique only per chunk
            by_bucket[id(bucket)][1].append(e.main)
            by_bucket[id(bucket)][2].append(a)
        return [(bucket, ext.TensorTable(mains, offsets=offs)) for bucket, mains, offs in by_bucket.values()]

    def copy_main_to_model(self) -> None:
        for bucket, mains in self._cast_tables:
            ext.flatten(mains, bucket.param_data)  # cast fp32 -> param dtype, one call per bucket
        # Right after the cast: with overlap_param_gather the gathers then run during the next
        # forward, each waited for by its first reader.
        self.wrapper.start_param_sync()

    def export(self, values: Dict[int, torch.Tensor], dtype=torch.float32) -> Dict[str, torch.Tensor]:
        """Full-shape tensors (of ``dtype``: the same on every rank) for every parameter from
        this rank's pieces (collective)."""
        by_bucket: Dict[int, list] = {}
        for i, (bucket, a, _, n) in enumerate(self.pieces):
            by_bucket.setdefault(id(bucket), []).append((a, n, values[i]))
        out = {}
        for bucket in self.buckets:
            # Zeros outside this rank's pieces (padding included), so after the gather each value
            # is there exactly once.
            flat = torch.zeros(bucket.grad_data.numel(), dtype=dtype, device=bucket.grad_data.device)
            for a, n, t in by_bucket.get(id(bucket), []):
                flat[a : a + n].copy_(t.reshape(-1))
            lo, hi = self._shard_range(bucket)
            self._shard_comm(bucket).all_gather(flat, flat[lo:hi].clone())
            for p, off in zip(bucket.params, bucket.offsets):
                out[self._names[p]] = flat[off : off + p.numel()].view(p.shape).clone()
        return out

    def export_local(self, values: Dict[int, torch.Tensor], dtype=torch.float32) -> Dict[str, FlatPiece]:
        """This rank's piece of every parameter (no collective): a :class:`FlatPiece` of
        ``dtype`` per name, an empty one for the parameters this rank holds nothing of, so
        every rank returns the same names."""
        mine = {self.entries[i].fqn: i for i in range(len(self.entries))}
        out = {}
        for bucket in self.buckets:
            for p in bucket.params:
                fqn = self._names[p]
                i = mine.get(fqn)
                if i is None:
                    empty = torch.zeros(0, dtype=dtype, device=bucket.grad_data.device)
                    out[fqn] = FlatPiece(empty, 0, 0, tuple(p.shape))
                    continue
                _, _, start, n = self.pieces[i]
                out[fqn] = FlatPiece(values[i].reshape(-1).to(dtype), start, start + n, tuple(p.shape))
        return out

    def local_piece(self, i: int, full) -> torch.Tensor:
        _, _, start, n = self.pieces[i]
        return full_plain(full).reshape(-1)[start : start + n]

    def piece_of(self, i: int, value: FlatPiece) -> torch.Tensor:
        """Entry ``i``'s values from a :class:`FlatPiece` of its own range (a clear error otherwise)."""
        _, _, start, n = self.pieces[i]
        if (value.start, value.stop) != (start, start + n) or value.tensor.numel() != n:
            raise ValueError(
                f"{self.entries[i].fqn}: load_sharded_state_dict got elements [{value.start}, "
                f"{value.stop}) ({value.tensor.numel()} values), but this rank holds [{start}, "
                f"{start + n}): fill the pieces of this optimizer's own sharded_state_dict()"
            )
        return value.tensor.reshape(-1)

    def reload_main_from_model(self, i: int) -> None:
        _, _, start, n = self.pieces[i]
        e = self.entries[i]
        e.main.copy_(e.param.detach().reshape(-1)[start : start + n])
