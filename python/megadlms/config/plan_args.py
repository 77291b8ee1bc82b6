"""``megadlms-plan``'s own options; every other flag is the trainer's, parsed by
:func:`~.arguments.parse_config` into the one RunConfig (no second training parser).

    options, config = parse_plan_config(argv)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from .arguments import parse_config
from .run_config import RunConfig

__all__ = ["PlanOptions", "parse_plan_config"]


@dataclass(frozen=True)
class PlanOptions:
    """What to plan for (the run itself comes from the training flags)."""

    world_size: int = 8
    device: str = "H100"
    device_fields: List[str] = field(default_factory=list)
    json: bool = False
    sweep: bool = False
    top: int = 10


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megadlms-plan",
        description="Per-rank memory, FLOPs, communication and predicted step time of a training "
        "command (the trainer's flags), without a GPU.",
        add_help=False,
    )
    p.add_argument("--world-size", "--num-gpus", dest="world_size", type=int, default=8,
                   help="GPUs the run uses (default 8)")  # fmt: skip
    p.add_argument("--device", default="H100", help="device table entry: A100, H100, H200, B200")
    p.add_argument("--device-field", dest="device_fields", action="append", default=[],
                   metavar="FIELD=VALUE", help="override a device-table field, e.g. hbm_gb=94")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--sweep", action="store_true", help="list the layouts that fit, fastest first")
    p.add_argument("--top", type=int, default=10, help="--sweep: how many layouts to print")
    return p


def parse_plan_config(argv: Optional[List[str]]) -> Tuple[PlanOptions, RunConfig, List[str]]:
    """(planner options, the trainer's RunConfig, the training flags) of ``argv``."""
    options, rest = _parser().parse_known_args(argv)
    if options.world_size < 1:
        raise ValueError(f"--world-size {options.world_size}: must be a positive number of GPUs")
    config = parse_config(rest, world_size=options.world_size)
    return PlanOptions(**vars(options)), config, rest


def plan_help() -> str:
    """The planner options' help (the training flags are the trainer's: megadlms-pretrain -h)."""
    return _parser().format_help()
