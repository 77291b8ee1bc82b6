"""megadlms.config: command-line flags (Megatron-LM / MegaDLMs names) -> the typed run
configuration, once, before any process group exists.

    from megadlms.config import parse_config
    config = parse_config(argv, world_size=8)     # RunConfig; one ValueError lists every problem

The door is :func:`parse_config`; the rest of the run sees only the :class:`RunConfig` tree
(``model``, ``diffusion``, ``data``, ``parallel``, ``ddp``, ``optimizer``, ``schedule``,
``training``, ``checkpoint``, ``logging``). Layering: this package sits above ``pipeline``,
``distributed``, ``optimizer``, ``models`` and ``data`` (it reuses their configs and asks
them for their own rules) and below ``checkpoint`` and ``training``; no lower layer imports it.

Files: ``flags/`` the parser (``build_parser``), one module per flag group (``model``,
``fusion``, ``diffusion``, ``parallel``, ``optimizer``, ``training``, ``data``, ``checkpoint``,
``logging``, ``megadlms_only``, ``moe``, ``recompute``), ``megatron_compat.py`` the tables of
accepted-but-inert and not-yet-supported flags, ``messages.py`` field names -> flags,
``rules.py`` the rules that span configs, ``arguments.py`` namespace -> RunConfig,
``checkpoint_args.py`` --use-checkpoint-args, ``run_config.py`` the dataclasses.
"""

from .arguments import (
    build_run_config,
    fsdp_mixed_precision,
    parse_args,
    parse_config,
    validate_args,
)
from .flags import build_parser
from .messages import flag_message
from .profiling_config import ProfilingConfig
from .resilience_config import ResilienceConfig
from .run_config import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    LRScheduleConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
    padded_vocab_size,
)

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "LRScheduleConfig",
    "LoggingConfig",
    "ParallelConfig",
    "ProfilingConfig",
    "ResilienceConfig",
    "RunConfig",
    "TrainingConfig",
    "build_parser",
    "build_run_config",
    "flag_message",
    "fsdp_mixed_precision",
    "padded_vocab_size",
    "parse_args",
    "parse_config",
    "validate_args",
]
