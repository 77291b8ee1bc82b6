"""What a model needs to know about tensor parallelism, in one small object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .mappings import Group, group_rank, group_size
from .random import RNGStatesTracker


@dataclass(frozen=True)
class TensorParallelContext:
    """The tensor-parallel setting a model is built with (passed explicitly, never global).

    ``group``: the TP process group (None: one process, the layers are plain linears).
    ``sequence_parallel``: activations outside the TP region are split on the sequence dim.
    ``gradient_accumulation_fusion``: TP linears add their weight gradient straight into
    ``param.main_grad`` (needs a wrapper that provides it: our DDP).
    ``rng_tracker``: the model-parallel RNG stream for dropout inside the TP region
    (None: that dropout draws from the default generator; fine at tp = 1).
    ``expert_group``: the expert-parallel process group of the MoE layers (ParallelGroups.ep;
    None: one EP rank, every expert local). EP rank e holds experts [e*E/ep, (e+1)*E/ep).
    ``cp_group``: the context-parallel group (ParallelGroups.cp; None: the whole sequence is
    local). Attention then all-gathers K/V over it (parallel/context_parallel.py).
    """

    group: Group = None
    sequence_parallel: bool = False
    gradient_accumulation_fusion: bool = False
    rng_tracker: Optional[RNGStatesTracker] = None
    expert_group: Group = None
    cp_group: Group = None

    @property
    def size(self) -> int:
        return group_size(self.group)

    @property
    def rank(self) -> int:
        return group_rank(self.group)

    @property
    def ep_size(self) -> int:
        return group_size(self.expert_group)

    @property
    def ep_rank(self) -> int:
        return group_rank(self.expert_group)

    @property
    def cp_size(self) -> int:
        return group_size(self.cp_group)
