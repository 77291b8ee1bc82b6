"""How the optimizer's gradient norm and skip decisions span a tensor-/pipeline-parallel grid.

The wrapper's ``parallel`` (``megadlms.parallel.ParallelGroups``, None for plain data
parallelism) tells the optimizer two things:

* which local gradients count in the global norm: every tensor-parallel shard once (it is a
  different piece of the full tensor on each TP rank) and every TP-replicated parameter once
  (on TP rank 0 only) — Megatron's ``param_is_not_tensor_parallel_duplicate`` — and the
  last pipeline stage's copy of a tied embedding (``shared_embedding``) never. The local
  squared norms are then summed over the model-parallel group (``parallel.mp``: the tp x pp
  ranks of this rank's dp coordinate), after the data-parallel shard sum of the layout;
* which ranks must agree on a skip: all of them (one all-reduce over the world), since TP
  peers hold different shards and may see an overflow the others do not.

A non-finite norm needs no extra vote: after these sums it is the same number on every rank
(dp peers hold identical reduced gradients, and a NaN propagates through the sums).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class GridReductions:
    """The grid-wide reductions of one optimizer (no-ops without a grid)."""

    def __init__(self, parallel: Optional[object]) -> None:
        self.tp_rank = parallel.tp.rank if parallel is not None else 0
        mp = getattr(parallel, "mp", None)
        self.mp_group = mp.group if mp is not None and mp.size > 1 else None
        self.spans_world = parallel is not None and parallel.world_size > 1

    def counts_in_norm(self, param: torch.Tensor) -> bool:
        """True for a TP shard, and for a replicated parameter on TP rank 0 only; never for
        the last pipeline stage's copy of a tied embedding (``shared_embedding``: its
        gradient equals the first stage's, which counts)."""
        if getattr(param, "shared_embedding", False):
            return False
        return bool(getattr(param, "tensor_model_parallel", False)) or self.tp_rank == 0

    def sum_over_model_parallel(self, t: torch.Tensor) -> None:
        """In-place sum of ``t`` over the model-parallel group (identity when it is one rank)."""
        if self.mp_group is not None:
            dist.all_reduce(t, group=self.mp_group)

    def any_rank(self, flag: bool, device) -> bool:
        """True on every rank of the world if ``flag`` is True on any."""
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(t)
        return bool(t.item() > 0)
