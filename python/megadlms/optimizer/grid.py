"""How the optimizer's gradient norm and skip decisions span a tensor-/pipeline-parallel grid.

The wrapper's ``parallel`` (``megadlms.parallel.ParallelGroups``, None for plain data
parallelism) tells the optimizer two things:

* which local gradients count in the global norm: every tensor-parallel shard once (it is a
  different piece of the full tensor on each TP rank) and every TP-replicated parameter once
  (on TP rank 0 only) — Megatron's ``param_is_not_tensor_parallel_duplicate`` — and the
  last pipeline stage's copy of a tied embedding (``tied_copy``) never. The local
  squared norms are then summed over the model-parallel group (``parallel.mp``: the tp x pp
  ranks of this rank's dp coordinate), after the data-parallel shard sum of the layout;
* which ranks must agree on a skip: all of them (one all-reduce over the world), since TP
  peers hold different shards and may see an overflow the others do not.

With expert parallelism (``parallel.ep.size`` > 1) expert parameters (``expert_dim`` set)
differ across the EP group and are replicated (or sharded) only over ``expert_dp``, while dense
ones are replicated (or sharded) over ``dp``: the norm is then ONE sum over the world in which
each element counts once -- a replicated dense gradient on dp rank 0 only, a replicated
expert gradient on expert-dp rank 0 only, a shard of the distributed optimizer wherever it
lives (the expert part is thereby summed over ep as well; Megatron sums it over the
expert-model-parallel group).

A non-finite norm needs no extra vote: after these sums it is the same number on every rank
(dp peers hold identical reduced gradients, and a NaN propagates through the sums).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megadlms.parallel.groups import ParallelGroups
from megadlms.parallel.sharding import counts_once


class GridReductions:
    """The grid-wide reductions of one optimizer (no-ops without a grid)."""

    def __init__(self, parallel: Optional[ParallelGroups]) -> None:
        self.tp_rank = parallel.tp.rank if parallel is not None else 0
        mp = parallel.mp if parallel is not None else None
        self.mp_group = mp.group if mp is not None and mp.size > 1 else None
        self.spans_world = parallel is not None and parallel.world_size > 1
        self.expert_parallel = parallel is not None and parallel.ep.size > 1
        self.dp_rank = parallel.dp.rank if parallel is not None else 0
        self.expert_dp_rank = parallel.expert_dp.rank if parallel is not None else 0

    def counts_in_norm(self, param: torch.Tensor, *, replicated: bool = False) -> bool:
        """True for a TP shard, and for a replicated parameter on TP rank 0 only. With expert
        parallelism and a ``replicated`` (not sharded) gradient, also only on the first rank of
        the group it is replicated over (dp for dense, expert_dp for expert parameters). Never
        the last pipeline stage's copy of a tied embedding (``tied_copy``: its gradient equals
        the first stage's, which counts). The rule is ``sharding.counts_once``'s."""
        # Only the world-wide sum of expert parallelism runs over data-parallel replicas; the
        # norm_sum of the others stays inside the model-parallel group.
        over_replicas = self.expert_parallel and replicated
        return counts_once(
            param,
            tp_rank=self.tp_rank,
            dp_rank=self.dp_rank if over_replicas else None,
            expert_dp_rank=self.expert_dp_rank if over_replicas else None,
        )

    def norm_sum(self, data_parallel_sum=None):
        """The all-reduce of a squared norm: over the world with expert parallelism (see the
        module docstring), else ``data_parallel_sum`` (the layout's shard sum, or None) followed
        by the model-parallel sum. None when nothing needs reducing."""
        if self.expert_parallel:
            return lambda t: dist.all_reduce(t)
        if data_parallel_sum is None:
            return None if self.mp_group is None else self.sum_over_model_parallel

        def reduce(t):
            data_parallel_sum(t)
            self.sum_over_model_parallel(t)

        return reduce

    def sum_over_model_parallel(self, t: torch.Tensor) -> None:
        """In-place sum of ``t`` over the model-parallel group (identity when it is one rank)."""
        if self.mp_group is not None:
            dist.all_reduce(t, group=self.mp_group)

    def any_rank(self, flag: bool, device) -> bool:
        """True on every rank of the world if ``flag`` is True on any."""
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(t)
        return bool(t.item() > 0)
