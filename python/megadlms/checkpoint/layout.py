"""Where this rank sits in the run, as far as a checkpoint cares: the process groups its
tensors are sharded over and the RNG tracker whose streams it saves.

One :class:`ParallelLayout` is built per run (``Checkpointer`` holds it) and handed to the
save / load functions as a whole, so no function threads four groups separately. The
default layout (every field None) is one process or plain data parallelism: nothing is
gathered or cut, and checkpoints are read and written as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch.distributed as dist

from megadlms.parallel.mappings import Group, group_size
from megadlms.parallel.random import RNGStatesTracker


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """The model-parallel context of a checkpoint save or load on this rank.

    ``tp_group``: tensor-parallel group (None: no TP); TP shards are stored as full tensors.
    ``pp_group``: pipeline-parallel group (None: no PP); each stage writes its own keys.
    ``ep_group``: expert-parallel group (None: no EP); experts are stored under [E, ...].
    ``rng_tracker``: the model-parallel RNG tracker whose streams join the rank's RNG file.
    ``vp``: model chunks per pipeline rank (recorded in common.json's ``parallel``).
    """

    tp_group: Group = None
    pp_group: Group = None
    ep_group: Group = None
    rng_tracker: Optional[RNGStatesTracker] = None
    vp: int = 1

    @classmethod
    def of_run(cls, groups, tp_context, vp: int = 1) -> ParallelLayout:
        """The layout of a training run: its ``ParallelGroups`` and the model's
        ``TensorParallelContext`` (whose TP / EP groups are None at size 1)."""
        return cls(
            tp_group=tp_context.group,
            pp_group=groups.pp.group if groups.pp.size > 1 else None,
            ep_group=tp_context.expert_group,
            rng_tracker=tp_context.rng_tracker,
            vp=vp,
        )

    @property
    def tp(self) -> int:
        return group_size(self.tp_group)

    @property
    def pp(self) -> int:
        return group_size(self.pp_group)

    @property
    def ep(self) -> int:
        return group_size(self.ep_group)

    @property
    def rank(self) -> int:
        """This process's global rank (0 without a process group)."""
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world(self) -> int:
        """The global world size (1 without a process group)."""
        return dist.get_world_size() if dist.is_initialized() else 1

    def record(self) -> dict:
        """The ``parallel`` record of common.json: tp, pp, vp (model chunks per pipeline rank),
        dp, world and ep of the run that saved it (the keys and their order are the format's)."""
        world = self.world
        return {
            "tp": self.tp,
            "pp": self.pp,
            "vp": self.vp,
            # Megatron's grid: ep is carved out of dp, so tp * pp alone divides the world.
            "dp": world // (self.tp * self.pp),
            "world": world,
            "ep": self.ep,
        }


SINGLE = ParallelLayout()
"""No model parallelism (one process, DDP, the distributed optimizer, FSDP2)."""
